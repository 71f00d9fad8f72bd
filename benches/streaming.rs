//! Benchmark: streaming (to be filled).
fn main() {}
