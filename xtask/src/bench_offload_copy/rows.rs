//! The CSV row of one (model, slots, batch, miss rate) cell, its exact header (the
//! geometry, the measurements, the fingerprint every sweep's rows carry, then the
//! status), and the console table a geometry prints as its cells finish.

use serde::{Deserialize, Serialize};

use crate::sweep::rows::{FINGERPRINT_BEFORE_DRIVER, with_fingerprint, with_fingerprint_of};

/// The CSV header, exactly: the geometry, the measurements, then the fingerprint every
/// sweep's rows carry, then the status.
pub const HEADER: [&str; 29] = with_fingerprint(HEAD, TAIL);

/// The header before the fingerprint's `driver_version` and `cuda_version`: such a file
/// is still read (its rows with those columns empty).
pub const HEADER_BEFORE_DRIVER: [&str; 27] = with_fingerprint_of(HEAD, &FINGERPRINT_BEFORE_DRIVER, TAIL);

/// The columns before the fingerprint: the geometry and the measurements.
const HEAD: [&str; 17] = [
    "model",
    "model_path",
    "cache_slots",
    "slot_bytes",
    "cache_bytes",
    "batch_size",
    "miss_rate",
    "measured_miss_rate",
    "tokens",
    "fetches",
    "misses",
    "bytes_copied",
    "copy_gb_s",
    "fetch_us_per_token",
    "read_bandwidth_gb_s",
    "copy_share",
    "peak_bytes",
];

/// The columns after the fingerprint.
const TAIL: [&str; 3] = ["memory_limit_bytes", "threads", "status"];

/// One row of the CSV: one (model, slots, batch, miss rate) cell.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OffloadRow {
    pub(crate) model: String,
    pub(crate) model_path: String,
    pub(crate) cache_slots: u64,
    pub(crate) slot_bytes: Option<u64>,
    pub(crate) cache_bytes: Option<u64>,
    pub(crate) batch_size: u64,
    pub(crate) miss_rate: f64,
    pub(crate) measured_miss_rate: Option<f64>,
    pub(crate) tokens: Option<u64>,
    pub(crate) fetches: Option<u64>,
    pub(crate) misses: Option<u64>,
    pub(crate) bytes_copied: Option<u64>,
    pub(crate) copy_gb_s: Option<f64>,
    pub(crate) fetch_us_per_token: Option<f64>,
    pub(crate) read_bandwidth_gb_s: Option<f64>,
    pub(crate) copy_share: Option<f64>,
    pub(crate) peak_bytes: Option<u64>,
    pub(crate) date: String,
    pub(crate) host: String,
    pub(crate) device: String,
    pub(crate) backend: String,
    pub(crate) kiln_version: String,
    pub(crate) commit: String,
    pub(crate) features: String,
    #[serde(default)]
    pub(crate) driver_version: String,
    #[serde(default)]
    pub(crate) cuda_version: String,
    pub(crate) memory_limit_bytes: Option<u64>,
    pub(crate) threads: Option<u64>,
    pub(crate) status: String,
}

/// `1.5 GiB`-style sizes for the geometry lines.
pub(super) fn size(bytes: u64) -> String {
    crate::console::human_bytes(bytes)
}

/// The column titles of a geometry's table.
pub const TABLE_COLUMNS: &str = "  batch   miss  measured  copy GB/s  share  fetch us/token  status";

pub(super) fn table_row(r: &OffloadRow) -> String {
    let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
    format!(
        "  {:>5}  {:>5.2}  {:>8}  {:>9}  {:>5}  {:>14}  {}",
        r.batch_size,
        r.miss_rate,
        opt(r.measured_miss_rate, 3),
        opt(r.copy_gb_s, 2),
        opt(r.copy_share, 2),
        opt(r.fetch_us_per_token, 2),
        r.status
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_is_the_row_struct() {
        let mut w = csv::WriterBuilder::new().has_headers(true).from_writer(Vec::new());
        w.serialize(OffloadRow::default()).unwrap();
        let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
        assert_eq!(text.lines().next().unwrap(), HEADER.join(","));
    }

    #[test]
    fn the_header_is_exact() {
        assert_eq!(
            HEADER.join(","),
            "model,model_path,cache_slots,slot_bytes,cache_bytes,batch_size,miss_rate,measured_miss_rate,\
             tokens,fetches,misses,bytes_copied,copy_gb_s,fetch_us_per_token,read_bandwidth_gb_s,copy_share,\
             peak_bytes,date,host,device,backend,kiln_version,commit,features,driver_version,cuda_version,\
             memory_limit_bytes,threads,status"
        );
    }
}
