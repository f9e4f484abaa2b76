//! The `kiln` binary.
fn main() {}
