//! Rotary position embeddings in the half-split layout Llama and Qwen2 use (element `i`
//! of a head pairs with element `i + head_dim / 2`), with the default, `linear` and
//! `llama3` frequency scalings.
//!
//! Frequencies are computed in f64 and stored as f32; an angle is the f32 product of the
//! position and the frequency, as in the Hugging Face and MLX implementations, and its
//! cosine and sine are evaluated in f64 then rounded.

use crate::loading::config::{ModelConfig, RopeScaling};

/// The per-pair inverse frequencies of one model.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Frequencies for `config`'s head size, base and scaling.
    pub fn new(config: &ModelConfig) -> Self {
        Self::with_params(config.head_dim, config.rope_theta, config.rope_scaling)
    }

    /// Frequencies for an explicit head size, base and scaling.
    pub fn with_params(head_dim: usize, theta: f32, scaling: Option<RopeScaling>) -> Self {
        let half = head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| {
                let f = 1.0 / (theta as f64).powf((2 * i) as f64 / head_dim as f64);
                scale_frequency(f, scaling) as f32
            })
            .collect();
        Rope { inv_freq }
    }

    /// Pairs per head (`head_dim / 2`).
    pub fn half(&self) -> usize {
        self.inv_freq.len()
    }

    /// The inverse frequencies, after scaling.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Cosines and sines of position `pos` into `cos` and `sin` (each `head_dim / 2`).
    pub fn angles(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let a = (p * f) as f64;
            *c = a.cos() as f32;
            *s = a.sin() as f32;
        }
    }

    /// Rotates every head of one row `x` (`heads * head_dim` values) by the angles of
    /// its position.
    pub fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.half();
        for head in x.chunks_exact_mut(2 * half) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

fn scale_frequency(f: f64, scaling: Option<RopeScaling>) -> f64 {
    match scaling {
        None => f,
        Some(RopeScaling::Linear { factor }) => f / factor as f64,
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let (factor, low, high) = (factor as f64, low_freq_factor as f64, high_freq_factor as f64);
            let old = original_max_position_embeddings as f64;
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                (1.0 - smooth) * f / factor + smooth * f
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_follow_the_base() {
        let r = Rope::with_params(8, 10_000.0, None);
        let want = [1.0, 0.1, 0.01, 0.001];
        for (g, w) in r.inv_freq().iter().zip(want) {
            assert!((g - w).abs() < 1e-7 * w.max(1e-3), "{g} vs {w}");
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = Rope::with_params(128, 500_000.0, None);
        let scaled = Rope::with_params(128, 500_000.0, Some(s));
        let (p, q) = (plain.inv_freq(), scaled.inv_freq());
        // Wavelength 2 pi / f below 8192 / 4 = 2048: unchanged.
        assert_eq!(p[0], q[0]);
        // The lowest frequency has a wavelength far beyond 8192: divided by the factor.
        assert!((q[63] - p[63] / 8.0).abs() < 1e-12);
        // In between, between the two.
        let mid = p.iter().position(|&f| {
            let w = 2.0 * std::f32::consts::PI / f;
            w > 2048.0 && w < 8192.0
        });
        let m = mid.expect("a medium frequency");
        assert!(q[m] < p[m] && q[m] > p[m] / 8.0);
        let lin = Rope::with_params(8, 10_000.0, Some(RopeScaling::Linear { factor: 2.0 }));
        assert_eq!(lin.inv_freq()[0], 0.5);
    }

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let r = Rope::with_params(4, 10_000.0, None);
        let (mut c, mut s) = ([0f32; 2], [0f32; 2]);
        let x0 = [1.0f32, 2.0, 3.0, 4.0, 0.5, -1.0, 2.0, 0.25];
        let mut x = x0;
        r.angles(0, &mut c, &mut s);
        r.apply(&mut x, &c, &s);
        assert_eq!(x, x0);
        r.angles(17, &mut c, &mut s);
        r.apply(&mut x, &c, &s);
        let n0: f32 = x0[..4].iter().map(|v| v * v).sum();
        let n1: f32 = x[..4].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-5);
        // Pair (0, 2) rotates by 17 radians at frequency 1.
        let (cs, sn) = (17f64.cos() as f32, 17f64.sin() as f32);
        assert!((x[0] - (1.0 * cs - 3.0 * sn)).abs() < 1e-6);
        assert!((x[2] - (3.0 * cs + 1.0 * sn)).abs() < 1e-6);
    }
}
