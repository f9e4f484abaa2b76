//! The decode sweeps' plot: rates against prompt length, one series per model and engine,
//! each cell's point its summary's reading. Drawn beside the CSV by bench-longprompt and
//! `cargo xtask merge`, and by `cargo xtask report` from the run's rows.

use crate::plot;
use crate::sweep::rows;

/// Decode and prefill tok/s against prompt length, one series per model (and engine,
/// with `--peer`): the geometric mean of a cell's repetitions with its 95% interval (the
/// summary's reading of the cell), each
/// repetition a point beside it; a cell without a measurement is marked on the axis and
/// listed with its status. Models more than 10x apart get a panel each.
pub fn panels(rows: &[rows::Row]) -> Vec<plot::Panel> {
    panels_by(rows, crate::verdict::reading::Method::T)
}

/// [`panels`] with the intervals taken as the run's summary took them (`--until-ci`: the
/// confidence sequence).
pub fn panels_by(rows: &[rows::Row], method: crate::verdict::reading::Method) -> Vec<plot::Panel> {
    let name =
        |r: &rows::Row| if r.is_peer() { format!("{} ({})", r.model, r.engine) } else { r.model.clone() };
    let mut names: Vec<String> = Vec::new();
    for r in rows {
        if !names.contains(&name(r)) {
            names.push(name(r));
        }
    }
    let panel = |metric: &str, rate: fn(&rows::Row) -> Option<f64>| {
        let mut marks = Vec::new();
        let series = names
            .iter()
            .map(|n| {
                let mut lens: Vec<u64> =
                    rows.iter().filter(|r| &name(r) == n).filter_map(|r| r.prompt_target_len).collect();
                lens.sort_unstable();
                lens.dedup();
                let mut s = plot::Series::points(n.clone(), Vec::new());
                s.join = true;
                for len in lens {
                    let cell: Vec<&rows::Row> =
                        rows.iter().filter(|r| &name(r) == n && r.prompt_target_len == Some(len)).collect();
                    let values: Vec<f64> =
                        cell.iter().filter(|r| r.status == "ok").filter_map(|r| rate(r)).collect();
                    match crate::verdict::reading::Reading::of(&values, method) {
                        Some(r) => {
                            s.points.push(plot::Point { x: len as f64, y: r.estimate, interval: r.interval });
                            if values.len() > 1 {
                                s.samples.extend(values.iter().map(|v| (len as f64, *v)));
                            }
                        }
                        None => {
                            let mut statuses: Vec<&str> = cell.iter().map(|r| r.status.as_str()).collect();
                            statuses.sort_unstable();
                            statuses.dedup();
                            marks.push(plot::Mark {
                                series: n.clone(),
                                x: len as f64,
                                label: statuses.join(", "),
                            });
                        }
                    }
                }
                s
            })
            .collect();
        plot::Panel {
            series,
            marks,
            split_when_spread: true,
            ..plot::Panel::new(
                metric,
                plot::Axis::log("prompt length (tokens)"),
                plot::Axis::from_zero(format!("{metric} (tok/s)")),
            )
        }
    };
    vec![panel("decode", |r| r.decode_tok_s), panel("prefill", |r| r.prefill_tok_s)]
}
