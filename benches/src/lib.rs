//! Shared helpers for kiln criterion benchmarks.
