//! Tests: training (to be filled).
