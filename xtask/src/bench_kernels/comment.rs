//! `cargo xtask bench-kernels --pr-comment`: the pull request's comment on the last
//! `--compare`, printed from the sheet that run wrote (`readings.json`) and its report.
//! The comment says what the terminal said: the sheet's headline, the rows of the kernels
//! that regressed or improved (their cells as written), and the whole report folded
//! below. It judges nothing itself.

use crate::verdict::reading::Verdict;
use crate::verdict::sheet::{Sheet, Table};

use super::sheet::KERNEL_TABLE;

/// The comment's first line, by which the workflow finds its own earlier comment to update
/// instead of adding another.
pub(super) const MARKER: &str = "<!-- kiln-kernel-report -->";
/// GitHub refuses comment bodies over 65536 characters.
pub(super) const LIMIT: usize = 65000;

/// The kernel table's rows whose verdict is a change, as a table of their own.
fn changed(sheet: &Sheet) -> Option<Table> {
    let table = sheet.tables.iter().find(|t| t.title == KERNEL_TABLE)?;
    let rows: Vec<_> = table
        .rows
        .iter()
        .filter(|r| {
            r.iter().any(|c| {
                c.judged.as_ref().is_some_and(|j| matches!(j.verdict, Verdict::Regressed | Verdict::Improved))
            })
        })
        .cloned()
        .collect();
    (!rows.is_empty()).then(|| Table {
        title: "Regressed and improved kernels".into(),
        legend: String::new(),
        columns: table.columns.clone(),
        rows,
    })
}

/// The comment's body: from the comparison's `sheet` and `report` (the report file's
/// text) when the run left them, with a link to the CI run when given.
pub(super) fn body(sheet: Option<&Sheet>, report: Option<&str>, run_url: Option<&str>) -> String {
    let mut lines =
        vec![MARKER.to_string(), "### Kernel benchmarks on this pull request".into(), String::new()];
    match sheet {
        None => lines.push(
            "The comparison left no readings (`readings.json`): the benchmarks did not run to the \
             end (see the job log)."
                .into(),
        ),
        Some(sheet) => {
            lines.push(format!("{} (Interleaved A/B rounds on one machine.)", sheet.headline));
            if let Some(t) = changed(sheet) {
                let only = Sheet { tables: vec![t], ..Sheet::default() };
                lines.push(String::new());
                lines.push(only.markdown().trim_end().to_string());
            }
        }
    }
    if let Some(url) = run_url {
        lines.push(String::new());
        lines.push(format!("Measured by [this run]({url})."));
    }
    let head = lines.join("\n") + "\n\n<details><summary>Full report</summary>\n\n";
    let tail = "\n</details>\n";
    let room = LIMIT.saturating_sub(head.len() + tail.len());
    let mut full = report.map_or("(no report file)".to_string(), |r| r.trim().to_string()) + "\n";
    if full.len() > room {
        let note =
            "\n\n(report cut here: it is longer than a comment may be; the job summary has all of it)\n";
        let mut cut = room.saturating_sub(note.len());
        while !full.is_char_boundary(cut) {
            cut -= 1;
        }
        full.truncate(full[..cut].rfind('\n').unwrap_or(0));
        full.push_str(note);
    }
    head + &full + tail
}

#[cfg(test)]
mod tests {
    use super::super::sheet::{section, sheet, tests::judging, tests::recorded};
    use super::*;

    #[test]
    fn the_comment_prints_the_terminal_s_headline_and_changed_rows_as_written() {
        let s = sheet("main", "0123456789abcdef", 2, &judging(), &recorded(), &[]);
        let terminal = section("main", "0123456789abcdef", &s);
        let b = body(Some(&s), Some(&terminal), Some("https://example.invalid/run/1"));
        assert!(b.starts_with(&format!("{MARKER}\n")), "{b}");
        let top = b.split("<details>").next().unwrap();
        assert!(top.contains(&s.headline), "{top}");
        assert!(top.contains("Measured by [this run](https://example.invalid/run/1)."), "{top}");
        // The regressed kernel's row, cell by cell as the terminal printed it; no row that
        // is the same or undecided, and no read bandwidth.
        let row = terminal.lines().find(|l| l.contains("qmv/q4_g64_n4096_k4096_m1/t1")).unwrap();
        assert!(top.contains(row), "{row}\n{top}");
        assert!(!top.contains("qmv_wide") && !top.contains("| `read_bandwidth"), "{top}");
        assert!(b.ends_with("</details>\n") && b.contains(terminal.trim()), "{b}");
    }

    #[test]
    fn a_run_without_readings_and_a_report_too_long_for_a_comment() {
        assert!(body(None, None, None).contains("did not run to the end"));
        let s = sheet("main", "0123456789abcdef", 2, &judging(), &recorded(), &[]);
        let long = "| a row of a long report, with a µ |\n".repeat(4000);
        let b = body(Some(&s), Some(&long), None);
        assert!(
            b.len() <= LIMIT && b.contains("(report cut here") && b.ends_with("</details>\n"),
            "{}",
            b.len()
        );
    }
}
