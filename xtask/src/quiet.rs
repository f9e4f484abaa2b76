//! Whether the machine is quiet enough to measure on, checked rather than assumed: the
//! 1-minute load average and the CPU that processes other than the harness and its
//! children used over one second. Any sweep can ask before a cell, a boot or a pass.

use std::fs;
use std::thread;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::child::Shutdown;

/// One look at the machine.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Reading {
    /// The 1-minute load average.
    pub load1: f64,
    /// CPUs' worth of time used by other processes over the sample (1.0 = one core).
    pub others_cpus: f64,
}

/// When a reading counts as busy.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Other processes' CPU, in cores, above which the machine is busy.
    pub others_cpus: f64,
}

impl Reading {
    /// Whether this reading is over the limits, with the reason.
    pub fn busy(&self, limits: Limits) -> Option<String> {
        (self.others_cpus > limits.others_cpus).then(|| {
            format!(
                "other processes used {:.2} CPUs (limit {:.2}); load average {:.2}",
                self.others_cpus, limits.others_cpus, self.load1
            )
        })
    }
}

/// A measurement in progress: started before a pass, finished after it, so the pass is
/// judged by what ran beside it rather than by a separate, added second.
#[derive(Clone, Debug)]
pub struct Probe {
    busy0: u64,
    ours0: f64,
    pids: Vec<i32>,
    children: bool,
    t0: Instant,
}

impl Probe {
    /// Starts measuring; `also_ours` are processes that do not count as others (a server
    /// the harness booted).
    pub fn start(also_ours: &[i32]) -> Option<Probe> {
        Self::begin(also_ours, false)
    }

    /// Starts measuring around children the harness runs to completion (sweep cells):
    /// the CPU of every child reaped before [`Probe::finish`] counts as the harness's own.
    pub fn around_children() -> Option<Probe> {
        Self::begin(&[], true)
    }

    fn begin(also_ours: &[i32], children: bool) -> Option<Probe> {
        let (busy0, _) = stat_busy()?;
        let ours0 = ours(also_ours, children);
        Some(Probe { busy0, ours0, pids: also_ours.to_vec(), children, t0: Instant::now() })
    }

    /// What other processes used since the start, and the load average now.
    pub fn finish(&self) -> Option<Reading> {
        let (busy1, _) = stat_busy()?;
        let secs = self.t0.elapsed().as_secs_f64();
        if secs <= 0.0 {
            return None;
        }
        let total = busy1.saturating_sub(self.busy0) as f64 / clock_ticks();
        let others = (total - (ours(&self.pids, self.children) - self.ours0)).max(0.0) / secs;
        Some(Reading { load1: load1().unwrap_or(0.0), others_cpus: others })
    }
}

/// CPU seconds of this process (and of its reaped children, when `children`) and of
/// `pids`.
fn ours(pids: &[i32], children: bool) -> f64 {
    let own = if children { self_and_children_cpu_seconds() } else { self_cpu_seconds() };
    own.unwrap_or(0.0) + pids.iter().filter_map(|&p| process_cpu_seconds(p)).sum::<f64>()
}

/// Sleeps `d` unless a signal arrives; returns the signal if one came.
pub fn pause(shutdown: &Shutdown, d: Duration) -> Option<i32> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if let Some(sig) = shutdown.pending() {
            return Some(sig);
        }
        thread::sleep(Duration::from_millis(50).min(end.saturating_duration_since(Instant::now())));
    }
    shutdown.pending()
}

/// Samples the machine for a second; with `wait` (`--require-quiet`), keeps waiting while
/// it is busy, up to that long, saying so on stderr before `what`. Returns the last
/// reading and the signal if one came.
pub fn wait_quiet(
    limits: Limits,
    wait: Option<Duration>,
    shutdown: &Shutdown,
    ours: &[i32],
    what: &str,
) -> (Option<Reading>, Option<i32>) {
    let deadline = Instant::now() + wait.unwrap_or_default();
    let mut reading = sample(Duration::from_secs(1), ours);
    while let Some(r) = reading {
        let Some(why) = r.busy(limits) else { break };
        if wait.is_none() || Instant::now() >= deadline {
            break;
        }
        eprintln!("    waiting for quiet before {what}: {why}");
        if let Some(sig) = pause(shutdown, Duration::from_secs(2)) {
            return (reading, Some(sig));
        }
        reading = sample(Duration::from_secs(1), ours);
    }
    (reading, shutdown.pending())
}

/// Measures for `window`: total busy CPU from /proc/stat minus what this process and the
/// `also_ours` processes used.
pub fn sample(window: Duration, also_ours: &[i32]) -> Option<Reading> {
    let probe = Probe::start(also_ours)?;
    thread::sleep(window);
    probe.finish()
}

fn clock_ticks() -> f64 {
    // Linux reports /proc times in USER_HZ, 100 on every mainstream architecture.
    100.0
}

/// Busy and idle ticks summed over all CPUs, from the first line of /proc/stat.
fn stat_busy() -> Option<(u64, u64)> {
    let text = fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    if v.len() < 5 {
        return None;
    }
    // user nice system idle iowait irq softirq steal ...; guest is inside user.
    let idle = v[3] + v[4];
    let busy: u64 = v.iter().take(8).sum::<u64>() - idle;
    Some((busy, idle))
}

fn load1() -> Option<f64> {
    fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// User + system CPU seconds of process `pid` (all threads), from /proc/PID/stat.
pub fn process_cpu_seconds(pid: i32) -> Option<f64> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: fields start after ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3, utime 14 and stime 15 (1-based over the whole line).
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks())
}

/// This process's user + system CPU seconds, all threads.
pub fn self_cpu_seconds() -> Option<f64> {
    process_cpu_seconds(std::process::id() as i32)
}

/// This process's CPU seconds plus those of its children it has reaped (cutime and
/// cstime, fields 16 and 17 of /proc/self/stat).
fn self_and_children_cpu_seconds() -> Option<f64> {
    let text = fs::read_to_string("/proc/self/stat").ok()?;
    let f: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    let sum: f64 = (11..=14).map(|i| f.get(i)?.parse::<f64>().ok()).sum::<Option<f64>>()?;
    Some(sum / clock_ticks())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_is_busy_only_over_the_limit() {
        let r = Reading { load1: 3.0, others_cpus: 0.8 };
        assert_eq!(r.busy(Limits { others_cpus: 1.0 }), None);
        let why = r.busy(Limits { others_cpus: 0.5 }).unwrap();
        assert_eq!(why, "other processes used 0.80 CPUs (limit 0.50); load average 3.00");
    }

    #[test]
    fn this_process_has_a_cpu_time_and_the_machine_can_be_sampled() {
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        assert!(x > 0);
        assert!(self_cpu_seconds().unwrap() > 0.0);
        // A reaped child's CPU counts as ours around children, not as another process's.
        let probe = Probe::around_children().unwrap();
        let before = self_and_children_cpu_seconds().unwrap();
        let st = std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"])
            .status()
            .unwrap();
        assert!(st.success());
        assert!(self_and_children_cpu_seconds().unwrap() > before, "the child's time is counted");
        assert!(probe.finish().is_some());
        let r = sample(Duration::from_millis(100), &[]).unwrap();
        assert!(r.others_cpus >= 0.0 && r.load1 >= 0.0);
    }
}
