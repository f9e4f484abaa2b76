//! What a run's summary says, as data: a one-line answer, tables whose cells are
//! [`Reading`]s, [`Judged`] ratios or text, and notes. A task builds its [`Sheet`] once;
//! the terminal prints [`Sheet::markdown`], the run directory keeps it as
//! [`super::reading::FILE`], and report.html, compare.html and the pull-request comment
//! render the same cells' texts. A cell's text is written when the cell is made, so no
//! page can word or round a number differently from the terminal.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::reading::{FILE, Judged, Reading};
use super::roofline::Roofline;

/// One table cell.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    /// What every page prints.
    pub text: String,
    /// The reading behind a number, when the cell is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reading: Option<Reading>,
    /// The verdict behind a ratio, when the cell is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judged: Option<Judged>,
}

impl Cell {
    /// A cell of plain text.
    pub fn text(text: impl Into<String>) -> Cell {
        Cell { text: text.into(), reading: None, judged: None }
    }

    /// A rate or a time: [`Reading::text`].
    pub fn reading(r: Reading) -> Cell {
        Cell { text: r.text(), reading: Some(r), judged: None }
    }

    /// A ratio: its reading and verdict in one cell (`unit` names one observation, as
    /// [`Judged::text`] takes it).
    pub fn judged(j: Judged, unit: &str, secs_each: Option<f64>) -> Cell {
        Cell {
            text: format!("{} {}", j.reading.ratio_text(), j.text(unit, secs_each)),
            reading: None,
            judged: Some(j),
        }
    }

    /// Whether the cell holds a number (right-aligned on a page).
    pub fn numeric(&self) -> bool {
        self.reading.is_some() || self.judged.is_some()
    }
}

impl From<&str> for Cell {
    fn from(s: &str) -> Cell {
        Cell::text(s)
    }
}

impl From<String> for Cell {
    fn from(s: String) -> Cell {
        Cell::text(s)
    }
}

/// A table of a sheet.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Table {
    /// Its heading.
    pub title: String,
    /// How to read it: what the values are and how their intervals were taken.
    pub legend: String,
    /// Column headings.
    pub columns: Vec<String>,
    /// Rows of cells, one per column.
    pub rows: Vec<Vec<Cell>>,
}

/// A run's summary.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Sheet {
    /// What ran, such as `bench-longprompt`.
    pub task: String,
    /// The answer to the user's question, in one line.
    pub headline: String,
    /// Its tables.
    pub tables: Vec<Table>,
    /// Lines after the tables (why the run stopped, what was skipped, caveats).
    pub notes: Vec<String>,
    /// The run's roofs and the points placed under them, when it measured roofs: the
    /// tables print their texts, report.html draws them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roofline: Option<Roofline>,
}

fn md_cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

impl Sheet {
    /// The terminal's form (and summary.md's): markdown.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        if !self.headline.is_empty() {
            let _ = writeln!(s, "{}\n", self.headline);
        }
        for t in &self.tables {
            if !t.title.is_empty() {
                let _ = writeln!(s, "{}:\n", t.title);
            }
            let _ =
                writeln!(s, "| {} |", t.columns.iter().map(|c| md_cell(c)).collect::<Vec<_>>().join(" | "));
            let rule: Vec<&str> =
                (0..t.columns.len())
                    .map(|i| {
                        if t.rows.iter().any(|r| r.get(i).is_some_and(Cell::numeric)) {
                            "---:"
                        } else {
                            "---"
                        }
                    })
                    .collect();
            let _ = writeln!(s, "|{}|", rule.join("|"));
            for r in &t.rows {
                let _ =
                    writeln!(s, "| {} |", r.iter().map(|c| md_cell(&c.text)).collect::<Vec<_>>().join(" | "));
            }
            if !t.legend.is_empty() {
                let _ = writeln!(s, "\n{}", t.legend);
            }
            s.push('\n');
        }
        for n in &self.notes {
            let _ = writeln!(s, "{n}");
        }
        s
    }

    /// Every cell's text in reading order, for tests that check a page against the
    /// terminal.
    #[cfg(test)]
    pub fn texts(&self) -> Vec<&str> {
        self.tables.iter().flat_map(|t| t.rows.iter().flatten().map(|c| c.text.as_str())).collect()
    }

    /// Writes the sheet into `dir` as [`FILE`], replacing any earlier one atomically.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(FILE);
        let text = serde_json::to_string_pretty(self)? + "\n";
        crate::fsx::write_atomic(&path, text.as_bytes())
            .with_context(|| format!("writing {}", path.display()))
    }

    /// The sheet a run directory holds, if any.
    pub fn read(dir: &Path) -> Result<Option<Sheet>> {
        let path = dir.join(FILE);
        let Some(text) = crate::fsx::read_text_if_any(&path, 64 << 20)? else {
            return Ok(None);
        };
        let sheet = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a readings file", path.display()))?;
        Ok(Some(sheet))
    }
}

#[cfg(test)]
mod tests {
    use super::super::reading::{Better, Method};
    use super::*;

    fn sheet() -> Sheet {
        let r = Reading::of(&[100.0, 120.0, 90.0], Method::T).unwrap();
        let j = Reading::of_pairs(&[(1.0, 2.0), (1.1, 2.0), (0.9, 2.1)], Method::T)
            .unwrap()
            .judge(Better::Higher, 5.0);
        Sheet {
            task: "bench-longprompt".into(),
            headline: "a|b".into(),
            tables: vec![Table {
                title: "per cell".into(),
                legend: "tok/s".into(),
                columns: vec!["cell".into(), "decode tok/s".into(), "B/A".into()],
                rows: vec![vec!["m@512 | x".into(), Cell::reading(r), Cell::judged(j, "pairs", None)]],
            }],
            notes: vec!["stopped".into()],
            roofline: None,
        }
    }

    #[test]
    fn the_markdown_prints_each_cell_s_own_text() {
        let s = sheet();
        let md = s.markdown();
        for t in s.texts() {
            assert!(md.contains(&md_cell(t)), "{t} not in {md}");
        }
        assert!(md.contains("| cell | decode tok/s | B/A |\n|---|---:|---:|"), "{md}");
        assert!(md.contains("regressed by more than 5%"), "{md}");
    }

    #[test]
    fn a_sheet_reads_back_as_written() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Sheet::read(dir.path()).unwrap(), None);
        let s = sheet();
        s.write(dir.path()).unwrap();
        let back = Sheet::read(dir.path()).unwrap().unwrap();
        assert_eq!(back.texts(), s.texts());
        assert_eq!(back.markdown(), s.markdown());
    }
}
