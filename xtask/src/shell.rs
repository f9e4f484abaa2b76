//! Text the harness writes for a POSIX shell to read: quoted words, command lines a user
//! can paste back, and the checks on what may go into a generated script at all (a
//! variable name, a value on a `#`-comment line), so no input adds a line or a command.

/// Quotes `s` as one word for a POSIX shell: as it is when it holds only characters no
/// shell treats specially, else in single quotes (each `'` written as `'\''`), which
/// carry every other byte, newlines included, literally.
pub fn quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./:=@%+,".contains(&b)) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `args` as one command line, each word quoted by [`quote`]: pasted into a shell, it
/// runs the same words.
pub fn command_line<S: AsRef<str>>(args: &[S]) -> String {
    args.iter().map(|a| quote(a.as_ref())).collect::<Vec<_>>().join(" ")
}

/// The command a user typed to run this `cargo xtask` task, from the process's
/// arguments: `cargo xtask` and the task's own words, quoted.
pub fn typed_command<S: AsRef<str>>(args: &[S]) -> String {
    let words: Vec<&str> = args.iter().skip(1).map(AsRef::as_ref).collect();
    if words.is_empty() { "cargo xtask".into() } else { format!("cargo xtask {}", command_line(&words)) }
}

/// Whether `name` can be a shell variable name (`export NAME=...`): a letter or `_`,
/// then letters, digits and `_`.
pub fn is_name(name: &str) -> bool {
    let mut b = name.bytes();
    b.next().is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// The first control character in `s` (a newline would end a `#SBATCH` or comment line
/// and start a command), if any.
pub fn control_char(s: &str) -> Option<char> {
    s.chars().find(|c| c.is_control())
}

/// `s` fit for a `#` comment line: every control character shown as `?`.
pub fn comment_text(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { '?' } else { c }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What bash parses `line` into: the words, NUL-separated by printf.
    fn bash_words(line: &str) -> Vec<String> {
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!("set -- {line}; printf '%s\\0' \"$@\""))
            .output()
            .expect("running bash");
        assert!(out.status.success(), "bash refused {line:?}: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        text.split_terminator('\0').map(str::to_string).collect()
    }

    #[test]
    fn quoting() {
        assert_eq!(quote("synthetic:tiny:16,m:5"), "synthetic:tiny:16,m:5");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("$HOME"), "'$HOME'");
    }

    #[test]
    fn a_quoted_command_line_round_trips_through_bash() {
        let args = [
            "--order",
            "1 0 0 1",
            "--serve-arg=--prefill-chunk=512",
            "it's",
            "$(touch /tmp/kiln-never)",
            "a\nb",
            "`x`",
            "",
            "*",
            "tab\there",
            "semi;colon|pipe&amp>",
            "ünïcode",
        ];
        assert_eq!(bash_words(&command_line(&args)), args);
        assert_eq!(
            typed_command(&["/x/target/debug/xtask", "qmv-pin-tax", "--order", "1 0"]),
            "cargo xtask qmv-pin-tax --order '1 0'"
        );
    }

    #[test]
    fn names_and_control_characters() {
        assert!(is_name("KILN_QMV_WIDE") && is_name("_x1"));
        for bad in ["", "1X", "KILN_X;touch y", "KILN_X Y", "KILN_$(id)", "KILN-X", "KILN_X\n"] {
            assert!(!is_name(bad), "{bad:?}");
        }
        assert_eq!(control_char("gpu\ntouch x"), Some('\n'));
        assert_eq!(control_char("gpu:1"), None);
        assert_eq!(comment_text("a\nb\rc"), "a?b?c");
    }
}
