//! Benchmark: attention (to be filled).
fn main() {}
