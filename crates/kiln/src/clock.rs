//! The wall clock a command's reported times are read from.

use std::time::{Duration, Instant};

/// Wall time since the start of `main` (the dynamic loader's work before it, well under a
/// millisecond, is not counted), less any span excluded on purpose such as the bandwidth
/// probe.
pub struct Clock {
    start: Instant,
    excluded: Duration,
}

impl Clock {
    pub fn start() -> Self {
        Clock { start: Instant::now(), excluded: Duration::ZERO }
    }

    /// Leaves `d` out of every later reading.
    pub fn exclude(&mut self, d: Duration) {
        self.excluded += d;
    }

    /// Milliseconds since the start, exclusions removed.
    pub fn ms(&self) -> f64 {
        self.start.elapsed().saturating_sub(self.excluded).as_secs_f64() * 1e3
    }
}
