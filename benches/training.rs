//! Benchmark: training (to be filled).
fn main() {}
