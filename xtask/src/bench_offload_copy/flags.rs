//! The flags of `cargo xtask bench-offload-copy` and their list parsers: each list is
//! checked whole at parse time, and a bad entry is named with what would be accepted.

use std::path::PathBuf;

use crate::args::count;
use crate::kiln_build::BackendArg;
use crate::sweep::plan;

/// Flags of `cargo xtask bench-offload-copy`.
#[derive(clap::Args)]
pub struct BenchOffloadCopy {
    /// MoE models, comma- or space-separated [default on the CPU: synthetic:tiny-moe,
    /// synthetic:tiny-qwen2-moe; on a GPU: synthetic:qwen3-30b-a3b, synthetic:mixtral-8x7b,
    /// synthetic:qwen1.5-moe-a2.7b].
    #[arg(short = 'm', long, alias = "model", value_name = "LIST", value_parser = plan::models_arg)]
    pub(super) models: Option<plan::Models>,
    /// Expert-cache slot counts, for every model [default per model: its experts per
    /// layer, and 0.4 x layers x experts].
    #[arg(long, value_name = "LIST", value_parser = counts_arg)]
    pub(super) cache_slots: Option<Counts>,
    /// Rows decoded together.
    #[arg(long, value_name = "LIST", value_parser = counts_arg, default_value = "1,4,16,64")]
    pub(super) batch_sizes: Counts,
    /// Shares of expert choices that miss the cache, each 0 to 1.
    #[arg(long, value_name = "LIST", value_parser = rates_arg, default_value = "0,0.1,0.5,1")]
    pub(super) miss_rates: Rates,
    /// Passed to the engine: most decode steps per cell.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = count(1))]
    pub(super) steps: u64,
    /// Passed to the engine: simulate steps (up to --steps) for at least this long.
    #[arg(long, value_name = "MS", default_value_t = 300, value_parser = count(0))]
    pub(super) min_time_ms: u64,
    /// Passed to the engine: the read-bandwidth buffer of each cell (1MiB or more).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = bandwidth_arg)]
    pub(super) bandwidth_bytes: String,
    /// The CSV to write [default: benchmarks/<backend>_<host>_<date>_offload-copy.csv];
    /// the markdown tables and the SVG go beside it.
    #[arg(long, value_name = "FILE")]
    pub(super) output: Option<PathBuf>,
    /// Passed to the engine: the memory pool's limit, which also sets the CPU backend's
    /// slot cap (bytes, or 512MiB, 4GiB, ...).
    #[arg(long, value_name = "SIZE")]
    pub(super) memory_limit: Option<String>,
    /// Passed to the engine: worker threads [default: the engine's].
    #[arg(long, value_name = "N", value_parser = count(1))]
    pub(super) threads: Option<u64>,
    /// Seconds before a cell is killed [default: 1800 on the CPU, 900 on a GPU].
    #[arg(long, value_name = "SECS", value_parser = count(1))]
    pub(super) cell_timeout: Option<u64>,
    /// Do not build kiln; use the release binary already in the target directory.
    #[arg(long)]
    pub(super) no_build: bool,
    /// Use this kiln binary instead of building one (also KILN_BENCH_KILN_BIN).
    #[arg(long, value_name = "PATH")]
    pub(super) kiln_bin: Option<PathBuf>,
    /// The backend to build and run.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub(super) backend: BackendArg,
    /// The persistent OOM record [default: benchmarks/.oom-record].
    #[arg(long, value_name = "FILE")]
    pub(super) oom_record: Option<PathBuf>,
    /// Where run directories (env.json, per-cell logs) go [default: benchmarks/runs].
    #[arg(long, value_name = "DIR")]
    pub(super) runs_dir: Option<PathBuf>,
}

/// Positive integers from a list.
#[derive(Clone, Debug)]
pub(super) struct Counts(pub(super) Vec<u64>);

/// Rates in [0, 1] from a list.
#[derive(Clone, Debug)]
pub(super) struct Rates(pub(super) Vec<f64>);

fn tokens(s: &str) -> Vec<&str> {
    s.split([' ', ',', '\t', '\n']).filter(|t| !t.is_empty()).collect()
}

fn counts_arg(s: &str) -> Result<Counts, String> {
    let t = tokens(s);
    if t.is_empty() {
        return Err("the list is empty: expected positive integers such as \"1,4,16,64\"".into());
    }
    let mut out = Vec::new();
    for x in t {
        match x.parse::<u64>() {
            Ok(n) if n > 0 && x.bytes().all(|b| b.is_ascii_digit()) => {
                if out.contains(&n) {
                    return Err(format!("`{x}` appears twice: each value runs once"));
                }
                out.push(n);
            }
            _ => {
                return Err(format!(
                    "`{x}` is not a positive integer: expected values such as \"1,4,16,64\""
                ));
            }
        }
    }
    Ok(Counts(out))
}

/// `--bandwidth-bytes`, checked at parse time by the engine's own rule and passed on as
/// written.
fn bandwidth_arg(s: &str) -> Result<String, String> {
    kiln_protocol::parse_bandwidth_bytes(s).map(|_| s.to_string())
}

fn rates_arg(s: &str) -> Result<Rates, String> {
    let t = tokens(s);
    if t.is_empty() {
        return Err("the list is empty: expected rates from 0 to 1 such as \"0,0.1,0.5,1\"".into());
    }
    let mut out: Vec<f64> = Vec::new();
    for x in t {
        match x.parse::<f64>() {
            Ok(r) if (0.0..=1.0).contains(&r) => {
                if out.contains(&r) {
                    return Err(format!("`{x}` appears twice: each rate runs once"));
                }
                out.push(r);
            }
            _ => {
                return Err(format!(
                    "`{x}` is not a rate from 0 to 1: expected values such as \"0,0.1,0.5,1\""
                ));
            }
        }
    }
    Ok(Rates(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_strictly_and_name_the_bad_entry() {
        assert_eq!(counts_arg("1,4 16").unwrap().0, vec![1, 4, 16]);
        for bad in ["", "0", "1,1", "-4", "2x"] {
            assert!(counts_arg(bad).is_err(), "{bad:?}");
        }
        assert!(counts_arg("2x").unwrap_err().contains("`2x`"));
        assert_eq!(rates_arg("0,0.1 1").unwrap().0, vec![0.0, 0.1, 1.0]);
        for bad in ["", "1.5", "-0.1", "nan", "0,0"] {
            assert!(rates_arg(bad).is_err(), "{bad:?}");
        }
        assert_eq!(bandwidth_arg("4MiB").unwrap(), "4MiB");
        for bad in ["4KiB", "lots", ""] {
            assert!(bandwidth_arg(bad).is_err(), "{bad:?}");
        }
    }
}
