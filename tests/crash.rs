//! Crash consistency of checkpoints: a child process (this test binary again, in
//! child mode) trains a micro Llama on the CPU through the library's own loop
//! (`train_loop` saving with `LmTrainer::save` after every step, what `train_lm`
//! runs), and the parent kills it with SIGKILL at random moments. After each kill
//! the newest complete checkpoint must load (`LmTrainer::resume` checks the
//! config, every weight and the optimizer state), hold the uninterrupted run's
//! weights of its step bit for bit, never be older than a save the child had
//! reported done, and, trained on to a fixed step, give bit-identical parameters
//! to a run that was never interrupted.
//!
//! `STREAMER_CRASH_KILLS` (default 50) sets the number of kills and
//! `STREAMER_CRASH_SEED` (default 12) the kill moments, for longer runs:
//! `STREAMER_CRASH_KILLS=1000 cargo test --test integration crash::`.
//! `STREAMER_CRASH_REPORT=<file>` writes the tally as JSON (what
//! `benches/reliability.rs` reports).
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device};
use candle_nn::ParamsAdamW;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use streamer_core::StreamConfig;
use streamer_models::{
    init_weights, train_loop, ByteCorpus, CheckpointFiles, Llama, LlamaConfig, LmTrainer,
    LoopOptions,
};

/// Set in the child's environment: the checkpoint folder it trains into.
const CHILD_DIR: &str = "STREAMER_CRASH_CHILD_DIR";
/// The step every run trains to; a folder whose checkpoint reaches it starts over.
const FINAL_STEP: usize = 10;
/// This module's child-mode test, as libtest names it.
const CHILD_TEST: &str = "crash::checkpoint_crash_child_mode";

/// A micro decoder: 2 layers of width 16, 2 query heads / 1 key-value head of 8.
fn config() -> LlamaConfig {
    LlamaConfig {
        max_position_embeddings: 16,
        ..LlamaConfig::bytes(16, 2, 2, 1)
    }
}

fn stream() -> StreamConfig {
    crate::common::stream(&Device::Cpu, DType::F32, 1)
}

fn adam() -> ParamsAdamW {
    ParamsAdamW {
        lr: 3e-3,
        weight_decay: 0.01,
        ..Default::default()
    }
}

fn corpus() -> ByteCorpus {
    ByteCorpus::new(b"A crash may come at any byte of any save. ".repeat(8))
}

/// `train_lm`'s loop options at this size: a save after every step.
fn opts(steps: usize, dir: Option<PathBuf>) -> LoopOptions {
    LoopOptions {
        seed: 5,
        lr: 3e-3,
        warmup: 3,
        save_every: Some(1),
        checkpoint_dir: dir,
        ..crate::common::loop_options(steps, 12)
    }
}

/// A trainer from step 0, optimizer overlapped with backward (`train_lm`'s default).
fn fresh_trainer() -> Result<LmTrainer> {
    let cfg = config();
    let model = Llama::from_tensors(init_weights(&cfg, 3)?, &cfg, stream())?;
    let mut t = LmTrainer::new(model, adam())?;
    t.set_overlap(true);
    Ok(t)
}

fn resume(dir: &Path) -> Result<LmTrainer> {
    let mut t = LmTrainer::resume(dir, stream(), adam())
        .with_context(|| format!("resuming from {}", dir.display()))?;
    t.set_overlap(true);
    Ok(t)
}

/// Every parameter's bits, by name.
type Bits = Vec<(String, Vec<u32>)>;

fn params_bits(t: &LmTrainer) -> Result<Bits> {
    t.model()
        .parameters()
        .into_iter()
        .map(|(n, v)| {
            let x = v.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            Ok((n, x.into_iter().map(f32::to_bits).collect()))
        })
        .collect()
}

/// The uninterrupted run: parameters after each step `0..=FINAL_STEP`.
fn reference() -> Result<Vec<Bits>> {
    let mut t = fresh_trainer()?;
    let mut out = vec![params_bits(&t)?];
    for s in 1..=FINAL_STEP {
        train_loop(&mut t, &corpus(), &opts(s, None), |_| {})?;
        out.push(params_bits(&t)?);
    }
    Ok(out)
}

/// Child mode: does nothing unless `STREAMER_CRASH_CHILD_DIR` is set. Then it
/// resumes from the folder's checkpoint (or starts at step 0), prints
/// `CRASH-READY <step>`, and trains to `FINAL_STEP`, printing `CRASH-SAVED <step>`
/// after each save returns.
#[test]
fn checkpoint_crash_child_mode() -> Result<()> {
    let Some(dir) = std::env::var_os(CHILD_DIR).map(PathBuf::from) else {
        return Ok(());
    };
    let mut t = if dir.join("checkpoint.json").exists() {
        resume(&dir)?
    } else {
        fresh_trainer()?
    };
    println!("CRASH-READY {}", t.steps_done());
    train_loop(&mut t, &corpus(), &opts(FINAL_STEP, Some(dir)), |r| {
        if r.saved {
            println!("CRASH-SAVED {}", r.step);
        }
    })?;
    println!("CRASH-DONE");
    Ok(())
}

/// What one child did before it was killed (or finished).
struct ChildRun {
    killed: bool,
    /// Steps of the saves it reported done, with when.
    saved: Vec<(Instant, usize)>,
    ready_at: Option<Instant>,
}

/// A child's stdout lines with when each came, filled by a reader thread.
type Lines = Arc<Mutex<Vec<(Instant, String)>>>;

/// Reads the child's stdout lines into `lines` as they come.
fn collect_lines(child: &mut Child) -> Result<Lines> {
    let out = child.stdout.take().context("child stdout")?;
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            if let Ok(mut v) = sink.lock() {
                v.push((Instant::now(), line));
            }
        }
    });
    Ok(lines)
}

/// Starts a child on `dir`, waits until it is ready, lets it run `delay`, then
/// kills it with SIGKILL (unless it finished first).
fn run_child(dir: &Path, delay: Duration) -> Result<ChildRun> {
    let mut child = crate::common::child_test(CHILD_TEST)?
        .env(CHILD_DIR, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the child")?;
    let lines = collect_lines(&mut child)?;
    fn ready(l: &[(Instant, String)]) -> Option<&(Instant, String)> {
        l.iter().find(|(_, s)| s.starts_with("CRASH-READY"))
    }
    let t0 = Instant::now();
    let mut ready_at = None;
    while ready_at.is_none() && t0.elapsed() < Duration::from_secs(60) {
        if child.try_wait()?.is_some() {
            break;
        }
        ready_at = lines.lock().ok().and_then(|l| ready(&l).map(|r| r.0));
        std::thread::sleep(Duration::from_micros(200));
    }
    if ready_at.is_some() {
        std::thread::sleep(delay);
    }
    let killed = child.try_wait()?.is_none();
    if killed {
        child.kill()?; // SIGKILL on Unix
    }
    let status = child.wait()?;
    if !killed && !status.success() {
        let mut err = String::new();
        child.stderr.take().map(|mut e| e.read_to_string(&mut err));
        bail!("the child failed ({status}) on {}: {err}", dir.display());
    }
    // The reader ends at the pipe's end (the child is gone); give it a moment.
    std::thread::sleep(Duration::from_millis(2));
    let l = lines.lock().map_err(|_| anyhow::anyhow!("lines lock"))?;
    let saved = l
        .iter()
        .filter_map(|(t, s)| Some((*t, s.strip_prefix("CRASH-SAVED ")?.parse().ok()?)))
        .collect();
    ensure!(killed || ready_at.is_some(), "the child never got ready");
    Ok(ChildRun {
        killed,
        saved,
        ready_at: ready(&l).map(|r| r.0),
    })
}

/// Checks the folder after a kill: the newest complete checkpoint (if any)
/// loads, is no older than `acked`, holds the reference weights of its step,
/// and trains on to the reference's final parameters. Returns its step.
fn verify(dir: &Path, acked: Option<usize>, reference: &[Bits]) -> Result<Option<usize>> {
    let files = match CheckpointFiles::read(dir) {
        Ok(f) => f,
        Err(e) => {
            ensure!(
                acked.is_none(),
                "the save of step {acked:?} was reported done, but: {e}"
            );
            ensure!(
                !dir.join("checkpoint.json").exists(),
                "checkpoint.json exists but does not read: {e}"
            );
            return Ok(None);
        }
    };
    let k = files.step;
    ensure!(
        (1..=FINAL_STEP).contains(&k),
        "checkpoint.json says step {k}"
    );
    if let Some(a) = acked {
        ensure!(
            k >= a,
            "checkpoint at step {k} but step {a}'s save had returned"
        );
    }
    let mut t = resume(dir)?;
    ensure!(t.steps_done() == k, "resumed at {} not {k}", t.steps_done());
    ensure!(
        params_bits(&t)? == reference[k],
        "the weights saved at step {k} differ from the uninterrupted run's"
    );
    train_loop(&mut t, &corpus(), &opts(FINAL_STEP, None), |_| {})?;
    ensure!(
        params_bits(&t)? == reference[FINAL_STEP],
        "resumed from step {k}, the parameters at step {FINAL_STEP} differ from the uninterrupted run's"
    );
    Ok(Some(k))
}

/// File names in `dir`, sorted (none if it does not exist yet).
fn listing(dir: &Path) -> Result<Vec<String>> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    v.sort();
    Ok(v)
}

/// What the kills hit, for the report and the check that saves were hit.
#[derive(Default, Debug)]
struct Tally {
    kills: usize,
    children: usize,
    /// Kills that left a `.tmp` file (inside a file's write, fsync or rename).
    torn_file: usize,
    /// Kills that left a complete file the checkpoint does not name yet.
    between_files: usize,
    no_checkpoint: usize,
    completed: usize,
    verified: usize,
}

/// Counts what a kill left in `dir` that was not there before the child
/// started (`before`).
fn tally_kill(tally: &mut Tally, dir: &Path, before: &[String], step: Option<usize>) -> Result<()> {
    let names = listing(dir)?;
    let new: Vec<&String> = names.iter().filter(|n| !before.contains(n)).collect();
    if new.iter().any(|n| n.ends_with(".tmp")) {
        tally.torn_file += 1;
    } else {
        let current = step.map(|k| format!("{k:08}.safetensors"));
        let orphan = new.iter().any(|n| {
            (n.starts_with("weights-") || n.starts_with("optimizer-"))
                && current.as_ref().is_none_or(|c| !n.ends_with(c.as_str()))
        });
        tally.between_files += usize::from(orphan);
    }
    tally.no_checkpoint += usize::from(step.is_none());
    Ok(())
}

/// A finished run leaves exactly the final save's files.
fn check_final_listing(dir: &Path) -> Result<()> {
    let want = [
        "checkpoint.json".to_string(),
        "config.json".to_string(),
        format!("optimizer-{FINAL_STEP:08}.safetensors"),
        format!("weights-{FINAL_STEP:08}.safetensors"),
    ];
    let got = listing(dir)?;
    ensure!(
        got == want,
        "a finished run left {got:?}, expected {want:?}"
    );
    Ok(())
}

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> Result<T> {
    match std::env::var(key) {
        Ok(v) => v.parse().ok().with_context(|| format!("{key}={v:?}")),
        Err(_) => Ok(default),
    }
}

#[cfg(unix)]
#[test]
fn checkpoint_survives_sigkill_at_random_moments() -> Result<()> {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let kills: usize = env_or("STREAMER_CRASH_KILLS", 50)?;
    let mut rng = StdRng::seed_from_u64(env_or("STREAMER_CRASH_SEED", 12)?);
    let reference = reference()?;
    let dir = std::env::temp_dir().join(format!("streamer-crash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut tally, mut acked) = (Tally::default(), None::<usize>);
    // Seconds from one save to the next in the child, learnt as kills go.
    let mut cycle = 0.02f64;
    let t0 = Instant::now();
    // Until `kills` kills, and on (up to 8x as many) until one lands inside a
    // save: on a fast machine saves are short and random kills can miss them.
    let in_save = |t: &Tally| t.torn_file + t.between_files > 0;
    while tally.kills < kills || (!in_save(&tally) && tally.kills < 8 * kills) {
        ensure!(
            tally.children < 32 * kills + 20,
            "children keep finishing: {tally:?}"
        );
        // Kill within about the next three saves.
        let delay = Duration::from_secs_f64(rng.random::<f64>() * 3.0 * cycle);
        let before = listing(&dir)?;
        let run = run_child(&dir, delay)?;
        tally.children += 1;
        if let Some(&(_, s)) = run.saved.last() {
            acked = acked.max(Some(s));
        }
        match (run.ready_at, run.saved.last()) {
            (Some(r), Some(&(t, _))) => {
                let per = t.duration_since(r).as_secs_f64() / run.saved.len() as f64;
                cycle = 0.7 * cycle + 0.3 * per;
            }
            // Killed before its first save: saves take longer than guessed.
            _ if run.killed => cycle *= 1.3,
            _ => {}
        }
        let step = verify(&dir, acked, &reference)
            .with_context(|| format!("after kill {} ({tally:?})", tally.kills))?;
        tally.verified += usize::from(step.is_some());
        if run.killed {
            tally.kills += 1;
            tally_kill(&mut tally, &dir, &before, step)?;
        } else {
            tally.completed += 1;
            check_final_listing(&dir)?;
        }
        if step == Some(FINAL_STEP) {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
            acked = None;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "crash test: {tally:?}, save cycle {:.1} ms, {:.1} s",
        cycle * 1e3,
        t0.elapsed().as_secs_f64()
    );
    // The kills must have hit saves, or the test proves nothing about them.
    ensure!(
        tally.torn_file + tally.between_files > 0,
        "no kill landed inside a save: {tally:?}"
    );
    ensure!(
        2 * tally.verified >= tally.kills,
        "most kills found no checkpoint to verify: {tally:?}"
    );
    if let Some(path) = std::env::var_os("STREAMER_CRASH_REPORT") {
        // For benches/reliability.rs: what this run survived.
        let report = serde_json::json!({
            "kills": tally.kills, "children": tally.children,
            "kills_inside_a_file_write": tally.torn_file,
            "kills_between_files": tally.between_files,
            "kills_before_any_checkpoint": tally.no_checkpoint,
            "children_completed": tally.completed,
            "recoveries_verified_bit_identical": tally.verified,
            "seconds": t0.elapsed().as_secs_f64(),
            "command": format!(
                "STREAMER_CRASH_KILLS={kills} STREAMER_CRASH_REPORT=... cargo test --test integration crash::"
            ),
        });
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", Path::new(&path).display()))?;
    }
    Ok(())
}
