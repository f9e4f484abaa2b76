//! Bisect's summary as a [`Sheet`]: one row per tested revision (its ratio to good with
//! interval and n, the call, and why), a one-line answer, and notes. The terminal prints
//! [`Sheet::markdown`], and the run directory keeps the same text as `summary.md` and the
//! sheet itself as `readings.json`, so every page shows what the terminal showed.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

use super::classify::Call;
use crate::verdict::reading::Method;
use crate::verdict::sheet::{Cell, Sheet, Table};

/// The summary as it grows, step by step.
pub struct Summary {
    sheet: Sheet,
}

impl Summary {
    /// An empty summary of a bisection of `metric` at `margin_pct`.
    pub fn new(metric: &str, margin_pct: f64) -> Summary {
        let legend = format!(
            "`{metric}` of each revision over the good revision's: the geometric mean of its ABBA pairs' ratios, \
             with the {}. Step 0 is the bad revision: like bad when its interval lies beyond ±{margin_pct}% of good \
             (else there is nothing to bisect). Every later revision is like bad when its whole interval lies on bad's \
             side of the line between good and bad, like good when it lies wholly on good's side, and undecided only \
             while it straddles the line. The line is the midpoint of good and bad on the log scale, or the \
             ±{margin_pct}% margin where that is farther from good.",
            Method::Sequence.describe()
        );
        let columns = ["step", "commit", "subject", &format!("{metric} / good"), "verdict", "why"];
        Summary {
            sheet: Sheet {
                task: "bisect".into(),
                headline: String::new(),
                tables: vec![Table {
                    title: "revisions tested".into(),
                    legend,
                    columns: columns.iter().map(|c| c.to_string()).collect(),
                    rows: Vec::new(),
                }],
                notes: Vec::new(),
                roofline: None,
            },
        }
    }

    /// Adds step `step`'s row: revision `sha` (`subject`) and its call; `secs_each`
    /// turns the pairs an undecided call needs into time.
    pub fn row(&mut self, step: usize, sha: &str, subject: &str, call: &Call, secs_each: Option<f64>) {
        let ratio =
            Cell { text: call.reading.ratio_text(), reading: Some(call.reading.clone()), judged: None };
        self.sheet.tables[0].rows.push(vec![
            Cell::text(step.to_string()),
            Cell::text(&sha[..12]),
            Cell::text(subject),
            ratio,
            Cell::text(call.side.word()),
            Cell::text(call.why(secs_each)),
        ]);
    }

    /// Adds a line after the table.
    pub fn note(&mut self, line: impl Into<String>) {
        self.sheet.notes.push(line.into());
    }

    /// Ends the summary with `headline`: prints it, writes `summary.md` (the same text)
    /// and `readings.json` (the sheet, which report.html renders) into `run_dir`, and gives
    /// `code` back.
    pub fn finish(mut self, headline: String, run_dir: &Path, code: ExitCode) -> Result<ExitCode> {
        self.sheet.headline = headline;
        let text = self.sheet.markdown();
        crate::fsx::write_atomic(&run_dir.join("summary.md"), text.as_bytes())
            .context("writing summary.md")?;
        self.sheet.write(run_dir)?;
        crate::console::out(&text)?;
        eprintln!("results: {}", run_dir.display());
        Ok(code)
    }
}
