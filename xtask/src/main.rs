//! `cargo xtask`: kiln harness tasks.
fn main() {}
