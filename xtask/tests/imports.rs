//! No import circle inside a crate (libraries and the `kiln` and `xtask` binaries): the
//! paths each module names (`use crate::...`,
//! `super::...`, `self::...`, a child's name, and the same prefixes inside the code) are
//! resolved to the files that define them, and the file graph of each crate must be a DAG.
//! A circle means two files cannot be read, tested or moved apart; the failure names it.
//! Like `tidy.rs` it reads the sources as text and runs nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The workspace root: xtask lives one level below it.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Every crate root of the workspace: `crates/*` and `benches` with a `src/lib.rs`, and
/// the binaries (`crates/*/src/main.rs`, `xtask/src/main.rs`), whose files import each
/// other as a library's do.
fn library_roots(root: &Path) -> Vec<PathBuf> {
    let mut libs: Vec<PathBuf> = fs::read_dir(root.join("crates"))
        .expect("reading crates/")
        .flatten()
        .flat_map(|e| [e.path().join("src/lib.rs"), e.path().join("src/main.rs")])
        .chain([root.join("benches/src/lib.rs"), root.join("xtask/src/main.rs")])
        .filter(|l| l.is_file())
        .collect();
    libs.sort();
    libs
}

/// One token of Rust source with comments and literals already blanked out.
#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// Source text with comments, strings and character literals replaced by spaces, so that
/// what remains is code (a `"crate::x"` in a message is no import); newlines are kept.
fn blank_literals(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let blank = |out: &mut String, s: &[char]| {
        for &ch in s {
            out.push(if ch == '\n' { '\n' } else { ' ' });
        }
    };
    let mut i = 0;
    while i < c.len() {
        let prev_ident = i > 0 && ident(c[i - 1]);
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            let end = c[i..].iter().position(|&ch| ch == '\n').map_or(c.len(), |p| i + p);
            blank(&mut out, &c[i..end]);
            i = end;
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            let (mut depth, mut j) = (1, i + 2);
            while j < c.len() && depth > 0 {
                if c[j] == '/' && c.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &c[i..j]);
            i = j;
        } else if !prev_ident && (c[i] == 'r' || (c[i] == 'b' && c.get(i + 1) == Some(&'r'))) && {
            let mut j = i + if c[i] == 'b' { 2 } else { 1 };
            while c.get(j) == Some(&'#') {
                j += 1;
            }
            c.get(j) == Some(&'"')
        } {
            // A raw string: r"..", r#".."#, br#".."#.
            let start = i + if c[i] == 'b' { 2 } else { 1 };
            let hashes = c[start..].iter().take_while(|&&ch| ch == '#').count();
            let mut j = start + hashes + 1;
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && c[j + 1..].iter().take(hashes).filter(|&&ch| ch == '#').count() == hashes {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            let j = j.min(c.len());
            blank(&mut out, &c[i..j]);
            i = j;
        } else if c[i] == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            let j = (j + 1).min(c.len());
            blank(&mut out, &c[i..j]);
            i = j;
        } else if c[i] == '\'' && (c.get(i + 1) == Some(&'\\') || c.get(i + 2) == Some(&'\'')) {
            // A character literal; a lifetime (`'a`) has no closing quote after one char.
            let mut j = i + 1;
            while j < c.len() && c[j] != '\'' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            let j = (j + 1).min(c.len());
            blank(&mut out, &c[i..j]);
            i = j;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// The tokens of blanked source, each with its 1-based line.
fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = code.chars().collect();
    let (mut out, mut line, mut i) = (Vec::new(), 1, 0);
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            // `r#type` is the identifier `type`.
            if word == "r" && c.get(i) == Some(&'#') && c.get(i + 1).is_some_and(|n| n.is_alphabetic()) {
                continue;
            }
            out.push((Tok::Ident(word), line));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// How many tokens from `toks[i]` make a `#[cfg(..)]` attribute that holds only under
/// test (`cfg(test)`, `cfg(all(test, ..))`), or `None` for anything else.
fn test_cfg_len(toks: &[(Tok, usize)], i: usize) -> Option<usize> {
    let ident = |k: usize, w: &str| matches!(toks.get(k), Some((Tok::Ident(t), _)) if t == w);
    let punct = |k: usize, c: char| matches!(toks.get(k), Some((Tok::Punct(t), _)) if *t == c);
    if !(punct(i, '#') && punct(i + 1, '[') && ident(i + 2, "cfg")) {
        return None;
    }
    let mut j = i + 3;
    let (mut test, mut negated) = (false, false);
    while j < toks.len() && !punct(j, ']') {
        test |= ident(j, "test");
        negated |= ident(j, "not") || ident(j, "any");
        j += 1;
    }
    (test && !negated).then_some(j + 1 - i)
}

/// The tokens with every test-only item (`#[cfg(test)]` and the like) removed: tests may
/// import what they like.
fn without_tests(toks: Vec<(Tok, usize)>) -> Vec<(Tok, usize)> {
    let mut out = Vec::with_capacity(toks.len());
    let mut i = 0;
    while i < toks.len() {
        if let Some(len) = test_cfg_len(&toks, i) {
            // Skip the attribute, then the item: up to its `;` or its closing brace.
            let mut j = i + len;
            let mut depth = 0usize;
            while j < toks.len() {
                match &toks[j].0 {
                    Tok::Punct('{') => depth += 1,
                    // The enclosing block ends first: the item was a statement.
                    Tok::Punct('}') if depth == 0 => {
                        j -= 1;
                        break;
                    }
                    Tok::Punct('}') => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    Tok::Punct(';') if depth == 0 => break,
                    _ => {}
                }
                j += 1;
            }
            i = j + 1;
        } else {
            out.push(toks[i].clone());
            i += 1;
        }
    }
    out
}

/// A path a module names, as written, with the line it is on.
#[derive(Clone, Debug)]
struct Named {
    segments: Vec<String>,
    line: usize,
}

/// A `pub use` of the module: `name` reachable from outside as `path`.
#[derive(Clone, Debug)]
struct Reexport {
    name: String,
    path: Vec<String>,
}

/// What one file says about modules: its `mod x;` children, the paths it names and what it
/// re-exports.
#[derive(Debug, Default)]
struct Parsed {
    children: Vec<String>,
    named: Vec<Named>,
    reexports: Vec<Reexport>,
}

/// Expands a use tree starting at `toks[*i]` into full paths below `prefix`; stops after
/// the tree, at `,`, `}` or `;`. Each path carries its `as` name, if any.
fn use_tree(
    toks: &[(Tok, usize)],
    i: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>, usize)>,
) {
    let mut path = prefix;
    let line = toks.get(*i).map_or(0, |t| t.1);
    while let Some((tok, _)) = toks.get(*i) {
        match tok {
            Tok::Ident(w) if w == "as" => {
                *i += 1;
                let alias = match toks.get(*i) {
                    Some((Tok::Ident(a), _)) => Some(a.clone()),
                    _ => None,
                };
                *i += 1;
                out.push((path, alias, line));
                return;
            }
            Tok::Ident(w) => {
                path.push(w.clone());
                *i += 1;
            }
            Tok::Path => *i += 1,
            Tok::Punct('*') => {
                *i += 1;
                path.push("*".into());
            }
            Tok::Punct('{') => {
                *i += 1;
                loop {
                    use_tree(toks, i, path.clone(), out);
                    match toks.get(*i) {
                        Some((Tok::Punct(','), _)) => *i += 1,
                        Some((Tok::Punct('}'), _)) => {
                            *i += 1;
                            break;
                        }
                        _ => break,
                    }
                    if matches!(toks.get(*i), Some((Tok::Punct('}'), _))) {
                        *i += 1;
                        break;
                    }
                }
                return;
            }
            _ => break,
        }
    }
    if !path.is_empty() {
        out.push((path, None, line));
    }
}

/// Reads the module structure and the named paths out of one file's source.
fn parse(src: &str) -> Parsed {
    let toks = without_tests(tokens(&blank_literals(src)));
    let word = |k: usize| match toks.get(k) {
        Some((Tok::Ident(w), _)) => Some(w.as_str()),
        _ => None,
    };
    let mut parsed = Parsed::default();
    for k in 0..toks.len() {
        if word(k) == Some("mod")
            && matches!(toks.get(k + 2), Some((Tok::Punct(';'), _)))
            && let Some(name) = word(k + 1)
        {
            parsed.children.push(name.to_string());
        }
    }
    let after_path = |k: usize| k > 0 && matches!(toks.get(k - 1), Some((Tok::Path, _)));
    let mut i = 0;
    while i < toks.len() {
        match word(i) {
            Some("use") => {
                // `pub use`, `pub(crate) use`: a re-export others can name through us.
                let public = i > 0
                    && (word(i - 1) == Some("pub") || matches!(toks.get(i - 1), Some((Tok::Punct(')'), _))));
                let mut j = i + 1;
                let mut trees = Vec::new();
                use_tree(&toks, &mut j, Vec::new(), &mut trees);
                for (mut path, alias, line) in trees {
                    if path.last().is_some_and(|s| s == "self") {
                        path.pop();
                    }
                    if public && let Some(name) = alias.clone().or_else(|| path.last().cloned()) {
                        parsed.reexports.push(Reexport { name, path: path.clone() });
                    }
                    parsed.named.push(Named { segments: path, line });
                }
                i = j.max(i + 1);
            }
            // `pub(in crate::a::b)`: a visibility, which names where an item may be seen,
            // not something this file uses.
            Some("in")
                if i >= 2
                    && word(i - 2) == Some("pub")
                    && matches!(toks.get(i - 1), Some((Tok::Punct('('), _))) =>
            {
                i += 1;
                while i < toks.len() && !matches!(toks.get(i), Some((Tok::Punct(')'), _))) {
                    i += 1;
                }
            }
            // An inline path from the crate, a parent, this module or a child of it.
            Some(start)
                if (matches!(start, "crate" | "super" | "self")
                    || parsed.children.iter().any(|c| c == start))
                    && matches!(toks.get(i + 1), Some((Tok::Path, _)))
                    && !after_path(i) =>
            {
                let line = toks[i].1;
                let mut segments = vec![start.to_string()];
                let mut j = i + 1;
                while matches!(toks.get(j), Some((Tok::Path, _))) {
                    match word(j + 1) {
                        Some(w) => segments.push(w.to_string()),
                        None => break,
                    }
                    j += 2;
                }
                parsed.named.push(Named { segments, line });
                i = j;
            }
            _ => i += 1,
        }
    }
    parsed
}

/// One module file of a crate.
#[derive(Debug)]
struct Module {
    /// Relative to the workspace root, for messages.
    file: String,
    parent: Option<usize>,
    children: BTreeMap<String, usize>,
    parsed: Parsed,
}

/// A library crate's module files, from `lib.rs` down its `mod x;` lines.
struct Crate {
    modules: Vec<Module>,
}

impl Crate {
    fn load(lib: &Path, root: &Path) -> Crate {
        let mut krate = Crate { modules: Vec::new() };
        krate.add(lib, None, root);
        krate
    }

    fn add(&mut self, file: &Path, parent: Option<usize>, root: &Path) -> usize {
        let src = fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        let parsed = parse(&src);
        let id = self.modules.len();
        let children = parsed.children.clone();
        self.modules.push(Module {
            file: file.strip_prefix(root).unwrap_or(file).display().to_string(),
            parent,
            children: BTreeMap::new(),
            parsed,
        });
        // `lib.rs` and `mod.rs` keep their children beside them; `x.rs` keeps them in `x/`.
        let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let dir = if parent.is_none() || stem == "mod" {
            file.parent().expect("a file has a folder").to_path_buf()
        } else {
            file.with_extension("")
        };
        for name in children {
            let flat = dir.join(format!("{name}.rs"));
            let nested = dir.join(&name).join("mod.rs");
            let child_file = if flat.is_file() { flat } else { nested };
            if !child_file.is_file() {
                continue; // A `mod` behind a cfg that points at a generated file.
            }
            let child = self.add(&child_file, Some(id), root);
            self.modules[id].children.insert(name, child);
        }
        id
    }

    /// The module file that defines what `segments` names when written in `from`, or
    /// `None` for another crate's path. Re-exports are followed to where the item lives.
    fn resolve(&self, from: usize, segments: &[String], depth: usize) -> Option<usize> {
        if depth > 16 || segments.is_empty() {
            return None;
        }
        let (mut at, mut rest) = match segments[0].as_str() {
            "crate" => (0, &segments[1..]),
            "self" => (from, &segments[1..]),
            "super" => {
                let mut at = from;
                let mut k = 0;
                while segments.get(k).is_some_and(|s| s == "super") {
                    at = self.modules[at].parent?;
                    k += 1;
                }
                (at, &segments[k..])
            }
            first if self.modules[from].children.contains_key(first) => (from, segments),
            _ => return None,
        };
        while let Some(seg) = rest.first() {
            if let Some(&child) = self.modules[at].children.get(seg.as_str()) {
                at = child;
                rest = &rest[1..];
            } else if let Some(re) = self.modules[at].parsed.reexports.iter().find(|r| &r.name == seg) {
                let mut path = re.path.clone();
                path.extend(rest[1..].iter().cloned());
                // `None` when it re-exports another crate's item.
                return self.resolve(at, &path, depth + 1);
            } else {
                break;
            }
        }
        Some(at)
    }

    /// For each module, the modules it names, each with the first line that names it.
    fn edges(&self) -> Vec<BTreeMap<usize, usize>> {
        (0..self.modules.len())
            .map(|from| {
                let mut to = BTreeMap::new();
                for n in &self.modules[from].parsed.named {
                    if let Some(target) = self.resolve(from, &n.segments, 0)
                        && target != from
                    {
                        to.entry(target).or_insert(n.line);
                    }
                }
                to
            })
            .collect()
    }
}

/// The strongly connected components of more than one module (Tarjan), each sorted.
fn circles(edges: &[BTreeMap<usize, usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a [BTreeMap<usize, usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in s.edges[v].keys() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().expect("v is on the stack");
                s.on_stack[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let n = edges.len();
    let mut s = State {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out.sort();
    s.out
}

/// One shortest circle through the component's first module, written as
/// `a.rs:LINE -> b.rs:LINE -> ... -> a.rs` (each line is where the next file is named).
fn one_circle(krate: &Crate, edges: &[BTreeMap<usize, usize>], comp: &[usize]) -> String {
    let inside: BTreeSet<usize> = comp.iter().copied().collect();
    let start = comp[0];
    // Breadth-first from start's successors back to start, inside the component.
    let mut came_from: BTreeMap<usize, usize> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    'search: while let Some(v) = queue.pop_front() {
        for &w in edges[v].keys() {
            if !inside.contains(&w) || came_from.contains_key(&w) {
                continue;
            }
            came_from.insert(w, v);
            if w == start {
                break 'search;
            }
            queue.push_back(w);
        }
    }
    let mut path = vec![start];
    let mut at = came_from[&start];
    while at != start {
        path.push(at);
        at = came_from[&at];
    }
    path.push(start);
    path.reverse();
    let mut text = String::new();
    for pair in path.windows(2) {
        text.push_str(&format!("{}:{} -> ", krate.modules[pair[0]].file, edges[pair[0]][&pair[1]]));
    }
    text.push_str(&krate.modules[start].file);
    text
}

/// One import circle: its files, relative to the workspace root, and a message naming it.
struct Circle {
    files: Vec<String>,
    message: String,
}

/// Every import circle in the library crate at `lib`.
fn circles_in(lib: &Path, root: &Path) -> Vec<Circle> {
    let krate = Crate::load(lib, root);
    let edges = krate.edges();
    circles(&edges)
        .iter()
        .map(|comp| {
            let files: Vec<String> = comp.iter().map(|&m| krate.modules[m].file.clone()).collect();
            let message = format!(
                "{} files import each other: {}\n  e.g. {}",
                comp.len(),
                files.join(", "),
                one_circle(&krate, &edges, comp)
            );
            Circle { files, message }
        })
        .collect()
}

/// The messages of [`circles_in`].
fn problems(lib: &Path, root: &Path) -> Vec<String> {
    circles_in(lib, root).into_iter().map(|c| c.message).collect()
}

/// Circles excused while a crate's modules are regrouped, each as the files (or folders,
/// ending in `/`) it may span. A circle is excused only when every file of it lies in one
/// entry, so one that grows fails; an entry that excuses nothing fails too, so the list
/// only shrinks. It is empty: no crate of the workspace, binaries included, has a circle.
const KNOWN_CIRCLES: &[&[&str]] = &[];

/// Whether `entry` covers every file of a circle.
fn excuses(entry: &[&str], files: &[String]) -> bool {
    files.iter().all(|f| entry.iter().any(|e| if e.ends_with('/') { f.starts_with(e) } else { f == e }))
}

#[test]
fn no_library_crate_has_an_import_circle() {
    let root = workspace_root();
    let libs = library_roots(&root);
    assert!(libs.len() >= 4, "found only {} library crates under {}", libs.len(), root.display());
    let mut found = Vec::new();
    let mut files = 0;
    for lib in &libs {
        files += Crate::load(lib, &root).modules.len();
        found.extend(circles_in(lib, &root));
    }
    assert!(files > 50, "read only {files} module files: the `mod` walk lost its way");
    let new: Vec<String> = found
        .iter()
        .filter(|c| !KNOWN_CIRCLES.iter().any(|e| excuses(e, &c.files)))
        .map(|c| c.message.clone())
        .collect();
    assert!(
        new.is_empty(),
        "import circles (a file naming a module that names it back):\n{}",
        new.join("\n")
    );
    let stale: Vec<&&[&str]> =
        KNOWN_CIRCLES.iter().filter(|e| !found.iter().any(|c| excuses(e, &c.files))).collect();
    assert!(
        stale.is_empty(),
        "these KNOWN_CIRCLES entries excuse no circle any more, remove them: {stale:?}"
    );
}

/// Writes a small crate into a temporary folder and returns its `lib.rs`.
fn scratch_crate(dir: &Path, files: &[(&str, &str)]) -> PathBuf {
    for (name, text) in files {
        let path = dir.join("src").join(name);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, text).unwrap();
    }
    dir.join("src/lib.rs")
}

#[test]
fn the_check_names_a_circle_through_uses_inline_paths_and_reexports() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = scratch_crate(
        tmp.path(),
        &[
            ("lib.rs", "//! x\nmod a;\nmod b;\nmod c;\npub use c::inner::Thing;\n"),
            ("a.rs", "//! a\nuse crate::b::{self, Bee};\n"),
            // An inline path, not a `use` line.
            ("b.rs", "//! b\npub struct Bee;\nfn f() { let _ = crate::Thing::new(); }\n"),
            ("c.rs", "//! c\npub mod inner;\n"),
            // Back to `a` through a parent's `super::super`.
            ("c/inner.rs", "//! inner\npub struct Thing;\nfn g() { super::super::a::f(); }\n"),
        ],
    );
    let found = problems(&lib, tmp.path());
    assert_eq!(found.len(), 1, "{found:#?}");
    for file in ["src/a.rs", "src/b.rs", "src/c/inner.rs"] {
        assert!(found[0].contains(file), "{file} missing from {found:#?}");
    }
    assert!(found[0].starts_with("3 files"), "{found:#?}");
}

#[test]
fn a_visibility_path_is_no_import() {
    let p = parse("pub(in crate::kernels) fn f() {}\npub(super) fn g() { crate::a::h() }\n");
    let named: Vec<Vec<String>> = p.named.iter().map(|n| n.segments.clone()).collect();
    assert_eq!(named, vec![vec!["crate".to_string(), "a".into(), "h".into()]]);
}

#[test]
fn tests_comments_strings_and_other_crates_are_no_imports() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = scratch_crate(
        tmp.path(),
        &[
            ("lib.rs", "//! x\npub mod a;\npub mod b;\n"),
            ("a.rs", "//! a\nuse crate::b::Bee;\npub fn f() {}\n"),
            (
                "b.rs",
                concat!(
                    "//! b, which talks of crate::a::f\n",
                    "pub struct Bee;\n",
                    "const S: &str = \"crate::a::f\";\n",
                    "const R: &str = r#\"super::a\"#;\n",
                    "const C: char = '{';\n",
                    "use std::fmt;\nuse other::a::f;\n",
                    "fn lt<'a>(x: &'a str) -> &'a str { x }\n",
                    "/* crate::a::f */\n",
                    "#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::a::f;\n    fn t() { '}'; }\n}\n",
                    "#[cfg(all(test, target_os = \"linux\"))]\nmod linux_tests {\n    use crate::a::f;\n}\n",
                ),
            ),
        ],
    );
    assert_eq!(problems(&lib, tmp.path()), Vec::<String>::new());
    // And the same `use` outside the test module is one.
    fs::write(tmp.path().join("src/b.rs"), "//! b\npub struct Bee;\nuse crate::a::f;\n").unwrap();
    assert_eq!(problems(&lib, tmp.path()).len(), 1);
}
