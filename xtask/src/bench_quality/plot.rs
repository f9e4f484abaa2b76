//! The quality plot and what it reads of a row: a run's rows as bench-quality scores
//! them, or quality.csv read back by `cargo xtask report`. Below the task, so the report
//! draws it without naming the task.

/// What the quality plot needs of a row: from a run's rows, or read back from its CSV.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    /// The model.
    pub model: String,
    /// The scheme (or a compared engine's name).
    pub scheme: String,
    /// Mean KL divergence from the reference, nats.
    pub kld_mean: f64,
    /// Its standard error.
    pub kld_se: f64,
    /// Share of positions with the reference's most likely token.
    pub top1_agree: f64,
}

impl Scored {
    /// From a row of quality.csv, keyed by its header; `None` when a value is missing.
    pub fn from_csv(m: &std::collections::BTreeMap<String, String>) -> Option<Scored> {
        let f = |k: &str| m.get(k)?.parse::<f64>().ok();
        Some(Scored {
            model: m.get("model")?.clone(),
            scheme: m.get("scheme")?.clone(),
            kld_mean: f("kld_mean")?,
            kld_se: f("kld_se")?,
            top1_agree: f("top1_agree")?,
        })
    }
}

/// The quality plot: mean KL divergence (log axis, with its 95% interval) and top-1
/// agreement per scheme, one series per model; schemes are categories, never joined.
pub fn panels(rows: &[Scored]) -> Vec<crate::plot::Panel> {
    use crate::plot::{Axis, Panel, Point, Series};
    let mut schemes: Vec<String> = Vec::new();
    let mut models: Vec<String> = Vec::new();
    for r in rows {
        if !schemes.contains(&r.scheme) {
            schemes.push(r.scheme.clone());
        }
        if !models.contains(&r.model) {
            models.push(r.model.clone());
        }
    }
    let at = |r: &Scored| schemes.iter().position(|s| *s == r.scheme).unwrap_or(0) as f64;
    let series = |f: &dyn Fn(&Scored) -> Point| -> Vec<Series> {
        models
            .iter()
            .map(|m| Series::points(m.clone(), rows.iter().filter(|r| r.model == *m).map(f).collect()))
            .collect()
    };
    let kld = |r: &Scored| {
        let half = 1.96 * r.kld_se;
        Point {
            x: at(r),
            y: r.kld_mean,
            interval: (r.kld_mean - half > 0.0).then_some((r.kld_mean - half, r.kld_mean + half)),
        }
    };
    vec![
        Panel {
            series: series(&kld),
            ..Panel::new(
                "mean KL divergence from the reference",
                Axis::categories("scheme", schemes.clone()),
                Axis::log("mean KLD (nats)"),
            )
        },
        Panel {
            series: series(&|r| Point::from((at(r), 100.0 * r.top1_agree))),
            ..Panel::new(
                "top-1 agreement with the reference",
                Axis::categories("scheme", schemes.clone()),
                Axis::linear("top-1 agreement (%)"),
            )
        },
    ]
}
