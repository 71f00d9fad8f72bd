//! Docs and comments that name a file keep naming one that exists: every
//! `benches/results/...` and `scripts/...` path written in the sources, docs,
//! benches, examples and tests, and every result file the results dashboard
//! names in backticks. A path written as a template (`lm-{device}.json`,
//! `lora-timeline-<tag>.json`, `*-cpu.*`) or as a prefix (`generate-`) is not
//! a file name and is skipped.
use anyhow::{ensure, Result};
use std::path::{Path, PathBuf};

/// Characters a file name in these paths is made of.
fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/')
}

/// The paths starting with `prefix` in `text` (trailing punctuation
/// dropped), but templates and prefixes.
fn named(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices(prefix) {
        if text[..at].ends_with(name_char) {
            // Part of a longer path (`../shared/scripts/...`, `x/benches/...`).
            continue;
        }
        let rest = &text[at..];
        let end = rest.find(|c: char| !name_char(c)).unwrap_or(rest.len());
        let path = rest[..end].trim_end_matches(['.', ',']);
        let next = rest[end..].chars().next();
        let template = matches!(next, Some('{' | '<' | '*' | '$'));
        if template || path.ends_with(['-', '/', '_']) || path.len() == prefix.len() {
            continue;
        }
        out.push(path.to_string());
    }
    out
}

/// Every `.rs` and `.md` file under `dir`, skipping build output.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | "results" | ".git") {
                sources(&path, out)?;
            }
        } else if name.ends_with(".rs") || name.ends_with(".md") {
            out.push(path);
        }
    }
    Ok(())
}

#[test]
fn named_files_exist() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![
        root.join("README.md"),
        root.join("benches/results/README.md"),
    ];
    for dir in [
        "crates", "models", "src", "docs", "benches", "examples", "tests", "kernels",
    ] {
        sources(&root.join(dir), &mut files)?;
    }
    let mut missing = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file)?;
        for prefix in ["benches/results/", "scripts/"] {
            for path in named(&text, prefix) {
                if !root.join(&path).exists() {
                    missing.push(format!("{} names {path}", file.display()));
                }
            }
        }
    }
    // The dashboard names its files bare, in backticks.
    let results = root.join("benches/results");
    let dashboard = std::fs::read_to_string(results.join("README.md"))?;
    for quoted in dashboard.split('`').skip(1).step_by(2) {
        let is_file = [".json", ".log", ".svg", ".txt", ".csv"]
            .iter()
            .any(|ext| quoted.ends_with(ext));
        let plain = !quoted.starts_with('.') && quoted.chars().all(|c| name_char(c) && c != '/');
        if is_file && plain && !results.join(quoted).exists() {
            missing.push(format!("benches/results/README.md names {quoted}"));
        }
    }
    ensure!(
        missing.is_empty(),
        "{} named files do not exist:\n{}",
        missing.len(),
        missing.join("\n")
    );
    Ok(())
}

#[test]
fn template_and_prefix_paths_are_not_file_names() {
    let text = "see `benches/results/lm-{device}.json`, benches/results/generate- rows, \
                scripts/gpu-checks.sh. and ../shared/scripts/x.sh";
    assert_eq!(named(text, "benches/results/"), Vec::<String>::new());
    assert_eq!(named(text, "scripts/"), vec!["scripts/gpu-checks.sh"]);
}
