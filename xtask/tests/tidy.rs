//! Tidy checks over the workspace's sources, the house rules a reviewer would otherwise
//! have to remember: every `.rs` file opens with a `//!` line saying what it is, and every
//! library crate denies missing docs. They read files as text and run nothing.

use std::fs;
use std::path::{Path, PathBuf};

/// The workspace root: xtask lives one level below it.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Every `.rs` file below `dir`, skipping build output and hidden folders.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || name == "target" {
            continue;
        }
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() {
            rust_files(&path, out);
        } else if kind.is_file() && name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// The workspace members' folders: `crates/*`, `xtask` and `benches`.
fn member_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(root.join("crates"))
        .expect("reading crates/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    dirs.push(root.join("xtask"));
    dirs.push(root.join("benches"));
    dirs.sort();
    dirs
}

#[test]
fn every_rust_file_opens_with_a_module_doc_line() {
    let root = workspace_root();
    let mut files = Vec::new();
    for dir in member_dirs(&root) {
        rust_files(&dir, &mut files);
    }
    assert!(files.len() > 50, "found only {} .rs files under {}", files.len(), root.display());
    let offenders: Vec<String> = files
        .iter()
        .filter(|f| {
            let text = fs::read_to_string(f).unwrap_or_default();
            !text.lines().next().is_some_and(|l| l.starts_with("//!"))
        })
        .map(|f| f.strip_prefix(&root).unwrap_or(f).display().to_string())
        .collect();
    assert!(offenders.is_empty(), "these files do not open with a `//!` line: {offenders:#?}");
}

#[test]
fn every_library_crate_denies_missing_docs() {
    let root = workspace_root();
    let libs: Vec<PathBuf> =
        member_dirs(&root).into_iter().map(|d| d.join("src/lib.rs")).filter(|l| l.is_file()).collect();
    assert!(libs.len() >= 4, "found only {} library crates", libs.len());
    let offenders: Vec<String> = libs
        .iter()
        .filter(|l| {
            !fs::read_to_string(l)
                .unwrap_or_default()
                .lines()
                .any(|line| line.trim() == "#![deny(missing_docs)]")
        })
        .map(|l| l.strip_prefix(&root).unwrap_or(l).display().to_string())
        .collect();
    assert!(offenders.is_empty(), "these library crates do not `#![deny(missing_docs)]`: {offenders:#?}");
}
