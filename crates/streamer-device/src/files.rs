//! Files written whole or not at all: every file the project saves (weights,
//! optimizer state, checkpoint pointers, configs) goes through
//! [`replace_atomic`], and files a checkpoint or an index names are checked to
//! stay in its folder ([`sibling_file`]).
use crate::Error;
use candle_core::{Result, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// `dir/name`, after checking that `name` is one plain file name (not empty,
/// no path separator, not `.` or `..`, not absolute): files that a checkpoint or
/// an index names must stay in its folder. `what` starts the error message.
pub fn sibling_file(dir: &Path, name: &str, what: &str) -> Result<PathBuf> {
    let mut parts = Path::new(name).components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(n)), None) if n == name && !name.contains('\\') => {
            Ok(dir.join(name))
        }
        _ => candle_core::bail!(
            "{what}: {name:?} is not a plain file name in {} (no folders, \"..\" or absolute paths)",
            dir.display()
        ),
    }
}

/// `<path>.tmp`: where [`replace_atomic`] writes before the rename.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    PathBuf::from(tmp)
}

/// Replaces `path` atomically and durably: `write` fills `<path>.tmp` (in the
/// same folder), which is flushed to the disk (`fsync`), renamed over `path`,
/// and then the folder itself is flushed (on Unix), so that after a crash or a
/// power loss readers see the old file or the new one, never a partial one, and
/// a save that returned is not lost. On an error the temporary file is removed
/// and `path` is left as it was. Every file the project saves (weights,
/// optimizer state, checkpoint pointers) goes through here.
pub fn replace_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temp_path(path);
    let written = write(&tmp)
        .map_err(|e| match Error::find(&e) {
            // Typed already (out of memory while gathering what to write).
            Some(_) => Error::prefixed(e, format_args!("cannot write {}", tmp.display())),
            None => file_error(&tmp, format_args!("cannot write: {e}")),
        })
        .and_then(|()| sync_file(&tmp));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        file_error(
            path,
            format_args!("cannot rename {} here: {e}", tmp.display()),
        )
    })?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Flushes a written file's data and metadata to the disk.
fn sync_file(path: &Path) -> Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| file_error(path, format_args!("cannot fsync: {e}")))
}

/// A file that cannot be written or read: [`Error::Checkpoint`].
fn file_error(path: &Path, reason: std::fmt::Arguments<'_>) -> candle_core::Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
    .into()
}

/// Flushes a folder's entries (files created, renamed or removed in it) to the
/// disk, so that a rename survives a power loss. `""` means the current folder.
/// A no-op where folders cannot be opened as files (Windows, whose rename is
/// durable once it returns).
pub fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        std::fs::File::open(dir)
            .and_then(|f| f.sync_all())
            .map_err(|e| file_error(dir, format_args!("cannot fsync the folder: {e}")))
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

/// Saves tensors to `path` as safetensors through [`replace_atomic`].
pub fn save_atomic(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    replace_atomic(path, |tmp| candle_core::safetensors::save(tensors, tmp))
}

/// Writes `text` to `path` through [`replace_atomic`].
pub fn write_atomic(path: &Path, text: &str) -> Result<()> {
    replace_atomic(path, |tmp| {
        std::fs::write(tmp, text).map_err(candle_core::Error::wrap)
    })
}
