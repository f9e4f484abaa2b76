//! The docs a newcomer reads say only what exists, and everything that exists is in them:
//! every `cargo xtask TASK --flag` and `kiln COMMAND --flag` that README.md or docs/*.md
//! shows is one the binary's help lists, every task, command and long flag the binaries
//! have is named in some doc, and every `KILN_*` variable the code reads is in
//! docs/environment-variables.md while every one the docs name is read somewhere.
//!
//! docs/benchmark_results/ is left out on purpose: each file there is a dated record of
//! what was run at a named commit, and a flag renamed since stays as it was typed then.

#[allow(dead_code)]
mod util;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives below the workspace root")
        .to_path_buf()
}

/// README.md and docs/*.md, each with its text.
fn docs() -> Vec<(String, String)> {
    let root = root();
    let mut paths = vec![root.join("README.md")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    more.sort();
    paths.extend(more);
    paths
        .into_iter()
        .map(|p| {
            let name = p.strip_prefix(&root).unwrap().display().to_string();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect()
}

fn help(bin: &Path, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).arg("--help").output().expect("running --help");
    assert!(
        out.status.success(),
        "{} {args:?} --help failed: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The subcommands a help text lists (without `help`).
fn commands(help: &str) -> Vec<String> {
    let Some(rest) = help.split("\nCommands:\n").nth(1) else { return Vec::new() };
    rest.lines()
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// The long flags (`--name`) and short ones (`-m`) a help text lists.
fn flags(help: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in help.lines() {
        let t = line.trim_start();
        // An option's own line is indented by at most six spaces; its description's
        // wrapped lines, which may start with a flag they mention, by more.
        if !t.starts_with('-') || line.len() - t.len() > 6 {
            continue;
        }
        let clean =
            |w: &str| w.chars().skip_while(|c| *c == '-').all(|c| c.is_ascii_alphanumeric() || c == '-');
        for word in t.split("  ").next().unwrap_or("").split([' ', ',', '=']) {
            let w = word.trim_end_matches(['<', '>']);
            if clean(w)
                && ((w.starts_with("--") && w.len() > 2) || (w.len() == 2 && w.starts_with('-') && w != "--"))
            {
                out.insert(w.to_string());
            }
        }
        // Aliases clap lists as `[aliases: --models, -m]`.
        if let Some(a) = t.split("[aliases: ").nth(1) {
            for w in a.trim_end_matches(']').split(", ") {
                out.insert(w.trim_end_matches(']').to_string());
            }
        }
    }
    out
}

/// A binary's commands (with `oom-record list`-style subcommands as `oom-record list`),
/// each with its flags.
fn surface(bin: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for c in commands(&help(bin, &[])) {
        let h = help(bin, &[&c]);
        let subs = commands(&h);
        out.insert(c.clone(), flags(&h));
        for s in subs {
            out.insert(format!("{c} {s}"), flags(&help(bin, &[&c, &s])));
        }
    }
    out
}

/// The commands a doc shows: inside code (fenced blocks and `spans`), with `\`
/// continuations joined, every `PREFIX NAME [SUB] ...` up to the end of the code, with the
/// line it starts on.
fn shown(text: &str, prefix: &str) -> Vec<(usize, String)> {
    let mut code: Vec<(usize, String)> = Vec::new();
    let mut fenced = false;
    let mut carry: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            let (start, mut joined) = carry.take().unwrap_or((n, String::new()));
            joined.push_str(line.trim_end_matches('\\'));
            joined.push(' ');
            if line.trim_end().ends_with('\\') {
                carry = Some((start, joined));
            } else {
                code.push((start, joined));
            }
        } else {
            for (k, span) in line.split('`').enumerate() {
                if k % 2 == 1 {
                    code.push((n, span.to_string()));
                }
            }
        }
    }
    let mut out = Vec::new();
    for (n, c) in code {
        let mut rest = c.as_str();
        while let Some(at) = rest.find(prefix) {
            let before_ok = at == 0 || rest[..at].ends_with([' ', '(', '$', ';', '&', '|']);
            let after = &rest[at + prefix.len()..];
            let end = after.find(['#', '|', ';', '&', ')']).unwrap_or(after.len());
            if before_ok {
                out.push((n, after[..end].trim().to_string()));
            }
            rest = &after[end.min(after.len())..];
            if end == 0 {
                rest = &after[1.min(after.len())..];
            }
        }
    }
    out
}

fn check_shown(bin: &Path, prefix: &str, problems: &mut Vec<String>) {
    let surface = surface(bin);
    for (doc, text) in docs() {
        for (line, cmd) in shown(&text, prefix) {
            let words: Vec<&str> = cmd.split_whitespace().collect();
            let Some(first) = words.first() else { continue };
            if !first.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                || first.ends_with(['-', '*'])
                || first.contains(['*', '<', '['])
            {
                continue; // `bench-*`, `<task>`: a pattern, not a command.
            }
            let (name, from) = match words.get(1) {
                Some(s) if surface.contains_key(&format!("{first} {s}")) => (format!("{first} {s}"), 2),
                _ => (first.to_string(), 1),
            };
            let Some(known) = surface.get(&name) else {
                if prefix == "cargo xtask " {
                    problems.push(format!("{doc}:{line}: `{prefix}{first}`: no such task"));
                }
                continue; // `kiln` is also the project's name in prose code spans.
            };
            for w in &words[from..] {
                let flag = w.split('=').next().unwrap().trim_matches(['"', '\'', ',', '.']);
                if flag.starts_with("--") && flag.len() > 2 && !known.contains(flag) {
                    problems.push(format!("{doc}:{line}: `{prefix}{name}` has no {flag}"));
                }
            }
        }
    }
}

fn xtask_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_xtask"))
}

#[test]
fn every_command_and_flag_a_doc_shows_exists() {
    let mut problems = Vec::new();
    check_shown(xtask_bin(), "cargo xtask ", &mut problems);
    check_shown(util::kiln_bin(), "kiln ", &mut problems);
    assert!(problems.is_empty(), "the docs show what the binaries do not have:\n{}", problems.join("\n"));
}

#[test]
fn every_task_command_and_long_flag_is_named_in_a_doc() {
    let all: String = docs().into_iter().map(|(_, t)| t).collect::<Vec<_>>().join("\n");
    let mut missing = Vec::new();
    for (bin, what) in [(xtask_bin(), "cargo xtask"), (util::kiln_bin(), "kiln")] {
        for (name, flags) in surface(bin) {
            if !all.contains(&format!("{what} {name}")) && !all.contains(&format!("`{name}`")) {
                missing.push(format!("{what} {name}"));
            }
            for f in flags.iter().filter(|f| f.starts_with("--") && *f != "--help" && *f != "--version") {
                let named = all.match_indices(f.as_str()).any(|(i, _)| {
                    !all[i + f.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-')
                });
                if !named {
                    missing.push(format!("{what} {name} {f}"));
                }
            }
        }
    }
    assert!(missing.is_empty(), "no doc names these:\n{}", missing.join("\n"));
}

/// Every `"KILN_..."` string in the workspace's Rust sources, and every `KILN_...` the
/// scripts and CI read, with the file it is in. Single-letter names are test fixtures
/// (`KILN_A`..`KILN_D` in the Slurm script's quoting test).
fn variables_in_code() -> BTreeMap<String, String> {
    let root = root();
    let mut out = BTreeMap::new();
    let mut files = Vec::new();
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name != ".ci" || name == "target" || name == "benchmark_results" {
                continue;
            }
            if p.is_dir() {
                walk(&p, out);
            } else if p.ends_with("xtask/tests/docs.rs") {
                // This file names variables in its own checks.
            } else if name.ends_with(".rs") || name.ends_with(".sh") || name.ends_with(".py") || name == "run"
            {
                out.push(p);
            }
        }
    }
    for d in ["crates", "xtask", "benches", "scripts", ".ci"] {
        walk(&root.join(d), &mut files);
    }
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        let rust = f.extension().is_some_and(|e| e == "rs");
        for (i, _) in text.match_indices("KILN_") {
            if rust && !text[..i].ends_with('"') {
                continue; // a Rust name (KILN_OOM_EXIT_CODE), not a variable.
            }
            let name: String = text[i..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let name = name.trim_end_matches('_').to_string();
            if rust && !text[i + name.len()..].starts_with('"') {
                continue; // a prefix being built, such as "KILN_" + name.
            }
            if name.len() <= "KILN_".len() + 1 {
                continue;
            }
            out.entry(name).or_insert_with(|| f.strip_prefix(&root).unwrap().display().to_string());
        }
    }
    out
}

#[test]
fn every_kiln_variable_is_documented_and_every_documented_one_is_read() {
    let env_doc = std::fs::read_to_string(root().join("docs/environment-variables.md")).unwrap();
    let code = variables_in_code();
    // Script arguments named in usage lines (`openai_smoke.sh KILN_BINARY PYTHON`) are
    // placeholders, not variables.
    let undocumented: Vec<String> = code
        .iter()
        .filter(|(v, f)| {
            let placeholder = f.ends_with(".sh") && *v == "KILN_BINARY";
            !placeholder && !env_doc.contains(v.as_str())
        })
        .map(|(v, f)| format!("{v} (read in {f})"))
        .collect();
    assert!(undocumented.is_empty(), "docs/environment-variables.md lacks:\n{}", undocumented.join("\n"));
    let mut unread = Vec::new();
    for (doc, text) in docs() {
        for (i, _) in text.match_indices("KILN_") {
            let name: String = text[i..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let name = name.trim_end_matches('_');
            if name.len() > "KILN_".len() + 1 && !code.contains_key(name) {
                unread.push(format!("{doc}: {name}"));
            }
        }
    }
    unread.sort();
    unread.dedup();
    assert!(unread.is_empty(), "the docs name variables nothing reads:\n{}", unread.join("\n"));
}

#[test]
fn the_command_finder_sees_fenced_continued_and_inline_commands() {
    let text = "Run `cargo xtask report RUN --output x` now.\n```\ncargo xtask bench-longprompt \\\n  --models m --lengths \"1 2\" # note\n```\n";
    let found = shown(text, "cargo xtask ");
    assert_eq!(found[0], (1, "report RUN --output x".to_string()));
    assert_eq!(found[1].0, 3);
    assert!(found[1].1.contains("--lengths") && !found[1].1.contains("note"), "{found:?}");
    let f = flags("  -m, --models <MODELS>  Models [aliases: --model]\n      --until-ci <PCT>\n");
    assert!(
        f.contains("-m") && f.contains("--models") && f.contains("--model") && f.contains("--until-ci"),
        "{f:?}"
    );
}
