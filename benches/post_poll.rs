//! Micro-benchmark of the post/poll path (placeholder until the benchmark issue lands).
fn main() {}
