//! Tests: attention (to be filled).
