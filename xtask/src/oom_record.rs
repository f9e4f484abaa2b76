//! `cargo xtask oom-record list|prune`: inspect the persistent OOM record, and remove the
//! lines a fix has made stale, under the record's lock, replacing the file atomically.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use xshell::Shell;

use crate::args::count;
use crate::args::user_path;
use crate::child::{self, Shutdown};
use crate::console::{self, usage};
use crate::sweep::record::{Entry, RecordFile, RecordLine, bytes_text};

/// Flags of `cargo xtask oom-record`.
#[derive(clap::Args)]
pub struct OomRecord {
    #[command(subcommand)]
    action: Action,
}

#[derive(clap::Subcommand)]
enum Action {
    /// Print every line with its number; malformed ones are flagged.
    List {
        /// The record [default: benchmarks/.oom-record].
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// Remove the lines matching every filter given.
    Prune(PruneFlags),
}

/// Which lines `prune` removes: those matching all the filters given.
#[derive(clap::Args)]
struct PruneFlags {
    /// The record [default: benchmarks/.oom-record].
    #[arg(long, value_name = "FILE")]
    file: Option<PathBuf>,
    /// Lines of this model (exactly as written).
    #[arg(short = 'm', long, alias = "models", value_name = "MODEL")]
    model: Option<String>,
    /// Lines at this prompt length.
    #[arg(long, value_name = "N", value_parser = count(0))]
    length: Option<u64>,
    /// Lines at this prompt length or longer.
    #[arg(long, value_name = "N", value_parser = count(0))]
    min_length: Option<u64>,
    /// Lines scoped to this device (exactly as written).
    #[arg(long, value_name = "DEVICE")]
    device: Option<String>,
    /// Lines whose commit starts with this.
    #[arg(long, value_name = "SHA")]
    commit: Option<String>,
    /// Lines dated before this day (YYYY-MM-DD).
    #[arg(long, value_name = "DATE", value_parser = date_arg)]
    before: Option<String>,
    /// Every usable line.
    #[arg(long)]
    all: bool,
    /// Also remove malformed lines (on their own, only those).
    #[arg(long)]
    malformed: bool,
    /// Show what would go; change nothing.
    #[arg(long)]
    dry_run: bool,
}

fn date_arg(s: &str) -> Result<String, String> {
    chrono::NaiveDate::parse_from_str(s, "%Y-%m-%d")
        .map(|d| d.format("%Y-%m-%d").to_string())
        .map_err(|_| format!("`{s}` is not a date: expected YYYY-MM-DD"))
}

impl PruneFlags {
    fn has_line_filter(&self) -> bool {
        self.model.is_some()
            || self.length.is_some()
            || self.min_length.is_some()
            || self.device.is_some()
            || self.commit.is_some()
            || self.before.is_some()
    }

    fn selects(&self, r: &RecordLine) -> bool {
        if self.all {
            return true;
        }
        if !self.has_line_filter() {
            return false;
        }
        self.model.as_ref().is_none_or(|m| &r.model == m)
            && self.length.is_none_or(|l| r.prompt_target_len == l)
            && self.min_length.is_none_or(|l| r.prompt_target_len >= l)
            && self.device.as_ref().is_none_or(|d| r.device.as_ref() == Some(d))
            && self.commit.as_ref().is_none_or(|c| r.commit.starts_with(c.as_str()))
            && self.before.as_ref().is_none_or(|b| r.date.get(..10).is_some_and(|day| day < b.as_str()))
    }
}

impl OomRecord {
    pub fn run(self, sh: &Shell) -> Result<ExitCode> {
        let default = sh.current_dir().join("benchmarks/.oom-record");
        // A record named with --file must exist; the default one is absent until a sweep
        // records its first out-of-memory, which is said, not miscounted as "0 lines".
        let resolve = |f: &Option<PathBuf>| -> Result<Option<PathBuf>> {
            match f {
                Some(p) => {
                    let p = user_path(p)?;
                    if !p.exists() {
                        usage!(
                            "--file {}: no such file: expected an OOM record written by a sweep",
                            p.display()
                        );
                    }
                    Ok(Some(p))
                }
                None if default.exists() => Ok(Some(default.clone())),
                None => {
                    eprintln!(
                        "{} does not exist: no sweep has recorded an out-of-memory here",
                        default.display()
                    );
                    Ok(None)
                }
            }
        };
        match self.action {
            Action::List { file } => match resolve(&file)? {
                Some(path) => list(&RecordFile::new(path)),
                None => Ok(ExitCode::SUCCESS),
            },
            Action::Prune(flags) => {
                if !flags.all && !flags.has_line_filter() && !flags.malformed {
                    usage!(
                        "prune needs a filter: --model, --length, --min-length, --device, --commit, --before, --malformed or --all"
                    );
                }
                let Some(path) = resolve(&flags.file)? else { return Ok(ExitCode::SUCCESS) };
                let file = RecordFile::new(path);
                // SIGINT, SIGTERM and SIGHUP wait until the record is replaced (or the
                // temporary file removed): a prune is never left half done.
                let shutdown = Shutdown::install()?;
                let gone = file.prune(|r| flags.selects(r), flags.malformed, flags.dry_run)?;
                if let Some(sig) = shutdown.pending() {
                    eprintln!("interrupted by {} after the prune finished", child::signal_name(sig));
                    return Ok(ExitCode::from(child::exit_code_for(sig)));
                }
                let verb = if flags.dry_run { "would remove" } else { "removed" };
                let mut text = String::new();
                for e in &gone {
                    if let Entry::Line { line, text: t, .. }
                    | Entry::Malformed(crate::sweep::record::Malformed { line, text: t, .. }) = e
                    {
                        text.push_str(&format!("{verb} line {line}: {t}\n"));
                    }
                }
                text.push_str(&format!("{verb} {} line(s) from {}\n", gone.len(), file.path().display()));
                console::out(&text)?;
                Ok(ExitCode::SUCCESS)
            }
        }
    }
}

/// One usable line as `list` prints it: what the cell needed (the bytes in use plus the
/// refused request, which the file calls `peak_bytes`) humanised beside the exact count.
fn line_text(line: u64, r: &RecordLine) -> String {
    let needed = r.demand_bytes.map_or_else(
        || "needed ? (the engine did not say)".to_string(),
        |b| format!("needed {}: in use plus the refused request", bytes_text(b)),
    );
    format!(
        "{line:>4}  {}  {}  {}  {}  {needed}  device {}  from {}\n",
        r.model,
        r.prompt_target_len,
        r.date,
        r.commit,
        r.device.as_deref().unwrap_or("(any)"),
        r.source_csv
    )
}

fn list(file: &RecordFile) -> Result<ExitCode> {
    let entries = file.read()?;
    let mut text = String::new();
    let (mut usable, mut malformed) = (0, 0);
    for e in &entries {
        match e {
            Entry::Line { line, record: r, .. } => {
                usable += 1;
                text.push_str(&line_text(*line, r));
            }
            Entry::Malformed(m) => {
                malformed += 1;
                text.push_str(&format!("{:>4}  MALFORMED ({}): {}\n", m.line, m.why, m.text));
            }
            Entry::Other { .. } => {}
        }
    }
    text.push_str(&format!("{usable} line(s), {malformed} malformed, in {}\n", file.path().display()));
    console::out(&text)?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags() -> PruneFlags {
        PruneFlags {
            file: None,
            model: None,
            length: None,
            min_length: None,
            device: None,
            commit: None,
            before: None,
            all: false,
            malformed: false,
            dry_run: false,
        }
    }

    fn line(model: &str, len: u64, date: &str, commit: &str, device: Option<&str>) -> RecordLine {
        RecordLine {
            model: model.into(),
            prompt_target_len: len,
            date: date.into(),
            commit: commit.into(),
            demand_bytes: None,
            source_csv: "s".into(),
            device: device.map(str::to_string),
        }
    }

    #[test]
    fn filters_combine_and_nothing_is_selected_without_one() {
        let a = line("m", 8192, "2026-03-01T00:00:00Z", "abc1234", Some("dev"));
        let b = line("m", 512, "2026-05-01T00:00:00Z", "def5678-dirty", None);
        assert!(!flags().selects(&a));
        assert!(PruneFlags { all: true, ..flags() }.selects(&b));
        let f = PruneFlags { model: Some("m".into()), min_length: Some(2048), ..flags() };
        assert!(f.selects(&a) && !f.selects(&b));
        let f = PruneFlags { before: Some("2026-04-01".into()), ..flags() };
        assert!(f.selects(&a) && !f.selects(&b));
        let f = PruneFlags { commit: Some("def".into()), ..flags() };
        assert!(!f.selects(&a) && f.selects(&b));
        let f = PruneFlags { device: Some("dev".into()), ..flags() };
        assert!(f.selects(&a) && !f.selects(&b));
        let f = PruneFlags { length: Some(512), model: Some("other".into()), ..flags() };
        assert!(!f.selects(&b));
    }

    #[test]
    fn a_listed_line_names_what_the_cell_needed_and_humanises_it() {
        let mut r = line("m", 512, "2026-01-01", "abc", None);
        r.demand_bytes = Some(1_288_490_189);
        let t = line_text(3, &r);
        assert!(t.contains("needed 1.2 GiB (1288490189 bytes): in use plus the refused request"), "{t}");
        assert!(!t.contains("peak"), "{t}");
        r.demand_bytes = None;
        assert!(line_text(3, &r).contains("needed ? (the engine did not say)"));
    }

    #[test]
    fn dates_are_validated() {
        assert_eq!(date_arg("2026-01-05").unwrap(), "2026-01-05");
        assert!(date_arg("2026-13-01").unwrap_err().contains("`2026-13-01`"));
        assert!(date_arg("yesterday").is_err());
    }
}
