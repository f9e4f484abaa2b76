//! `kiln serve`'s contracted start-up and switch lines, as types: `Display` is what the
//! engine logs, `parse` what a harness reads back from a log line (plain text, or the
//! `fields.message` of a JSON line). Each line is `<prefix><key>=<value> ...`, and some
//! end in `: <prose>`; the prose is for people and is never parsed for a field.
//!
//! - `kernel configuration: isa=<isa> threads=<n> qmv_wide=<on|off> qmv_wide_pinned=<yes|no>`
//!   ([`KernelConfigLine`], logged once before the model loads);
//! - `listening on http://<ip>:<port>` ([`ListeningLine`], once bound);
//! - `speculative gate outcome=<o> model=<m> k=<K> kv_dtype=<d> qmv_wide=<on|off>: <reason>`
//!   ([`SpecGateLine`], at the first verify of each (model, K, KV dtype));
//! - `kernel configuration changed: qmv_wide=<on|off> qmv_wide_pinned=<yes|no>: <reason>`
//!   ([`KernelChangedLine`], when the gate switched `qmv_wide` for the process).

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

use crate::KvDtype;

/// The five outcomes, each with its fixed log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GateOutcome {
    /// The probe was exact with the kernels as they were.
    Exact,
    /// Exact only after turning `qmv_wide` off; it stays off for the process.
    ExactWithoutWide,
    /// Not exact, and `KILN_SPEC_ALLOW_INEXACT=1` allows speculating anyway.
    InexactAllowed,
    /// Not exact (with `qmv_wide` dropped too, when it could be): classic decode.
    InexactDeclined,
    /// Not exact, and the operator pinned `KILN_QMV_WIDE` so it was not dropped:
    /// classic decode.
    DeclinedPinned,
}

impl GateOutcome {
    /// The outcome's name in the log line.
    pub fn as_str(self) -> &'static str {
        match self {
            GateOutcome::Exact => "exact",
            GateOutcome::ExactWithoutWide => "exact-without-qmv-wide",
            GateOutcome::InexactAllowed => "inexact-allowed",
            GateOutcome::InexactDeclined => "inexact-declined",
            GateOutcome::DeclinedPinned => "declined-pinned",
        }
    }

    /// Whether streams of this key speculate.
    pub fn speculates(self) -> bool {
        matches!(self, GateOutcome::Exact | GateOutcome::ExactWithoutWide | GateOutcome::InexactAllowed)
    }

    /// Whether the line is a warning (anything but a plain exact result).
    pub fn is_warning(self) -> bool {
        self != GateOutcome::Exact
    }

    /// What the line says after its fields: why, and what happens now.
    pub fn explanation(self) -> &'static str {
        match self {
            GateOutcome::Exact => "verify block matches the single-token chain; speculative decoding on",
            GateOutcome::ExactWithoutWide => {
                "verify block matches the single-token chain only with qmv_wide off; qmv_wide stays off \
                 for the whole process; speculative decoding on"
            }
            GateOutcome::InexactAllowed => {
                "verify block differs from the single-token chain; KILN_SPEC_ALLOW_INEXACT=1 allows it; \
                 speculative decoding on"
            }
            GateOutcome::InexactDeclined => {
                "verify block differs from the single-token chain, with qmv_wide off too; classic decode \
                 (KILN_SPEC_ALLOW_INEXACT=1 would speculate anyway)"
            }
            GateOutcome::DeclinedPinned => {
                "verify block differs from the single-token chain and KILN_QMV_WIDE pins the kernel, so \
                 qmv_wide was not dropped; classic decode (KILN_SPEC_ALLOW_INEXACT=1 would speculate anyway)"
            }
        }
    }
}

impl fmt::Display for GateOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for GateOutcome {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        use GateOutcome::*;
        [Exact, ExactWithoutWide, InexactAllowed, InexactDeclined, DeclinedPinned]
            .into_iter()
            .find(|o| o.as_str() == s)
            .ok_or_else(|| format!("{s:?} is not a gate outcome"))
    }
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn parse_on_off(s: &str) -> Option<bool> {
    match s {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    }
}

fn parse_yes_no(s: &str) -> Option<bool> {
    match s {
        "yes" => Some(true),
        "no" => Some(false),
        _ => None,
    }
}

/// The message after `prefix` in a log line, plain or JSON: up to the end of the line
/// or the closing quote of a JSON string.
fn message_after<'a>(line: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = &line[line.find(prefix)? + prefix.len()..];
    Some(rest.split('"').next().unwrap_or(rest))
}

/// The `key=value` words of a message after `prefix`, up to the `: ` before its prose,
/// and the prose. `None` when the prefix is absent or a word is not `key=value`.
fn fields<'a>(line: &'a str, prefix: &str) -> Option<(BTreeMap<&'a str, &'a str>, &'a str)> {
    let rest = message_after(line, prefix)?;
    let (head, prose) = rest.split_once(": ").unwrap_or((rest, ""));
    let map = head
        .split_whitespace()
        .map(|p| p.split_once('=').map(|(k, v)| (k, v.trim_end_matches(':'))))
        .collect::<Option<BTreeMap<_, _>>>()?;
    Some((map, prose))
}

/// `kernel configuration: isa=<isa> threads=<n> qmv_wide=<on|off> qmv_wide_pinned=<yes|no>
/// [qmv_wide_rows=<rows> qmv_crossover=<source>]` (the last two optional):
/// what every stream of the server runs, logged before the model loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelConfigLine {
    /// The instruction set the kernels picked (`avx2`, `scalar`, ...).
    pub isa: String,
    /// Worker threads of the kernels.
    pub threads: usize,
    /// Whether the wide quantized kernels run.
    pub qmv_wide: bool,
    /// Whether the operator pinned the switch with `KILN_QMV_WIDE`.
    pub qmv_wide_pinned: bool,
    /// The batch sizes that run `qmv_wide` (`3,5-15`, `none`), when the engine says.
    pub qmv_wide_rows: Option<String>,
    /// Where that choice came from (`measured`, `cached`, `env`, `pinned`, `default`),
    /// when the engine says.
    pub qmv_crossover: Option<String>,
    /// The activation scheme the kernels run (`KILN_ACT_PRECISION`), when the engine says.
    pub act: Option<crate::ActScheme>,
}

impl KernelConfigLine {
    /// How the message starts.
    pub const PREFIX: &'static str = "kernel configuration: ";

    /// Reads the line from a log line; `None` when it is not one or a field is missing
    /// or malformed.
    pub fn parse(line: &str) -> Option<KernelConfigLine> {
        let (f, _) = fields(line, Self::PREFIX)?;
        Some(KernelConfigLine {
            isa: f.get("isa")?.to_string(),
            threads: f.get("threads")?.parse().ok()?,
            qmv_wide: parse_on_off(f.get("qmv_wide")?)?,
            qmv_wide_pinned: parse_yes_no(f.get("qmv_wide_pinned")?)?,
            qmv_wide_rows: f.get("qmv_wide_rows").map(|v| v.to_string()),
            qmv_crossover: f.get("qmv_crossover").map(|v| v.to_string()),
            act: match f.get("act") {
                Some(v) => Some(crate::ActScheme::parse(v).ok()?),
                None => None,
            },
        })
    }

    /// The first such line in a log.
    pub fn find(log: &str) -> Option<KernelConfigLine> {
        log.lines().find_map(Self::parse)
    }
}

impl fmt::Display for KernelConfigLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}isa={} threads={} qmv_wide={} qmv_wide_pinned={}",
            Self::PREFIX,
            self.isa,
            self.threads,
            on_off(self.qmv_wide),
            yes_no(self.qmv_wide_pinned)
        )?;
        if let Some(rows) = &self.qmv_wide_rows {
            write!(f, " qmv_wide_rows={rows}")?;
        }
        if let Some(source) = &self.qmv_crossover {
            write!(f, " qmv_crossover={source}")?;
        }
        if let Some(act) = self.act {
            write!(f, " act={}", act.as_str())?;
        }
        Ok(())
    }
}

/// `kernel configuration changed: qmv_wide=<on|off> qmv_wide_pinned=<yes|no>: ...`: the
/// exactness gate switched `qmv_wide` for the whole process, so the start-up line no
/// longer says what every stream runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelChangedLine {
    /// The switch now.
    pub qmv_wide: bool,
    /// Whether the operator pinned it.
    pub qmv_wide_pinned: bool,
}

impl KernelChangedLine {
    /// How the message starts.
    pub const PREFIX: &'static str = "kernel configuration changed: ";
    /// What follows the fields.
    pub const REASON: &'static str = "the speculative gate switched qmv_wide for the whole process";

    /// Reads the line from a log line; `None` when it is not one or a field is missing
    /// or malformed. The prose is not read.
    pub fn parse(line: &str) -> Option<KernelChangedLine> {
        let (f, _) = fields(line, Self::PREFIX)?;
        Some(KernelChangedLine {
            qmv_wide: parse_on_off(f.get("qmv_wide")?)?,
            qmv_wide_pinned: parse_yes_no(f.get("qmv_wide_pinned")?)?,
        })
    }

    /// Every such line in a log, in order.
    pub fn all(log: &str) -> Vec<KernelChangedLine> {
        log.lines().filter_map(Self::parse).collect()
    }
}

impl fmt::Display for KernelChangedLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}qmv_wide={} qmv_wide_pinned={}: {}",
            Self::PREFIX,
            on_off(self.qmv_wide),
            yes_no(self.qmv_wide_pinned),
            Self::REASON
        )
    }
}

/// `speculative gate outcome=<o> model=<m> k=<K> kv_dtype=<d> qmv_wide=<on|off>: <reason>`:
/// one decision of the exactness gate (docs/environment-variables.md lists the five).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecGateLine {
    /// The decision.
    pub outcome: GateOutcome,
    /// The model, as it was named when loaded.
    pub model: String,
    /// Drafted tokens per verify.
    pub k: usize,
    /// The KV cache's storage type.
    pub kv_dtype: KvDtype,
    /// The `qmv_wide` switch after the decision.
    pub qmv_wide: bool,
    /// The prose after the fields (the engine writes [`GateOutcome::explanation`]).
    pub reason: String,
}

impl SpecGateLine {
    /// How the message starts.
    pub const PREFIX: &'static str = "speculative gate ";

    /// Reads the line from a log line; `None` when it is not one or a field is missing
    /// or malformed.
    pub fn parse(line: &str) -> Option<SpecGateLine> {
        let (f, reason) = fields(line, Self::PREFIX)?;
        Some(SpecGateLine {
            outcome: f.get("outcome")?.parse().ok()?,
            model: f.get("model")?.to_string(),
            k: f.get("k")?.parse().ok()?,
            kv_dtype: f.get("kv_dtype")?.parse().ok()?,
            qmv_wide: parse_on_off(f.get("qmv_wide")?)?,
            reason: reason.to_string(),
        })
    }

    /// Every such line in a log, in order.
    pub fn all(log: &str) -> Vec<SpecGateLine> {
        log.lines().filter_map(Self::parse).collect()
    }
}

impl fmt::Display for SpecGateLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}outcome={} model={} k={} kv_dtype={} qmv_wide={}: {}",
            Self::PREFIX,
            self.outcome,
            self.model,
            self.k,
            self.kv_dtype,
            on_off(self.qmv_wide),
            self.reason
        )
    }
}

/// `listening on http://<ip>:<port>`: the server is bound (`--port 0` learns its port
/// here) and `/health` answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListeningLine {
    /// The bound address.
    pub addr: SocketAddr,
}

impl ListeningLine {
    /// How the message starts.
    pub const PREFIX: &'static str = "listening on http://";

    /// Reads the line from a log line; `None` when it is not one or the address is
    /// malformed.
    pub fn parse(line: &str) -> Option<ListeningLine> {
        let rest = message_after(line, Self::PREFIX)?;
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '[' | ']')))
            .unwrap_or(rest.len());
        Some(ListeningLine { addr: rest[..end].parse().ok()? })
    }

    /// The first such line in a log.
    pub fn find(log: &str) -> Option<ListeningLine> {
        log.lines().find_map(Self::parse)
    }
}

impl fmt::Display for ListeningLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", Self::PREFIX, self.addr)
    }
}
