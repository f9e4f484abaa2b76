//! Records the commit kiln-serve is built from for its `system_fingerprint`, as
//! `BUILD_COMMIT` (12 hex digits, `unknown` outside a git checkout or without
//! git), and reruns when the checked-out commit changes.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(dir).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

fn main() {
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let commit = git(&dir, &["rev-parse", "--short=12", "HEAD"])
        .filter(|c| c.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=BUILD_COMMIT={commit}");
    // HEAD, the branch it names and packed-refs: a commit or a checkout changes one of
    // them. Only existing files are named (a missing one would rerun every build).
    let mut watched = vec![git(&dir, &["rev-parse", "--git-path", "HEAD"])];
    if let Some(branch) = git(&dir, &["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&dir, &["rev-parse", "--git-path", &branch]));
    }
    watched.push(git(&dir, &["rev-parse", "--git-path", "packed-refs"]));
    for path in watched.into_iter().flatten() {
        let path = dir.join(path);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
