//! Placeholder (the async RPC example comes in the next commit).
fn main() {}
