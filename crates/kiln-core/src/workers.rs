//! Keeping rayon's workers looking for work between the parallel regions of one step.
//!
//! A decode step is a chain of short parallel regions (q|k|v, o_proj, gate|up, down_proj
//! per layer, then the head) separated by serial work on the driving thread (norms,
//! RoPE, attention bookkeeping, the residual adds). Left to rayon's own idle policy, a
//! worker that finds nothing to steal yields to the OS about 32 times and then sleeps on a
//! condition variable, and the next region pays a futex wake-up per sleeping worker
//! before it can split. [`keep_warm`], called by the driver at the start of each forward,
//! runs a spinner on every other worker of the pool instead: it takes work through
//! [`rayon::yield_now`] (so a region's tasks are stolen without a wake-up) and otherwise
//! spins with [`std::hint::spin_loop`].
//!
//! The spin is bounded: a spinner returns to rayon, which parks the thread as usual,
//! once neither the driver nor any task has touched it for the spin budget
//! (`KILN_SPIN_US`, [`DEFAULT_SPIN_US`] microseconds by default; `0` turns spinning off).
//! So a server between requests, or a command done with its last step, keeps its cores
//! busy for at most one budget after the last forward. Spinning is also off on one-thread
//! pools, when the driver is not a rayon worker, and when the pool has more threads than
//! the process has CPUs (a spinner would then take a core a working thread needs).
//!
//! Nothing here changes which tasks run or what they compute, only which thread waits
//! how, so outputs are the same bits with or without it.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The environment variable holding the spin budget in microseconds.
pub const SPIN_ENV: &str = "KILN_SPIN_US";

/// The spin budget when [`SPIN_ENV`] is unset: long enough to span a step's serial gaps
/// and the sampling between two steps, short enough that an idle process parks within a
/// millisecond.
pub const DEFAULT_SPIN_US: u64 = 500;

/// The largest budget accepted, one second: anything longer is a busy loop, not a spin.
pub const MAX_SPIN_US: u64 = 1_000_000;

/// `spin_loop` hints between two looks for work: a few hundred cycles, so a spinner
/// reacts to a new region within a fraction of a microsecond without hammering the
/// other workers' deques.
const SPINS_PER_LOOK: usize = 8;

/// How long a worker keeps looking for work after the last activity it saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinBudget(Duration);

impl SpinBudget {
    /// No spinning: rayon's own idle policy.
    pub const OFF: SpinBudget = SpinBudget(Duration::ZERO);

    /// A budget of `us` microseconds.
    ///
    /// # Panics
    /// When `us` is over [`MAX_SPIN_US`].
    pub fn from_micros(us: u64) -> SpinBudget {
        assert!(us <= MAX_SPIN_US, "spin budget {us} us is over {MAX_SPIN_US}");
        SpinBudget(Duration::from_micros(us))
    }

    /// Parses a budget in whole microseconds, `0` to [`MAX_SPIN_US`]; an empty value is
    /// the default.
    pub fn parse(text: &str) -> Result<SpinBudget, String> {
        let t = text.trim();
        if t.is_empty() {
            return Ok(SpinBudget::from_micros(DEFAULT_SPIN_US));
        }
        match t.parse::<u64>() {
            Ok(us) if us <= MAX_SPIN_US => Ok(SpinBudget::from_micros(us)),
            _ => Err(format!(
                "invalid {SPIN_ENV} {t:?}: accepted values are whole microseconds from 0 (no spinning) \
                 to {MAX_SPIN_US}"
            )),
        }
    }

    /// The budget [`SPIN_ENV`] asks for, or the default when it is unset.
    pub fn from_env() -> Result<SpinBudget, String> {
        let accepted = format!("whole microseconds from 0 to {MAX_SPIN_US}");
        Self::parse(&crate::env::setting_env(SPIN_ENV, &accepted)?)
    }

    /// The budget as a duration.
    pub fn duration(self) -> Duration {
        self.0
    }
}

/// The process's budget: [`SPIN_ENV`] read once (an invalid value, which the CLI refuses
/// before any forward, falls back to the default here).
pub fn spin_budget() -> SpinBudget {
    static BUDGET: OnceLock<SpinBudget> = OnceLock::new();
    *BUDGET.get_or_init(|| SpinBudget::from_env().unwrap_or(SpinBudget::from_micros(DEFAULT_SPIN_US)))
}

/// What one driving thread shares with the spinners it started.
#[derive(Debug)]
pub struct Warmth {
    /// When this state was made; activity is measured from here in nanoseconds.
    origin: Instant,
    /// Nanoseconds after `origin` of the last activity: a forward starting, or a task a
    /// spinner ran.
    last: AtomicU64,
    /// Spinners queued on a worker that have not started yet.
    pending: AtomicUsize,
    /// Spinners running.
    spinning: AtomicUsize,
    /// Workers other than the driver in the pool the spinners run on.
    others: usize,
    /// The budget the spinners were started with.
    budget: Duration,
}

impl Warmth {
    fn new(others: usize, budget: Duration) -> Warmth {
        Warmth {
            origin: Instant::now(),
            last: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            spinning: AtomicUsize::new(0),
            others,
            budget,
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn touch(&self) {
        self.last.store(self.now(), Ordering::SeqCst);
    }

    fn idle(&self) -> bool {
        let last = self.last.load(Ordering::SeqCst);
        self.now().saturating_sub(last) > u64::try_from(self.budget.as_nanos()).unwrap_or(u64::MAX)
    }

    /// Spinners running now (workers that will not park until the budget runs out).
    pub fn spinning(&self) -> usize {
        self.spinning.load(Ordering::SeqCst)
    }

    /// Spinners queued and not yet started.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }
}

thread_local! {
    /// The driver's state, for the pool this thread works in (a rayon worker never moves
    /// between pools).
    static DRIVER: RefCell<Option<Arc<Warmth>>> = const { RefCell::new(None) };
    /// Whether this worker is inside a spinner already: a second one queued on it returns
    /// at once instead of nesting.
    static SPINNING: Cell<bool> = const { Cell::new(false) };
}

/// Keeps the other workers of the current rayon pool looking for work for the next
/// [`spin_budget`]: the driver of a forward calls it once at the start. Returns the
/// driver's state (for tests), or `None` when spinning is off here: a one-thread pool,
/// a caller outside any pool, a budget of 0, or more threads than CPUs.
pub fn keep_warm() -> Option<Arc<Warmth>> {
    keep_warm_with(spin_budget())
}

/// [`keep_warm`] with an explicit budget.
pub fn keep_warm_with(budget: SpinBudget) -> Option<Arc<Warmth>> {
    let me = rayon::current_thread_index()?;
    let threads = rayon::current_num_threads();
    if threads < 2 || budget.duration().is_zero() || threads > cpus() {
        return None;
    }
    let warmth = DRIVER.with(|d| {
        let mut d = d.borrow_mut();
        match &*d {
            Some(w) if w.others == threads - 1 && w.budget == budget.duration() => w.clone(),
            _ => {
                let w = Arc::new(Warmth::new(threads - 1, budget.duration()));
                *d = Some(w.clone());
                w
            }
        }
    });
    // Touch first, count second: a spinner counts itself out first and reads the
    // activity second (both sequentially consistent), so either this call sees it gone
    // and starts another, or it sees this touch and keeps spinning.
    warmth.touch();
    if warmth.spinning() + warmth.pending() < warmth.others {
        warmth.pending.fetch_add(warmth.others, Ordering::SeqCst);
        let w = warmth.clone();
        rayon::spawn_broadcast(move |ctx| {
            if ctx.index() != me {
                w.pending.fetch_sub(1, Ordering::SeqCst);
                spin(&w);
            }
        });
    }
    Some(warmth)
}

/// The CPUs this process may run on.
fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// One worker's spinner: run whatever work appears, spin between looks, return (and let
/// rayon park the thread) once the state has been idle for its budget.
fn spin(w: &Warmth) {
    // A driver reaches queued jobs whenever it waits inside its own forward: spinning
    // there for another driver would hold its forward up for as long as the other one
    // keeps running, so a thread that drives forwards never spins for anyone.
    if DRIVER.with(|d| d.borrow().is_some()) || SPINNING.with(|s| s.replace(true)) {
        return;
    }
    w.spinning.fetch_add(1, Ordering::SeqCst);
    loop {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => w.touch(),
            Some(rayon::Yield::Idle) => {
                if w.idle() {
                    w.spinning.fetch_sub(1, Ordering::SeqCst);
                    if w.idle() {
                        break;
                    }
                    // A forward started between the two looks and may have counted
                    // this spinner as running: keep that promise.
                    w.spinning.fetch_add(1, Ordering::SeqCst);
                }
                for _ in 0..SPINS_PER_LOOK {
                    std::hint::spin_loop();
                }
            }
            None => {
                w.spinning.fetch_sub(1, Ordering::SeqCst);
                break;
            }
        }
    }
    SPINNING.with(|s| s.set(false));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
    }

    /// Waits (yielding the CPU) until `done` holds; a worker that never parks makes the
    /// test fail after a minute, whatever the machine's load.
    fn eventually(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(Instant::now() < deadline, "{what} never happened");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn parses_budgets_and_names_bad_ones() {
        assert_eq!(SpinBudget::parse("0"), Ok(SpinBudget::OFF));
        assert_eq!(SpinBudget::parse(" 250 "), Ok(SpinBudget::from_micros(250)));
        assert_eq!(SpinBudget::parse(""), Ok(SpinBudget::from_micros(DEFAULT_SPIN_US)));
        assert_eq!(SpinBudget::parse("1000000"), Ok(SpinBudget::from_micros(MAX_SPIN_US)));
        for bad in ["-1", "1.5", "fast", "1000001", "18446744073709551616"] {
            let msg = SpinBudget::parse(bad).unwrap_err();
            assert!(msg.starts_with("invalid KILN_SPIN_US") && msg.contains("accepted values"), "{msg}");
        }
    }

    #[test]
    fn spinners_run_tasks_and_then_park() {
        if cpus() < 2 {
            return;
        }
        let p = pool(2);
        let budget = SpinBudget::from_micros(2_000);
        let (w, sum) = p.install(|| {
            let w = keep_warm_with(budget).expect("a two-thread pool on two CPUs spins");
            // The region's tasks are found by the spinner or the driver; every one runs once.
            use rayon::prelude::*;
            let sum: u64 = (0..10_000u64).into_par_iter().map(|i| i * 2).sum();
            (w, sum)
        });
        assert_eq!(sum, 10_000 * 9_999);
        assert!(w.spinning() + w.pending() <= 1, "one other worker, one spinner at most");
        // Nobody touches the state any more: the spinner must give up and park.
        eventually("the spinner parking", || w.spinning() == 0 && w.pending() == 0);
    }

    #[test]
    fn a_second_forward_reuses_the_running_spinner() {
        if cpus() < 2 {
            return;
        }
        let p = pool(2);
        p.install(|| {
            let a = keep_warm_with(SpinBudget::from_micros(MAX_SPIN_US)).unwrap();
            eventually("the spinner starting", || a.spinning() == 1);
            let b = keep_warm_with(SpinBudget::from_micros(MAX_SPIN_US)).unwrap();
            assert!(Arc::ptr_eq(&a, &b));
            assert_eq!((b.spinning(), b.pending()), (1, 0), "no second spinner is queued");
        });
    }

    #[test]
    fn no_spinning_where_it_cannot_help() {
        assert!(keep_warm_with(SpinBudget::from_micros(100)).is_none(), "outside any pool");
        assert!(pool(1).install(|| keep_warm_with(SpinBudget::from_micros(100))).is_none());
        assert!(pool(2).install(|| keep_warm_with(SpinBudget::OFF)).is_none());
        let over = cpus() + 1;
        assert!(pool(over).install(|| keep_warm_with(SpinBudget::from_micros(100))).is_none());
    }
}
