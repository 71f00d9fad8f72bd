//! Benchmark: adamw (to be filled).
fn main() {}
