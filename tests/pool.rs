//! Tests: pool (to be filled).
