//! Fuzzes every loader we wrote (the targets of `tests/fuzz.rs`) with at least
//! 10^5 mutated inputs each: no panic, no hang, no broken property, only errors.
//! Writes `benches/results/fuzz-<host>.json` (`fuzz-cpu.json` here).
//!
//!     cargo bench --bench fuzz                      # 100000 cases per target
//!     FUZZ_CASES=1000000 FUZZ_SEED=7 FUZZ_TARGETS=adamw_state,sgd_state cargo bench --bench fuzz
use anyhow::{bail, Result};
use std::time::Duration;

#[path = "../tests/fuzz.rs"]
mod fuzz;

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> Result<T> {
    match std::env::var(key) {
        Ok(v) => match v.parse() {
            Ok(x) => Ok(x),
            Err(_) => bail!("{key}={v:?} does not parse"),
        },
        Err(_) => Ok(default),
    }
}

fn main() -> Result<()> {
    let cases: usize = env_or("FUZZ_CASES", 100_000)?;
    let seed: u64 = env_or("FUZZ_SEED", 1)?;
    let limit = Duration::from_secs(env_or("FUZZ_CASE_LIMIT_S", 10)?);
    let only = std::env::var("FUZZ_TARGETS").ok();
    let names: Vec<&str> = fuzz::TARGETS
        .iter()
        .copied()
        .filter(|n| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|x| x == *n))
        })
        .collect();
    if names.is_empty() {
        bail!("FUZZ_TARGETS={only:?} selects none of {:?}", fuzz::TARGETS);
    }
    println!(
        "{:<16} {:>9} {:>9} {:>9} {:>7} {:>11} {:>8}",
        "target", "cases", "accepted", "rejected", "failed", "max case ms", "seconds"
    );
    let mut rows = Vec::new();
    for name in names {
        let r = fuzz::run(fuzz::target(name)?, cases, seed, limit)?;
        println!(
            "{:<16} {:>9} {:>9} {:>9} {:>7} {:>11.2} {:>8.1}",
            r.name, r.cases, r.accepted, r.rejected, r.failed, r.max_case_ms, r.seconds
        );
        for (input, msg) in &r.failures {
            println!("  FAILURE {msg}\n    input {input}");
        }
        rows.push(serde_json::json!({
            "target": r.name, "cases": r.cases, "accepted": r.accepted, "rejected": r.rejected,
            "failed": r.failed, "failures": r.failures, "max_case_ms": r.max_case_ms,
            "seconds": r.seconds,
        }));
    }
    let dir = std::env::var("BENCH_RESULTS_DIR").unwrap_or_else(|_| "benches/results".into());
    std::fs::create_dir_all(&dir)?;
    let out = format!("{dir}/fuzz-cpu.json");
    let report = serde_json::json!({
        "command": "cargo bench --bench fuzz",
        "seed": seed, "cases_per_target": cases, "case_limit_s": limit.as_secs(),
        "targets": rows,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {out}");
    let failed: usize = rows
        .iter()
        .filter_map(|r| r["failed"].as_u64())
        .sum::<u64>() as usize;
    if failed > 0 {
        bail!("{failed} fuzz cases failed (see above and {out})");
    }
    Ok(())
}
