//! The per-forward fit: does one constant explain a tax measured in several cells?
//!
//! Each cell gives the mean paired difference `y` (narrow minus wide, e.g. ms of TPOT or
//! TTFT) with its standard error `se`, and how many taxed forwards its quantity holds:
//! `x` forwards (per-forward model) or `x * M` rows (per-token model). The model
//! `y = beta * x` is fitted by weighted least squares through the origin (weights
//! `1 / se^2`): `beta = sum(w x y) / sum(w x^2)` with standard error
//! `sqrt(1 / sum(w x^2))`, residuals `y - beta x`, and the goodness of fit
//! `chi2 = sum(w r^2)` on `k - 1` degrees of freedom. One constant explains the cells
//! when `chi2` is not beyond its 95% point (p >= 0.05); when it is, the interval of
//! `beta` is widened by `sqrt(chi2 / (k - 1))` (the Birge ratio) and the record says the
//! constant does not explain them.

/// One cell's measured tax.
#[derive(Clone, Debug, PartialEq)]
pub struct Obs {
    /// The cell.
    pub cell: String,
    /// Taxed forwards in the measured quantity (per request, per token).
    pub forwards: f64,
    /// Rows (tokens) in each of those forwards: the M.
    pub m: f64,
    /// The mean paired difference.
    pub y: f64,
    /// Its standard error.
    pub se: f64,
}

/// Which quantity the constant is per.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Per {
    /// Per forward, whatever its M.
    Forward,
    /// Per row (token) of the forward.
    Token,
}

/// A fit of one constant.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    /// What the constant is per.
    pub per: Per,
    /// The constant.
    pub beta: f64,
    /// Its 95% interval (widened when one constant does not explain the cells).
    pub ci95: (f64, f64),
    /// Per cell: the residual `y - beta x`.
    pub residuals: Vec<(String, f64)>,
    /// The goodness of fit.
    pub chi2: f64,
    /// Its degrees of freedom (cells - 1).
    pub df: usize,
    /// `P(chi2 >= observed)`; `None` with one cell.
    pub p: Option<f64>,
}

impl Fit {
    /// Whether one constant explains the cells (p >= 0.05); `None` with one cell, where
    /// no test is possible.
    pub fn explains(&self) -> Option<bool> {
        self.p.map(|p| p >= 0.05)
    }
}

/// The weighted least-squares fit through the origin; `None` without a usable cell.
pub fn fit(obs: &[Obs], per: Per) -> Option<Fit> {
    let rows: Vec<(&Obs, f64, f64)> = obs
        .iter()
        .filter(|o| o.se > 0.0 && o.se.is_finite() && o.y.is_finite())
        .map(|o| (o, if per == Per::Forward { o.forwards } else { o.forwards * o.m }, 1.0 / (o.se * o.se)))
        .filter(|(_, x, _)| *x > 0.0)
        .collect();
    if rows.is_empty() {
        return None;
    }
    let sxx: f64 = rows.iter().map(|(_, x, w)| w * x * x).sum();
    let sxy: f64 = rows.iter().map(|(o, x, w)| w * x * o.y).sum();
    let beta = sxy / sxx;
    let residuals: Vec<(String, f64)> =
        rows.iter().map(|(o, x, _)| (o.cell.clone(), o.y - beta * x)).collect();
    let chi2: f64 = rows.iter().map(|(o, x, w)| w * (o.y - beta * x).powi(2)).sum();
    let df = rows.len() - 1;
    let p = (df > 0).then(|| chi2_survival(chi2, df as f64));
    let mut se = (1.0 / sxx).sqrt();
    if p.is_some_and(|p| p < 0.05) {
        se *= (chi2 / df as f64).sqrt();
    }
    Some(Fit { per, beta, ci95: (beta - 1.959_964 * se, beta + 1.959_964 * se), residuals, chi2, df, p })
}

/// Both fits, the one with the smaller chi-square first (the one that fits better).
pub fn both(obs: &[Obs]) -> Vec<Fit> {
    let mut fits: Vec<Fit> = [Per::Forward, Per::Token].into_iter().filter_map(|p| fit(obs, p)).collect();
    fits.sort_by(|a, b| a.chi2.total_cmp(&b.chi2));
    fits
}

/// `P(X >= x)` for a chi-square variable with `df` degrees of freedom: the regularized
/// upper incomplete gamma `Q(df / 2, x / 2)`.
pub fn chi2_survival(x: f64, df: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    gamma_q(df / 2.0, x / 2.0)
}

/// The regularized upper incomplete gamma `Q(a, x)`: a series below `a + 1`, a
/// continued fraction (modified Lentz) above.
fn gamma_q(a: f64, x: f64) -> f64 {
    let ln_front = a * x.ln() - x - crate::verdict::student_t::ln_gamma(a);
    if x < a + 1.0 {
        let (mut sum, mut term, mut ap) = (1.0 / a, 1.0 / a, a);
        for _ in 0..1000 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
            if term.abs() < sum.abs() * 1e-16 {
                break;
            }
        }
        (1.0 - sum * ln_front.exp()).clamp(0.0, 1.0)
    } else {
        const TINY: f64 = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / TINY;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..1000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < TINY {
                d = TINY;
            }
            c = b + an / c;
            if c.abs() < TINY {
                c = TINY;
            }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-16 {
                break;
            }
        }
        (ln_front.exp() * h).clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(cell: &str, forwards: f64, m: f64, y: f64, se: f64) -> Obs {
        Obs { cell: cell.into(), forwards, m, y, se }
    }

    #[test]
    fn the_fit_matches_the_hand_computed_case() {
        // x = 1, 2, 4 forwards; y = 2, 4.2, 7.8 ms; se = 0.1, 0.2, 0.4, so w = 100, 25,
        // 6.25. By hand: sum(w x y) = 200 + 210 + 195 = 605, sum(w x^2) = 100 + 100 + 100
        // = 300, beta = 605 / 300 = 2.016667 ms per forward, se = sqrt(1 / 300) =
        // 0.057735; residuals -0.016667, 0.166667, -0.266667; chi2 = 0.027778 +
        // 0.694444 + 0.444444 = 1.166667 on 2 df, p = exp(-chi2 / 2) = 0.558035.
        let cells =
            [obs("a", 1.0, 2.0, 2.0, 0.1), obs("b", 2.0, 4.0, 4.2, 0.2), obs("c", 4.0, 8.0, 7.8, 0.4)];
        let f = fit(&cells, Per::Forward).unwrap();
        assert!((f.beta - 605.0 / 300.0).abs() < 1e-12, "{}", f.beta);
        let half = 1.959_964 * (1.0f64 / 300.0).sqrt();
        assert!((f.ci95.0 - (f.beta - half)).abs() < 1e-12 && (f.ci95.1 - (f.beta + half)).abs() < 1e-12);
        let r: Vec<f64> = f.residuals.iter().map(|(_, r)| *r).collect();
        for (got, want) in r.iter().zip([-0.016_667, 0.166_667, -0.266_667]) {
            assert!((got - want).abs() < 1e-6, "{r:?}");
        }
        assert!((f.chi2 - 1.166_667).abs() < 1e-6, "{}", f.chi2);
        assert_eq!(f.df, 2);
        assert!((f.p.unwrap() - (-1.166_667f64 / 2.0).exp()).abs() < 1e-6, "{:?}", f.p);
        assert_eq!(f.explains(), Some(true));
        // Per token the same cells need x = 2, 8, 32: a constant cannot follow y, so the
        // per-forward fit comes first and the per-token one does not explain them.
        let fits = both(&cells);
        assert_eq!(fits[0].per, Per::Forward);
        assert_eq!(fits[1].explains(), Some(false));
        assert!(fits[1].ci95.1 - fits[1].ci95.0 > 2.0 * 1.959_964 * (1.0 / fits_sxx(&cells)).sqrt());
    }

    fn fits_sxx(cells: &[Obs]) -> f64 {
        cells.iter().map(|o| (o.forwards * o.m).powi(2) / (o.se * o.se)).sum()
    }

    #[test]
    fn chi_square_tails_match_the_table() {
        // 95% points: 3.841 (1 df), 5.991 (2), 7.815 (3), 18.307 (10).
        for (x, df) in [(3.841, 1.0), (5.991, 2.0), (7.815, 3.0), (18.307, 10.0)] {
            assert!((chi2_survival(x, df) - 0.05).abs() < 2e-4, "{x} {df}: {}", chi2_survival(x, df));
        }
        assert_eq!(chi2_survival(0.0, 3.0), 1.0);
        let one = fit(&[obs("a", 1.0, 4.0, 15.4, 0.5)], Per::Forward).unwrap();
        assert_eq!((one.df, one.p, one.explains()), (0, None, None));
        assert_eq!(fit(&[obs("a", 1.0, 4.0, 15.4, 0.0)], Per::Forward), None);
    }
}
