//! The arms and how a boot proves which one it is: the `--order` parsers (`0`/`1` for the
//! sweep, `A`/`B` for the mixed mode, as many of each), the ABBA pairing, the variables
//! that would change an arm and are refused when inherited, and the arm-identity checks
//! against the server's contracted `kernel configuration:` start-up line and, for the
//! mixed mode's arms, the exactness gate's `speculative gate outcome=...` line. An A/A
//! run's two slots are arms of their own, `A1` and `A2`, each running the one shared
//! environment, so every record names the slot and the environment it really ran.

use std::fmt;

/// One arm of the experiment. Recorded (boots.jsonl, passes.jsonl, log names, tables)
/// by [`Arm::as_str`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Arm {
    /// Sweep: `KILN_QMV_WIDE=0`, the pin (one qmv pass per row).
    Narrow,
    /// Sweep: `KILN_QMV_WIDE=1`, qmv_wide for 2 <= M < the batch limit.
    Wide,
    /// Mixed: the default environment; the gate may drop `qmv_wide` process-wide.
    A,
    /// Mixed: `KILN_QMV_WIDE=1 KILN_SPEC_ALLOW_INEXACT=1`, the fast-kernel recipe.
    B,
    /// A/A: the slot each ABBA block opens with, running the shared environment.
    A1(AaEnv),
    /// A/A: the other slot, running the same environment.
    A2(AaEnv),
}

/// The environment both slots of an A/A run share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AaEnv {
    /// The sweep's wide arm.
    Wide,
    /// The mixed mode's arm A.
    A,
}

impl AaEnv {
    /// The arm whose environment and identity both slots take.
    pub fn arm(self) -> Arm {
        match self {
            AaEnv::Wide => Arm::Wide,
            AaEnv::A => Arm::A,
        }
    }
}

impl serde::Serialize for Arm {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl Arm {
    /// The arm whose environment a boot of this one runs: itself, or an A/A slot's shared
    /// environment.
    pub fn runs(self) -> Arm {
        match self {
            Arm::A1(e) | Arm::A2(e) => e.arm(),
            a => a,
        }
    }

    /// The variables a boot of this arm is started with.
    pub fn env(self) -> Vec<(String, String)> {
        let v = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        match self {
            Arm::Narrow => v(&[("KILN_QMV_WIDE", "0")]),
            Arm::Wide => v(&[("KILN_QMV_WIDE", "1")]),
            Arm::A => Vec::new(),
            Arm::B => v(&[("KILN_QMV_WIDE", "1"), ("KILN_SPEC_ALLOW_INEXACT", "1")]),
            Arm::A1(e) | Arm::A2(e) => e.arm().env(),
        }
    }

    /// The arm's token in `--order`: `0`, `1`, `A` or `B`; an A/A slot's `A1` or `A2`.
    pub fn token(self) -> &'static str {
        match self {
            Arm::Narrow => "0",
            Arm::Wide => "1",
            Arm::A => "A",
            Arm::B => "B",
            Arm::A1(_) | Arm::A2(_) => self.as_str(),
        }
    }

    /// `narrow`, `wide`, `A`, `B`, or an A/A slot's `A1` or `A2`.
    pub fn as_str(self) -> &'static str {
        match self {
            Arm::Narrow => "narrow",
            Arm::Wide => "wide",
            Arm::A => "A",
            Arm::B => "B",
            Arm::A1(_) => "A1",
            Arm::A2(_) => "A2",
        }
    }

    /// What the server's kernel line must say: `qmv_wide=` and `qmv_wide_pinned=`.
    pub fn kernel(self) -> (&'static str, &'static str) {
        match self.runs() {
            Arm::Narrow => ("off", "yes"),
            Arm::A => ("on", "no"),
            _ => ("on", "yes"),
        }
    }

    /// Whether a boot of this arm must log the exactness gate's line (the mixed arms).
    pub fn expects_gate(self) -> bool {
        matches!(self.runs(), Arm::A | Arm::B)
    }
}

impl fmt::Display for Arm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.runs() != *self {
            return write!(f, "{}, A/A: {}", self.as_str(), self.runs());
        }
        let env: Vec<String> = self.env().iter().map(|(k, v)| format!("{k}={v}")).collect();
        if env.is_empty() {
            write!(f, "{} (default environment)", self.as_str())
        } else {
            write!(f, "{} ({})", self.as_str(), env.join(" "))
        }
    }
}

/// The boot order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Order(pub Vec<Arm>);

/// The sweep's default order: two ABBA blocks, wide first, as in the seed measurement.
pub const DEFAULT_ORDER: &str = "1 0 0 1 0 1 1 0";

/// The mixed mode's default order.
pub const DEFAULT_MIXED_ORDER: &str = "A B B A";

/// Parses the sweep's `--order`: tokens `1` (wide) and `0` (narrow), space- or
/// comma-separated, as many of each so every boot has a partner.
pub fn order_arg(s: &str) -> Result<Order, String> {
    parse_order(s, [("1", Arm::Wide), ("0", Arm::Narrow)], "1 (wide) or 0 (narrow)", DEFAULT_ORDER)
}

/// Parses the mixed mode's `--order`: letters `A` (default environment) and `B`
/// (`KILN_QMV_WIDE=1 KILN_SPEC_ALLOW_INEXACT=1`), as many of each.
pub fn mixed_order_arg(s: &str) -> Result<Order, String> {
    parse_order(
        s,
        [("A", Arm::A), ("B", Arm::B)],
        "A (default environment) or B (KILN_QMV_WIDE=1 KILN_SPEC_ALLOW_INEXACT=1)",
        DEFAULT_MIXED_ORDER,
    )
}

fn parse_order(s: &str, tokens: [(&str, Arm); 2], accepted: &str, example: &str) -> Result<Order, String> {
    let mut arms = Vec::new();
    for tok in s.split([' ', ',']).filter(|t| !t.is_empty()) {
        match tokens.iter().find(|(t, _)| *t == tok) {
            Some(&(_, arm)) => arms.push(arm),
            None => return Err(format!("{tok:?} is not an arm: expected {accepted}, e.g. \"{example}\"")),
        }
    }
    let first = arms.iter().filter(|a| **a == tokens[0].1).count();
    let second = arms.len() - first;
    if first == 0 || second == 0 {
        return Err(format!(
            "{s:?} lacks an arm: expected at least one {} and one {}, e.g. \"{example}\"",
            tokens[0].0, tokens[1].0
        ));
    }
    if first != second {
        return Err(format!(
            "{s:?} has {first} {} and {second} {} boots: expected as many of each, e.g. \"{example}\"",
            tokens[0].1.as_str(),
            tokens[1].1.as_str()
        ));
    }
    Ok(Order(arms))
}

impl Order {
    /// The ABBA pairs as boot indices `(num, den)`: the k-th `num` boot with the k-th
    /// `den` boot. In `1 0 0 1 0 1 1 0` with (narrow, wide) these are the neighbours.
    pub fn pairs_of(&self, num: Arm, den: Arm) -> Vec<(usize, usize)> {
        let idx = |arm: Arm| self.0.iter().enumerate().filter(move |(_, a)| **a == arm).map(|(i, _)| i);
        idx(num).zip(idx(den)).collect()
    }

    /// The order as typed: `1 0 0 1`, `A B B A`.
    pub fn tokens(&self) -> String {
        self.0.iter().map(|a| a.token()).collect::<Vec<_>>().join(" ")
    }

    /// This order with `from`'s arms renamed to `to`'s, slot for slot: an A/A run's order
    /// from the one typed.
    pub fn renamed(&self, from: [Arm; 2], to: [Arm; 2]) -> Order {
        Order(
            self.0
                .iter()
                .map(|&a| {
                    if a == from[0] {
                        to[0]
                    } else if a == from[1] {
                        to[1]
                    } else {
                        a
                    }
                })
                .collect(),
        )
    }
}

/// Variables that would change what a sweep arm runs. The driver sets `KILN_QMV_WIDE`
/// itself for each boot; one inherited from the shell would silently collapse the arms.
pub const ARM_VARS: [&str; 1] = ["KILN_QMV_WIDE"];

/// The same for the mixed mode: arm A is the default environment, so anything the gate
/// or the switch reads would change it.
pub const MIXED_ARM_VARS: [&str; 3] = ["KILN_QMV_WIDE", "KILN_SPEC_ALLOW_INEXACT", "KILN_SPEC_TEST_INEXACT"];

/// The inherited arm-changing variables among `vars`, `NAME=value`.
pub fn inherited_arm_vars(vars: &[&str], get: impl Fn(&str) -> Option<String>) -> Vec<String> {
    vars.iter().filter_map(|k| get(k).map(|v| format!("{k}={v}"))).collect()
}

/// The server's `kernel configuration:` line, parsed.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KernelLine {
    /// `isa=`.
    pub isa: String,
    /// `threads=`.
    pub threads: String,
    /// `qmv_wide=`: on or off.
    pub qmv_wide: String,
    /// `qmv_wide_pinned=`: yes or no.
    pub pinned: String,
}

/// Finds and parses the kernel line in a server log (plain or JSON lines).
pub fn kernel_line(log: &str) -> Option<KernelLine> {
    let k = kiln_protocol::KernelConfigLine::find(log)?;
    Some(KernelLine {
        isa: k.isa,
        threads: k.threads.to_string(),
        qmv_wide: on_off(k.qmv_wide),
        pinned: if k.qmv_wide_pinned { "yes" } else { "no" }.to_string(),
    })
}

fn on_off(b: bool) -> String {
    if b { "on" } else { "off" }.to_string()
}

/// Checks a boot's log against its arm's kernel line: the switch in the arm's state, and
/// pinned by the operator exactly when the arm sets `KILN_QMV_WIDE`.
pub fn check_identity(arm: Arm, log: &str) -> Result<KernelLine, String> {
    let Some(k) = kernel_line(log) else {
        return Err("the server logged no `kernel configuration:` line, so its arm cannot be verified".into());
    };
    let (wide, pinned) = arm.kernel();
    if k.qmv_wide != wide {
        return Err(format!(
            "arm identity: the {} boot reports qmv_wide={} (expected {wide})",
            arm.as_str(),
            k.qmv_wide,
        ));
    }
    if k.pinned != pinned {
        let why = if pinned == "yes" {
            "the driver pins this arm"
        } else {
            "this arm is the default environment, so KILN_QMV_WIDE must be unset"
        };
        return Err(format!(
            "arm identity: the {} boot reports qmv_wide_pinned={} (expected {pinned}: {why})",
            arm.as_str(),
            k.pinned
        ));
    }
    Ok(k)
}

/// The exactness gate's line, parsed: `speculative gate outcome=O model=M k=K
/// kv_dtype=D qmv_wide=on|off: ...`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GateLine {
    /// `exact`, `exact-without-qmv-wide`, `inexact-allowed`, `inexact-declined` or
    /// `declined-pinned`.
    pub outcome: String,
    /// `model=`.
    pub model: String,
    /// `k=`.
    pub k: String,
    /// `kv_dtype=`.
    pub kv_dtype: String,
    /// `qmv_wide=`: the process switch after the decision.
    pub qmv_wide: String,
}

/// Every gate line in a server log (plain or JSON lines), in order.
pub fn gate_lines(log: &str) -> Vec<GateLine> {
    kiln_protocol::SpecGateLine::all(log)
        .into_iter()
        .map(|g| GateLine {
            outcome: g.outcome.to_string(),
            model: g.model,
            k: g.k.to_string(),
            kv_dtype: g.kv_dtype.to_string(),
            qmv_wide: on_off(g.qmv_wide),
        })
        .collect()
}

/// What a mixed arm's gate line may say: `(outcome, qmv_wide)`.
fn accepted_gates(arm: Arm) -> &'static [(&'static str, &'static str)] {
    match arm.runs() {
        // The default environment: exact as is, or exact once the gate dropped the wide
        // kernel for the whole process (the pin whose collateral arm A carries).
        Arm::A => &[("exact", "on"), ("exact-without-qmv-wide", "off")],
        // The fast-kernel recipe: the wide kernel stays on and the stream speculates.
        Arm::B => &[("exact", "on"), ("inexact-allowed", "on")],
        Arm::Narrow | Arm::Wide | Arm::A1(_) | Arm::A2(_) => &[],
    }
}

/// Checks a mixed boot's gate line (logged at the first verify, so after the warm-up
/// window) against its arm. Arms that expect no gate pass with `None`.
pub fn check_gate(arm: Arm, log: &str) -> Result<Option<GateLine>, String> {
    if !arm.expects_gate() {
        return Ok(None);
    }
    let lines = gate_lines(log);
    let Some(g) = lines.first() else {
        return Err(format!(
            "arm identity: the {} boot logged no `speculative gate` line after the warm-up window: the speculative stream never verified, so its arm cannot be verified",
            arm.as_str()
        ));
    };
    let accepted = accepted_gates(arm);
    for l in &lines {
        if !accepted.contains(&(l.outcome.as_str(), l.qmv_wide.as_str())) {
            let want: Vec<String> =
                accepted.iter().map(|(o, w)| format!("outcome={o} qmv_wide={w}")).collect();
            return Err(format!(
                "arm identity: the {} boot's gate says outcome={} qmv_wide={} (expected {})",
                arm.as_str(),
                l.outcome,
                l.qmv_wide,
                want.join(" or ")
            ));
        }
    }
    // A server that logs switch changes (`kiln serve` does) must end where the gate says.
    let last = lines.last().unwrap_or(g);
    if let Some(now) = switch_changes(log).last()
        && *now != last.qmv_wide
    {
        return Err(format!(
            "arm identity: the {} boot's gate says qmv_wide={} but its last `kernel configuration changed:` line says qmv_wide={now}",
            arm.as_str(),
            last.qmv_wide
        ));
    }
    Ok(Some(g.clone()))
}

/// The `qmv_wide=` of every `kernel configuration changed:` line, in order.
pub fn switch_changes(log: &str) -> Vec<String> {
    kiln_protocol::KernelChangedLine::all(log).into_iter().map(|c| on_off(c.qmv_wide)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_take_only_balanced_zeros_and_ones() {
        let o = order_arg(DEFAULT_ORDER).unwrap();
        assert_eq!(o.0.len(), 8);
        assert_eq!(o.0[0], Arm::Wide);
        assert_eq!(o.pairs_of(Arm::Narrow, Arm::Wide), vec![(1, 0), (2, 3), (4, 5), (7, 6)]);
        assert_eq!(order_arg("1,0").unwrap().pairs_of(Arm::Narrow, Arm::Wide), vec![(1, 0)]);
        assert_eq!(
            order_arg("1 2").unwrap_err(),
            "\"2\" is not an arm: expected 1 (wide) or 0 (narrow), e.g. \"1 0 0 1 0 1 1 0\""
        );
        assert!(order_arg("1 1").unwrap_err().contains("lacks an arm"));
        assert!(order_arg("").unwrap_err().contains("lacks an arm"));
        assert!(order_arg("1 0 0").unwrap_err().contains("has 1 wide and 2 narrow boots"));
        assert!(order_arg("../../x").is_err());
    }

    #[test]
    fn the_kernel_line_decides_the_arm() {
        let log = "2026 INFO kiln_serve: kernel configuration: isa=avx2 threads=2 qmv_wide=off qmv_wide_pinned=yes\n";
        let k = check_identity(Arm::Narrow, log).unwrap();
        assert_eq!((k.isa.as_str(), k.threads.as_str()), ("avx2", "2"));
        assert_eq!(
            check_identity(Arm::Wide, log).unwrap_err(),
            "arm identity: the wide boot reports qmv_wide=off (expected on)"
        );
        let unpinned = log.replace("pinned=yes", "pinned=no");
        assert!(check_identity(Arm::Narrow, &unpinned).unwrap_err().contains("qmv_wide_pinned=no"));
        assert!(
            check_identity(Arm::Wide, "listening on http://127.0.0.1:1\n")
                .unwrap_err()
                .contains("no `kernel")
        );
        let json = r#"{"level":"INFO","fields":{"message":"kernel configuration: isa=scalar threads=4 qmv_wide=on qmv_wide_pinned=yes"}}"#;
        assert_eq!(check_identity(Arm::Wide, json).unwrap().threads, "4");
    }

    #[test]
    fn inherited_arm_variables_are_found() {
        let env = |k: &str| (k == "KILN_QMV_WIDE").then(|| "0".to_string());
        assert_eq!(inherited_arm_vars(&ARM_VARS, env), vec!["KILN_QMV_WIDE=0"]);
        assert!(inherited_arm_vars(&ARM_VARS, |_| None).is_empty());
        let env = |k: &str| (k == "KILN_SPEC_ALLOW_INEXACT").then(|| "1".to_string());
        assert!(inherited_arm_vars(&ARM_VARS, env).is_empty(), "the sweep's arms ignore the gate");
        assert_eq!(inherited_arm_vars(&MIXED_ARM_VARS, env), vec!["KILN_SPEC_ALLOW_INEXACT=1"]);
    }

    #[test]
    fn mixed_orders_take_only_balanced_as_and_bs() {
        let o = mixed_order_arg(DEFAULT_MIXED_ORDER).unwrap();
        assert_eq!(o.0, vec![Arm::A, Arm::B, Arm::B, Arm::A]);
        assert_eq!(o.pairs_of(Arm::B, Arm::A), vec![(1, 0), (2, 3)]);
        assert_eq!(o.tokens(), "A B B A");
        assert_eq!(mixed_order_arg("B,A").unwrap().0, vec![Arm::B, Arm::A]);
        assert_eq!(
            mixed_order_arg("A 1").unwrap_err(),
            "\"1\" is not an arm: expected A (default environment) or B (KILN_QMV_WIDE=1 KILN_SPEC_ALLOW_INEXACT=1), e.g. \"A B B A\""
        );
        assert!(mixed_order_arg("a b").unwrap_err().contains("\"a\" is not an arm"));
        assert!(
            mixed_order_arg("A A").unwrap_err().contains("lacks an arm: expected at least one A and one B")
        );
        assert!(mixed_order_arg("A B B").unwrap_err().contains("has 1 A and 2 B boots"));
        assert!(order_arg("A B").is_err(), "the sweep keeps its own syntax");
        assert!(mixed_order_arg("1 0").is_err());
        assert_eq!(Arm::B.to_string(), "B (KILN_QMV_WIDE=1 KILN_SPEC_ALLOW_INEXACT=1)");
        assert_eq!(Arm::A.to_string(), "A (default environment)");
    }

    /// The gate's five lines as `kiln serve` logs them (docs/environment-variables.md).
    fn gate_log(outcome: &str, wide: &str) -> String {
        format!(
            "2026-11-30T20:00:00Z  WARN kiln_serve::scheduler: speculative gate outcome={outcome} model=synthetic:tiny k=4 kv_dtype=f16 qmv_wide={wide}: verify block differs from the single-token chain; KILN_SPEC_ALLOW_INEXACT=1 allows it; speculative decoding on\n"
        )
    }

    #[test]
    fn every_gate_outcome_is_checked_against_both_mixed_arms() {
        // (outcome, qmv_wide after, A accepts, B accepts)
        let table = [
            ("exact", "on", true, true),
            ("exact", "off", false, false),
            ("exact-without-qmv-wide", "off", true, false),
            ("inexact-allowed", "on", false, true),
            ("inexact-allowed", "off", false, false),
            ("inexact-declined", "on", false, false),
            ("inexact-declined", "off", false, false),
            ("declined-pinned", "on", false, false),
        ];
        for (outcome, wide, a, b) in table {
            let log = gate_log(outcome, wide);
            for (arm, ok) in [(Arm::A, a), (Arm::B, b)] {
                let got = check_gate(arm, &log);
                assert_eq!(got.is_ok(), ok, "{arm} with outcome={outcome} qmv_wide={wide}: {got:?}");
                match got {
                    Ok(g) => {
                        let g = g.unwrap();
                        assert_eq!((g.outcome.as_str(), g.qmv_wide.as_str()), (outcome, wide));
                        assert_eq!((g.model.as_str(), g.k.as_str(), g.kv_dtype.as_str()), ("synthetic:tiny", "4", "f16"));
                    }
                    Err(e) => assert!(
                        e.starts_with(&format!(
                            "arm identity: the {} boot's gate says outcome={outcome} qmv_wide={wide} (expected ",
                            arm.as_str()
                        )),
                        "{e}"
                    ),
                }
            }
        }
        // The switch change the server logs after the gate must agree with it.
        let dropped = gate_log("exact-without-qmv-wide", "off")
            + "WARN kiln_serve::scheduler: kernel configuration changed: qmv_wide=off qmv_wide_pinned=no: the speculative gate switched qmv_wide for the whole process\n";
        assert_eq!(check_gate(Arm::A, &dropped).unwrap().unwrap().qmv_wide, "off");
        let contradicted = gate_log("exact", "on")
            + "WARN x: kernel configuration changed: qmv_wide=off qmv_wide_pinned=no: y\n";
        assert!(check_gate(Arm::B, &contradicted).unwrap_err().contains("changed:` line says qmv_wide=off"));
        let none = "INFO kiln_serve: listening on http://127.0.0.1:1\n";
        assert!(check_gate(Arm::A, none).unwrap_err().contains("logged no `speculative gate` line"));
        assert_eq!(check_gate(Arm::Wide, none), Ok(None), "sweep arms expect no gate");
        // JSON logs carry the same message.
        let json = r#"{"level":"INFO","fields":{"message":"speculative gate outcome=exact model=m k=2 kv_dtype=f32 qmv_wide=on: verify block matches the single-token chain; speculative decoding on"}}"#;
        assert_eq!(check_gate(Arm::B, json).unwrap().unwrap().k, "2");
    }

    #[test]
    fn aa_slots_are_named_for_themselves_and_run_the_shared_environment() {
        let (a1, a2) = (Arm::A1(AaEnv::Wide), Arm::A2(AaEnv::Wide));
        assert_eq!((a1.as_str(), a2.as_str()), ("A1", "A2"));
        assert_eq!(serde_json::to_string(&a2).unwrap(), "\"A2\"");
        assert_eq!(serde_json::to_string(&Arm::Narrow).unwrap(), "\"narrow\"");
        assert_eq!((a1.env(), a2.env()), (Arm::Wide.env(), Arm::Wide.env()));
        assert_eq!((a2.runs(), a2.kernel()), (Arm::Wide, ("on", "yes")));
        assert_eq!(a2.to_string(), "A2, A/A: wide (KILN_QMV_WIDE=1)");
        let narrow_line =
            "INFO kiln_serve: kernel configuration: isa=avx2 threads=2 qmv_wide=off qmv_wide_pinned=yes\n";
        assert_eq!(
            check_identity(a2, narrow_line).unwrap_err(),
            "arm identity: the A2 boot reports qmv_wide=off (expected on)"
        );
        let order = order_arg("1 0 0 1").unwrap().renamed([Arm::Wide, Arm::Narrow], [a1, a2]);
        assert_eq!(order.tokens(), "A1 A2 A2 A1");
        let mixed = Arm::A2(AaEnv::A);
        assert!(mixed.expects_gate());
        assert!(check_gate(mixed, &gate_log("exact-without-qmv-wide", "off")).is_ok(), "arm A's gates");
        assert!(check_gate(mixed, &gate_log("inexact-allowed", "on")).is_err());
    }

    #[test]
    fn mixed_kernel_lines_say_whether_the_switch_is_pinned() {
        let line = |pinned: &str| {
            format!(
                "INFO kiln_serve: kernel configuration: isa=avx2 threads=2 qmv_wide=on qmv_wide_pinned={pinned}\n"
            )
        };
        assert!(check_identity(Arm::A, &line("no")).is_ok());
        assert!(check_identity(Arm::B, &line("yes")).is_ok());
        assert!(
            check_identity(Arm::A, &line("yes")).unwrap_err().contains("KILN_QMV_WIDE must be unset"),
            "an A boot must run the default environment"
        );
        assert!(check_identity(Arm::B, &line("no")).unwrap_err().contains("qmv_wide_pinned=no"));
    }
}
