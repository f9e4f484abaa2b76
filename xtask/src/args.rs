//! What every task's flags share, below all of them: the parsers of count flags (with the
//! accepted range in every refusal), a path resolved against the directory the user typed
//! it in, and the workspace root found as cargo finds it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A count flag's parser: an integer from `min` up. A negative number reaches it (see
/// `with_negative_values` in main.rs) and is refused with the accepted range, as is any
/// other value, instead of clap's "unexpected argument '-1'".
pub fn count(min: u64) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let accepted = format!("accepted values are {min} to {}", u64::MAX);
        match s.parse::<u64>() {
            Ok(n) if n >= min => Ok(n),
            Ok(n) => Err(format!("{n}: {accepted}")),
            Err(_) if s.len() > 1 && s.starts_with('-') && s[1..].bytes().all(|b| b.is_ascii_digit()) => {
                Err(format!("{s} is negative: {accepted}"))
            }
            Err(e) => Err(format!("{e}: {accepted}")),
        }
    }
}

/// [`count`] for a flag held as `usize`: the same messages, the same range check.
pub fn count_usize(min: u64) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    let parse = count(min);
    move |s: &str| {
        let n = parse(s)?;
        usize::try_from(n).map_err(|_| format!("{n}: accepted values are {min} to {}", usize::MAX))
    }
}

/// Resolves a path the user typed against the directory they typed it in.
pub fn user_path(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    Ok(std::env::current_dir().context("reading the current directory")?.join(p))
}

/// The workspace root, found from `cwd` as cargo finds it: the nearest directory at or
/// above it whose Cargo.toml has a `[workspace]` table. Not the directory xtask was built
/// from: two checkouts may share one target directory, and so one xtask binary. Outside
/// any workspace, `cwd` itself.
pub fn project_root(cwd: &Path) -> PathBuf {
    cwd.ancestors()
        .find(|dir| {
            std::fs::read_to_string(dir.join("Cargo.toml"))
                .is_ok_and(|text| text.lines().any(|l| l.trim() == "[workspace]"))
        })
        .unwrap_or(cwd)
        .to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_is_the_nearest_workspace_above_the_current_directory() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("checkout");
        let member = ws.join("crates/member/src");
        std::fs::create_dir_all(&member).unwrap();
        std::fs::write(ws.join("Cargo.toml"), "[workspace]\nmembers = [\"crates/*\"]\n").unwrap();
        std::fs::write(ws.join("crates/member/Cargo.toml"), "[package]\nname = \"member\"\n").unwrap();
        assert_eq!(project_root(&member), ws);
        assert_eq!(project_root(&ws), ws);
        assert_eq!(project_root(dir.path()), dir.path(), "outside a workspace: the directory itself");
    }
}
