//! The exactness gate. Speculative greedy decoding is only identical to classic greedy
//! decoding when the verify block's logits equal the single-token chain's, bit for bit.
//! At the first verify of each shape key (model, K, KV dtype) the gate runs a probe
//! (from the same state, the block's logits against the chain's over several draws)
//! and decides, once per key:
//!
//! 1. exact: speculate;
//! 2. not exact and `KILN_QMV_WIDE` not set by the operator: turn `qmv_wide` off for the
//!    whole process and probe again; exact now: keep it off and speculate; still not
//!    exact: turn it back on;
//! 3. still not exact: speculate only when `KILN_SPEC_ALLOW_INEXACT=1`, else decode
//!    classically.
//!
//! Each decision is reported by one line of fixed wording
//! (`speculative gate outcome=<outcome> ...`), listed in docs/environment-variables.md;
//! harnesses read a boot's arm from it. `KILN_SPEC_TEST_INEXACT` makes the probe report
//! inexact (`always`, or `wide`: only while `qmv_wide` is on) so tests reach every branch.

use std::collections::HashMap;

use crate::error::{ModelError, Result};
use crate::forward::kv_cache::KvDtype;

/// `1` lets an inexact verify speculate anyway.
pub const ALLOW_INEXACT_ENV: &str = "KILN_SPEC_ALLOW_INEXACT";
/// Test-only: `always` or `wide` makes the probe report inexact.
pub const TEST_INEXACT_ENV: &str = "KILN_SPEC_TEST_INEXACT";

/// What the gate decides for: a model, a draft length and a cache type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GateKey {
    /// The model, as it was named when loaded.
    pub model: String,
    /// Drafted tokens per verify (the block is K + 1 positions).
    pub k: usize,
    /// Cache storage type.
    pub kv_dtype: KvDtype,
}

/// The five outcomes, each with its fixed log line (the protocol's type: the harness
/// reads it back from the line).
pub use kiln_protocol::GateOutcome;

/// One decision, as it is logged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GateReport {
    /// What was decided for.
    pub key: GateKey,
    /// The decision.
    pub outcome: GateOutcome,
    /// The `qmv_wide` switch after the decision.
    pub qmv_wide: bool,
}

impl GateReport {
    /// The fixed-wording line: `speculative gate outcome=<o> model=<m> k=<K>
    /// kv_dtype=<d> qmv_wide=<on|off>: <explanation>`.
    pub fn message(&self) -> String {
        kiln_protocol::SpecGateLine {
            outcome: self.outcome,
            model: self.key.model.clone(),
            k: self.key.k,
            kv_dtype: self.key.kv_dtype,
            qmv_wide: self.qmv_wide,
            reason: self.outcome.explanation().to_string(),
        }
        .to_string()
    }
}

/// The `qmv_wide` switch as the gate sees it; [`ProcessSwitch`] is the real one.
pub trait WideSwitch {
    /// Whether the wide kernel is on.
    fn enabled(&self) -> bool;
    /// Turns it on or off.
    fn set(&self, on: bool);
    /// Whether the operator pinned it with `KILN_QMV_WIDE`.
    fn pinned(&self) -> bool;
}

/// The process-wide switch in `kiln_core::wide`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessSwitch;

impl WideSwitch for ProcessSwitch {
    fn enabled(&self) -> bool {
        kiln_core::wide::qmv_wide_enabled()
    }
    fn set(&self, on: bool) {
        kiln_core::wide::set_qmv_wide(on)
    }
    fn pinned(&self) -> bool {
        kiln_core::wide::qmv_wide_pinned_by_operator()
    }
}

/// Test-only forcing of the probe's result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TestInexact {
    /// The probe reports what it measured.
    #[default]
    Off,
    /// The probe always reports inexact.
    Always,
    /// The probe reports inexact while `qmv_wide` is on.
    Wide,
}

/// The operator's choices the gate reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatePolicy {
    /// `KILN_SPEC_ALLOW_INEXACT=1`.
    pub allow_inexact: bool,
    /// `KILN_SPEC_TEST_INEXACT`.
    pub test_inexact: TestInexact,
}

impl GatePolicy {
    /// Reads `KILN_SPEC_ALLOW_INEXACT` and `KILN_SPEC_TEST_INEXACT`.
    pub fn from_env() -> Result<Self> {
        Self::parse(
            std::env::var(ALLOW_INEXACT_ENV).ok().as_deref(),
            std::env::var(TEST_INEXACT_ENV).ok().as_deref(),
        )
    }

    /// Parses the two variables' values (None: unset).
    pub fn parse(allow: Option<&str>, test: Option<&str>) -> Result<Self> {
        let invalid = |var: &str, value: &str, accepted: &str| ModelError::InvalidArgument {
            what: var.to_string(),
            message: format!("{value:?} is not accepted: accepted values are {accepted}"),
        };
        let allow_inexact = match allow.map(str::trim) {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(v) => return Err(invalid(ALLOW_INEXACT_ENV, v, "1 (allow) or 0 (do not)")),
        };
        let test_inexact = match test.map(str::trim) {
            None | Some("") => TestInexact::Off,
            Some("always") => TestInexact::Always,
            Some("wide") => TestInexact::Wide,
            Some(v) => return Err(invalid(TEST_INEXACT_ENV, v, "always or wide (unset: off)")),
        };
        Ok(GatePolicy { allow_inexact, test_inexact })
    }
}

/// The gate: a policy, the switch, and the decision for every key seen so far.
pub struct ExactnessGate<S: WideSwitch = ProcessSwitch> {
    policy: GatePolicy,
    switch: S,
    decided: HashMap<GateKey, GateOutcome>,
}

impl ExactnessGate<ProcessSwitch> {
    /// The gate over the process switch, its policy read from the environment.
    pub fn from_env() -> Result<Self> {
        Ok(Self::new(GatePolicy::from_env()?, ProcessSwitch))
    }
}

impl<S: WideSwitch> ExactnessGate<S> {
    /// A gate with no decisions yet.
    pub fn new(policy: GatePolicy, switch: S) -> Self {
        ExactnessGate { policy, switch, decided: HashMap::new() }
    }

    /// The policy.
    pub fn policy(&self) -> GatePolicy {
        self.policy
    }

    /// The decision already taken for `key`, if any.
    pub fn decided(&self, key: &GateKey) -> Option<GateOutcome> {
        self.decided.get(key).copied()
    }

    /// Decides for `key` (memoized: a key already decided is not probed again and
    /// reports its earlier outcome). `probe` runs the comparison from the stream's
    /// current state and returns whether it was exact; it may run twice.
    pub fn decide(&mut self, key: &GateKey, mut probe: impl FnMut() -> Result<bool>) -> Result<GateReport> {
        if let Some(outcome) = self.decided(key) {
            return Ok(GateReport { key: key.clone(), outcome, qmv_wide: self.switch.enabled() });
        }
        let mut run = |switch: &S| -> Result<bool> {
            let exact = probe()?;
            let forced = match self.policy.test_inexact {
                TestInexact::Off => false,
                TestInexact::Always => true,
                TestInexact::Wide => switch.enabled(),
            };
            Ok(exact && !forced)
        };
        let outcome = if run(&self.switch)? {
            GateOutcome::Exact
        } else if self.switch.pinned() {
            if self.policy.allow_inexact { GateOutcome::InexactAllowed } else { GateOutcome::DeclinedPinned }
        } else {
            let was = self.switch.enabled();
            let exact_narrow = if was {
                self.switch.set(false);
                let exact = run(&self.switch);
                if !matches!(exact, Ok(true)) {
                    self.switch.set(was);
                }
                exact?
            } else {
                false
            };
            if exact_narrow {
                GateOutcome::ExactWithoutWide
            } else if self.policy.allow_inexact {
                GateOutcome::InexactAllowed
            } else {
                GateOutcome::InexactDeclined
            }
        };
        self.decided.insert(key.clone(), outcome);
        Ok(GateReport { key: key.clone(), outcome, qmv_wide: self.switch.enabled() })
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    struct FakeSwitch {
        on: Cell<bool>,
        pinned: bool,
    }

    impl WideSwitch for &FakeSwitch {
        fn enabled(&self) -> bool {
            self.on.get()
        }
        fn set(&self, on: bool) {
            self.on.set(on)
        }
        fn pinned(&self) -> bool {
            self.pinned
        }
    }

    fn key(k: usize) -> GateKey {
        GateKey { model: "synthetic:tiny".into(), k, kv_dtype: KvDtype::F16 }
    }

    /// Runs one decision with a probe that is exact exactly when `exact(wide_on)`.
    fn decide(
        allow: bool,
        test: TestInexact,
        pinned: bool,
        exact: impl Fn(bool) -> bool,
    ) -> (GateOutcome, bool, usize) {
        let switch = FakeSwitch { on: Cell::new(true), pinned };
        let mut gate = ExactnessGate::new(GatePolicy { allow_inexact: allow, test_inexact: test }, &switch);
        let mut probes = 0;
        let report = gate
            .decide(&key(4), || {
                probes += 1;
                Ok(exact(switch.on.get()))
            })
            .unwrap();
        assert_eq!(report.qmv_wide, switch.on.get());
        (report.outcome, switch.on.get(), probes)
    }

    #[test]
    fn every_outcome_and_what_it_leaves_the_switch() {
        use GateOutcome::*;
        use TestInexact::*;
        let always = |_| true;
        // (allow, test, pinned, probe) -> (outcome, wide after, probes run)
        assert_eq!(decide(false, Off, false, always), (Exact, true, 1));
        assert_eq!(decide(false, Off, false, |wide| !wide), (ExactWithoutWide, false, 2));
        assert_eq!(decide(false, Wide, false, always), (ExactWithoutWide, false, 2));
        assert_eq!(decide(true, Wide, false, always), (ExactWithoutWide, false, 2));
        assert_eq!(decide(false, Always, false, always), (InexactDeclined, true, 2));
        assert_eq!(decide(true, Always, false, always), (InexactAllowed, true, 2));
        assert_eq!(decide(false, Wide, true, always), (DeclinedPinned, true, 1));
        assert_eq!(decide(true, Wide, true, always), (InexactAllowed, true, 1));
        assert_eq!(decide(false, Off, true, always), (Exact, true, 1));
    }

    #[test]
    fn a_decision_is_memoized_per_key() {
        let switch = FakeSwitch { on: Cell::new(true), pinned: false };
        let mut gate = ExactnessGate::new(GatePolicy::default(), &switch);
        let mut probes = 0;
        for _ in 0..3 {
            gate.decide(&key(4), || {
                probes += 1;
                Ok(true)
            })
            .unwrap();
        }
        assert_eq!(probes, 1);
        gate.decide(&key(2), || {
            probes += 1;
            Ok(true)
        })
        .unwrap();
        assert_eq!(probes, 2);
        assert_eq!(gate.decided(&key(2)), Some(GateOutcome::Exact));
        assert_eq!(gate.decided(&key(3)), None);
    }

    #[test]
    fn lines_have_fixed_wording() {
        let r = GateReport { key: key(4), outcome: GateOutcome::ExactWithoutWide, qmv_wide: false };
        assert!(r.message().starts_with(
            "speculative gate outcome=exact-without-qmv-wide model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide=off: "
        ));
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        assert_eq!(GatePolicy::parse(None, None).unwrap(), GatePolicy::default());
        let p = GatePolicy::parse(Some("1"), Some("wide")).unwrap();
        assert!(p.allow_inexact && p.test_inexact == TestInexact::Wide);
        let e = GatePolicy::parse(Some("yes"), None).unwrap_err().to_string();
        assert!(e.contains(ALLOW_INEXACT_ENV) && e.contains("accepted values are 1"), "{e}");
        let e = GatePolicy::parse(None, Some("sometimes")).unwrap_err().to_string();
        assert!(e.contains(TEST_INEXACT_ENV) && e.contains("always or wide"), "{e}");
    }
}
