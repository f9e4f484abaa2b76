//! The two arms and how a boot proves which one it is: the `--order` parser (only 0 and
//! 1, as many of each), the ABBA pairing, the variables that would change an arm and are
//! refused when inherited, and the arm-identity check against the server's contracted
//! `kernel configuration:` start-up line.

use std::fmt;

/// One arm of the experiment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arm {
    /// `KILN_QMV_WIDE=0`: the pin (one qmv pass per row).
    Narrow,
    /// `KILN_QMV_WIDE=1`: qmv_wide for 2 <= M < the batch limit.
    Wide,
}

impl Arm {
    /// The value `KILN_QMV_WIDE` is pinned to.
    pub fn env_value(self) -> &'static str {
        match self {
            Arm::Narrow => "0",
            Arm::Wide => "1",
        }
    }

    /// `narrow` or `wide`.
    pub fn as_str(self) -> &'static str {
        match self {
            Arm::Narrow => "narrow",
            Arm::Wide => "wide",
        }
    }

    /// What the server's kernel line must say for this arm.
    pub fn qmv_wide(self) -> &'static str {
        match self {
            Arm::Narrow => "off",
            Arm::Wide => "on",
        }
    }
}

impl fmt::Display for Arm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (KILN_QMV_WIDE={})", self.as_str(), self.env_value())
    }
}

/// The boot order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Order(pub Vec<Arm>);

/// The default order: two ABBA blocks, wide first, as in the seed measurement.
pub const DEFAULT_ORDER: &str = "1 0 0 1 0 1 1 0";

/// Parses `--order`: tokens `1` (wide) and `0` (narrow), space- or comma-separated, as
/// many of each so every boot has a partner.
pub fn order_arg(s: &str) -> Result<Order, String> {
    let mut arms = Vec::new();
    for tok in s.split([' ', ',']).filter(|t| !t.is_empty()) {
        arms.push(match tok {
            "1" => Arm::Wide,
            "0" => Arm::Narrow,
            other => {
                return Err(format!(
                    "{other:?} is not an arm: expected 1 (wide) or 0 (narrow), e.g. \"{DEFAULT_ORDER}\""
                ));
            }
        });
    }
    let wide = arms.iter().filter(|a| **a == Arm::Wide).count();
    let narrow = arms.len() - wide;
    if wide == 0 || narrow == 0 {
        return Err(format!(
            "{s:?} lacks an arm: expected at least one 1 and one 0, e.g. \"{DEFAULT_ORDER}\""
        ));
    }
    if wide != narrow {
        return Err(format!(
            "{s:?} has {wide} wide and {narrow} narrow boots: expected as many of each, e.g. \"{DEFAULT_ORDER}\""
        ));
    }
    Ok(Order(arms))
}

impl Order {
    /// The ABBA pairs as boot indices `(narrow, wide)`: the k-th narrow boot with the
    /// k-th wide boot. In `1 0 0 1 0 1 1 0` these are the neighbours (0,1), (2,3), ...
    pub fn pairs(&self) -> Vec<(usize, usize)> {
        let idx = |arm: Arm| self.0.iter().enumerate().filter(move |(_, a)| **a == arm).map(|(i, _)| i);
        idx(Arm::Narrow).zip(idx(Arm::Wide)).collect()
    }
}

/// Variables that would change what an arm runs. The driver sets `KILN_QMV_WIDE` itself
/// for each boot; one inherited from the shell would silently collapse the two arms.
pub const ARM_VARS: [&str; 1] = ["KILN_QMV_WIDE"];

/// The inherited arm-changing variables, `NAME=value`.
pub fn inherited_arm_vars(get: impl Fn(&str) -> Option<String>) -> Vec<String> {
    ARM_VARS.iter().filter_map(|k| get(k).map(|v| format!("{k}={v}"))).collect()
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
    const KEY: &str = "kernel configuration: ";
    let line = log.lines().find(|l| l.contains(KEY))?;
    let rest = &line[line.find(KEY)? + KEY.len()..];
    // In a JSON log line the message ends at its closing quote.
    let rest = rest.split('"').next().unwrap_or(rest);
    let mut k = KernelLine {
        isa: String::new(),
        threads: String::new(),
        qmv_wide: String::new(),
        pinned: String::new(),
    };
    for pair in rest.split_whitespace() {
        let (key, value) = pair.split_once('=')?;
        let slot = match key {
            "isa" => &mut k.isa,
            "threads" => &mut k.threads,
            "qmv_wide" => &mut k.qmv_wide,
            "qmv_wide_pinned" => &mut k.pinned,
            _ => continue,
        };
        *slot = value.to_string();
    }
    (!k.qmv_wide.is_empty() && !k.pinned.is_empty()).then_some(k)
}

/// Checks a boot's log against its arm: the kernel line must be there, the switch in the
/// arm's state and pinned by the operator (the driver's own variable).
pub fn check_identity(arm: Arm, log: &str) -> Result<KernelLine, String> {
    let Some(k) = kernel_line(log) else {
        return Err("the server logged no `kernel configuration:` line, so its arm cannot be verified".into());
    };
    if k.qmv_wide != arm.qmv_wide() {
        return Err(format!(
            "arm identity: the {} boot reports qmv_wide={} (expected {})",
            arm.as_str(),
            k.qmv_wide,
            arm.qmv_wide()
        ));
    }
    if k.pinned != "yes" {
        return Err(format!(
            "arm identity: the {} boot reports qmv_wide_pinned={} (expected yes: the driver pins every arm)",
            arm.as_str(),
            k.pinned
        ));
    }
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_take_only_balanced_zeros_and_ones() {
        let o = order_arg(DEFAULT_ORDER).unwrap();
        assert_eq!(o.0.len(), 8);
        assert_eq!(o.0[0], Arm::Wide);
        assert_eq!(o.pairs(), vec![(1, 0), (2, 3), (4, 5), (7, 6)]);
        assert_eq!(order_arg("1,0").unwrap().pairs(), vec![(1, 0)]);
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
        assert_eq!(inherited_arm_vars(env), vec!["KILN_QMV_WIDE=0"]);
        assert!(inherited_arm_vars(|_| None).is_empty());
    }
}
