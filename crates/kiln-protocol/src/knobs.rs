//! The knobs that cross the boundary: every engine flag a harness passes through to
//! `kiln` (and records in its CSV), each as one typed value, and [`Knobs`], the set of
//! them with its command line ([`Knobs::to_args`]) and the reading of that line back
//! ([`Knobs::from_args`]). Adding a knob is one edit here ([`KNOBS`], [`Knobs`]) plus
//! the code that uses it; a harness's CSV takes its knob columns from [`KNOB_COLUMNS`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A knob's value that could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {flag} {value:?}: accepted values are {accepted}")]
pub struct KnobError {
    /// The flag, `--attention`.
    pub flag: &'static str,
    /// The text that was refused.
    pub value: String,
    /// What would be accepted.
    pub accepted: String,
}

/// `--attention`: which attention implementation runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    /// Tiled online softmax; memory independent of the sequence length.
    #[default]
    Streaming,
    /// Materialised scores; memory grows with rows times context.
    Naive,
}

/// `--kv-dtype`: the storage type of cached keys and values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// IEEE half precision: half the memory, rounding at 11 significant bits.
    #[default]
    F16,
    /// Single precision, as the activations are.
    F32,
}

/// The backend an engine runs on: what a report's `backend` field says and what a
/// harness's `--backend` picks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The CPU backend (no feature).
    #[default]
    Cpu,
    /// NVIDIA GPUs (`cuda` feature).
    Cuda,
    /// Apple GPUs through wgpu's Metal backend (`metal` feature).
    Metal,
    /// Vulkan GPUs (Linux, Windows) through wgpu (`vulkan` feature).
    Vulkan,
}

/// The words of an enum knob, one table per type: `as_str`, `Display` and `FromStr`
/// all read it, so a spelling exists once.
macro_rules! words {
    ($ty:ident, $flag:literal, $($variant:ident => $word:literal),+ $(,)?) => {
        impl $ty {
            /// Every value, in the order the flag lists them.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The value as the flag, the reports and the CSV spell it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $word),+
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $ty {
            type Err = KnobError;

            fn from_str(s: &str) -> Result<Self, KnobError> {
                $ty::ALL.iter().copied().find(|v| v.as_str() == s).ok_or_else(|| KnobError {
                    flag: $flag,
                    value: s.to_string(),
                    accepted: $ty::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(", "),
                })
            }
        }
    };
}

words!(Attention, "--attention", Streaming => "streaming", Naive => "naive");
words!(KvDtype, "--kv-dtype", F16 => "f16", F32 => "f32");
words!(Backend, "--backend", Cpu => "cpu", Cuda => "cuda", Metal => "metal", Vulkan => "vulkan");

impl KvDtype {
    /// Bytes per stored value.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

impl Backend {
    /// Whether it runs on a GPU.
    pub fn is_gpu(self) -> bool {
        self != Backend::Cpu
    }
}

/// One knob: the flag the engine takes and the column a harness's CSV records it in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Knob {
    /// The engine's flag.
    pub flag: &'static str,
    /// The CSV column (the memory limit is recorded in bytes, whatever form was given).
    pub column: &'static str,
}

/// Every knob, in the order of the command line and of the CSV columns.
pub const KNOBS: [Knob; 5] = [
    Knob { flag: "--attention", column: "attention" },
    Knob { flag: "--prefill-chunk", column: "prefill_chunk" },
    Knob { flag: "--kv-dtype", column: "kv_dtype" },
    Knob { flag: "--memory-limit", column: "memory_limit_bytes" },
    Knob { flag: "--threads", column: "threads" },
];

/// The CSV columns of [`KNOBS`], in order.
pub const KNOB_COLUMNS: [&str; KNOBS.len()] = {
    let mut out = [""; KNOBS.len()];
    let mut i = 0;
    while i < KNOBS.len() {
        out[i] = KNOBS[i].column;
        i += 1;
    }
    out
};

/// The knobs a harness passes through to every engine call; `None` leaves the engine's
/// default. The fields follow [`KNOBS`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Knobs {
    /// `--memory-limit`, as given (`512MiB`, bytes): checked by [`crate::parse_size`].
    pub memory_limit: Option<String>,
    /// `--prefill-chunk`: prompt tokens per prefill forward, 0 for one forward.
    pub prefill_chunk: Option<u64>,
    /// `--attention`.
    pub attention: Option<Attention>,
    /// `--kv-dtype`.
    pub kv_dtype: Option<KvDtype>,
    /// `--threads`: worker threads.
    pub threads: Option<u64>,
}

impl Knobs {
    /// Each knob's value as its flag takes it, in the order of [`KNOBS`]; `None` for a
    /// knob left at the engine's default.
    pub fn values(&self) -> [Option<String>; KNOBS.len()] {
        [
            self.attention.map(|a| a.to_string()),
            self.prefill_chunk.map(|c| c.to_string()),
            self.kv_dtype.map(|k| k.to_string()),
            self.memory_limit.clone(),
            self.threads.map(|t| t.to_string()),
        ]
    }

    /// Sets the knob of `flag` from its text; an unknown flag or an unreadable value is
    /// an error naming it.
    pub fn set(&mut self, flag: &str, value: &str) -> Result<(), KnobError> {
        let count = |flag: &'static str| {
            value.parse::<u64>().map_err(|_| KnobError {
                flag,
                value: value.to_string(),
                accepted: format!("0 to {}", u64::MAX),
            })
        };
        match flag {
            "--attention" => self.attention = Some(value.parse()?),
            "--prefill-chunk" => self.prefill_chunk = Some(count("--prefill-chunk")?),
            "--kv-dtype" => self.kv_dtype = Some(value.parse()?),
            "--memory-limit" => {
                crate::parse_size(value).map_err(|e| KnobError {
                    flag: "--memory-limit",
                    value: value.to_string(),
                    accepted: e.to_string(),
                })?;
                self.memory_limit = Some(value.to_string());
            }
            "--threads" => self.threads = Some(count("--threads")?),
            other => {
                return Err(KnobError {
                    flag: "knob",
                    value: other.to_string(),
                    accepted: KNOBS.iter().map(|k| k.flag).collect::<Vec<_>>().join(", "),
                });
            }
        }
        Ok(())
    }

    /// The flags every engine call gets: `--flag value` for each knob that is set.
    pub fn to_args(&self) -> Vec<String> {
        KNOBS
            .iter()
            .zip(self.values())
            .filter_map(|(k, v)| v.map(|v| [k.flag.to_string(), v]))
            .flatten()
            .collect()
    }

    /// Reads knobs back from a command line of `--flag value` pairs (as [`Self::to_args`]
    /// writes them; `--flag=value` too). Anything else is an error naming it.
    pub fn from_args<S: AsRef<str>>(args: &[S]) -> Result<Knobs, KnobError> {
        let mut knobs = Knobs::default();
        let mut words = args.iter().map(AsRef::as_ref);
        while let Some(word) = words.next() {
            let (flag, value) = match word.split_once('=') {
                Some((f, v)) => (f, v),
                None => match words.next() {
                    Some(v) => (word, v),
                    None => {
                        let flag = KNOBS.iter().find(|k| k.flag == word).map_or("knob", |k| k.flag);
                        return Err(KnobError {
                            flag,
                            value: String::new(),
                            accepted: "a value after the flag".into(),
                        });
                    }
                },
            };
            knobs.set(flag, value)?;
        }
        Ok(knobs)
    }
}
