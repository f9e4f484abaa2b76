//! The server's counters, written by the scheduler and the handlers and read by
//! `GET /metrics` in the Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_core::MemoryPool;

/// Upper bounds of the batch-size histogram's buckets (decode rows per step).
pub const BATCH_BUCKETS: [u64; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// Every counter the server keeps.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    /// Forwards that decoded at least one sequence.
    pub decode_steps: AtomicU64,
    batch_buckets: [AtomicU64; BATCH_BUCKETS.len()],
    batch_sum: AtomicU64,
    batch_count: AtomicU64,
    /// Prompt tokens run through a forward (cached tokens are not counted).
    pub prefill_tokens: AtomicU64,
    /// Tokens sampled and sent.
    pub generated_tokens: AtomicU64,
    /// Requests that adopted a cached prefix.
    pub prompt_cache_hits: AtomicU64,
    /// Prompt tokens those requests did not have to prefill.
    pub prompt_cache_hit_tokens: AtomicU64,
    /// Bytes the prompt cache holds.
    pub prompt_cache_bytes: AtomicU64,
    /// Requests waiting for a slot.
    pub queue_depth: AtomicU64,
    /// Slots holding a request.
    pub active_slots: AtomicU64,
    /// Nanoseconds of scheduler steps, forward included.
    pub step_nanos: AtomicU64,
    /// Nanoseconds inside the forward.
    pub forward_nanos: AtomicU64,
    /// Tokens drafted and checked by a speculative verify.
    pub spec_drafted_tokens: AtomicU64,
    /// Of those, tokens accepted.
    pub spec_accepted_tokens: AtomicU64,
    /// Speculative verify forwards.
    pub spec_verifies: AtomicU64,
    /// Slots currently speculating.
    pub spec_active_slots: AtomicU64,
    /// Structured-output token masks computed (one per constrained slot per step).
    pub masks: AtomicU64,
    /// Nanoseconds spent computing and applying those masks.
    pub mask_nanos: AtomicU64,
}

impl Metrics {
    /// Counts one finished request by endpoint and status.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint, status)).or_default() += 1;
    }

    /// Counts one decode forward of `rows` sequences.
    pub fn batch(&self, rows: usize) {
        let rows = rows as u64;
        self.decode_steps.fetch_add(1, Ordering::Relaxed);
        for (bound, bucket) in BATCH_BUCKETS.iter().zip(&self.batch_buckets) {
            if rows <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.batch_sum.fetch_add(rows, Ordering::Relaxed);
        self.batch_count.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one structured-output mask that took `took`.
    pub fn mask(&self, took: std::time::Duration) {
        self.masks.fetch_add(1, Ordering::Relaxed);
        self.mask_nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition, with the pool's bytes by tag.
    pub fn render(&self, pool: &MemoryPool) -> String {
        let mut s = String::new();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(s, "# HELP kiln_requests_total Requests answered, by endpoint and HTTP status.");
        let _ = writeln!(s, "# TYPE kiln_requests_total counter");
        for ((endpoint, status), n) in self.requests.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(s, "kiln_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
        }
        let counter = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            &mut s,
            "kiln_decode_steps_total",
            "Forwards that decoded at least one sequence.",
            get(&self.decode_steps),
        );
        let _ = writeln!(s, "# HELP kiln_batch_size Sequences decoded per decode forward.");
        let _ = writeln!(s, "# TYPE kiln_batch_size histogram");
        for (bound, bucket) in BATCH_BUCKETS.iter().zip(&self.batch_buckets) {
            let _ = writeln!(s, "kiln_batch_size_bucket{{le=\"{bound}\"}} {}", get(bucket));
        }
        let _ = writeln!(s, "kiln_batch_size_bucket{{le=\"+Inf\"}} {}", get(&self.batch_count));
        let _ = writeln!(s, "kiln_batch_size_sum {}", get(&self.batch_sum));
        let _ = writeln!(s, "kiln_batch_size_count {}", get(&self.batch_count));
        counter(
            &mut s,
            "kiln_prefill_tokens_total",
            "Prompt tokens run through a forward.",
            get(&self.prefill_tokens),
        );
        counter(
            &mut s,
            "kiln_generated_tokens_total",
            "Tokens sampled and sent.",
            get(&self.generated_tokens),
        );
        counter(
            &mut s,
            "kiln_prompt_cache_hits_total",
            "Requests that adopted a cached KV prefix.",
            get(&self.prompt_cache_hits),
        );
        counter(
            &mut s,
            "kiln_prompt_cache_hit_tokens_total",
            "Prompt tokens adopted from the prompt cache instead of prefilled.",
            get(&self.prompt_cache_hit_tokens),
        );
        gauge(
            &mut s,
            "kiln_prompt_cache_bytes",
            "Bytes the prompt cache holds.",
            get(&self.prompt_cache_bytes),
        );
        gauge(&mut s, "kiln_queue_depth", "Requests waiting for a slot.", get(&self.queue_depth));
        gauge(&mut s, "kiln_active_slots", "Slots holding a request.", get(&self.active_slots));
        counter(
            &mut s,
            "kiln_spec_drafted_tokens_total",
            "Tokens drafted and checked by speculative verify forwards.",
            get(&self.spec_drafted_tokens),
        );
        counter(
            &mut s,
            "kiln_spec_accepted_tokens_total",
            "Drafted tokens the target accepted.",
            get(&self.spec_accepted_tokens),
        );
        counter(&mut s, "kiln_spec_verifies_total", "Speculative verify forwards.", get(&self.spec_verifies));
        gauge(
            &mut s,
            "kiln_spec_active_slots",
            "Slots decoding speculatively.",
            get(&self.spec_active_slots),
        );
        let secs = |n: u64| n as f64 / 1e9;
        let _ = writeln!(
            s,
            "# HELP kiln_step_seconds_total Time in scheduler steps, forward included.\n\
             # TYPE kiln_step_seconds_total counter\nkiln_step_seconds_total {:.6}",
            secs(get(&self.step_nanos))
        );
        let _ = writeln!(
            s,
            "# HELP kiln_forward_seconds_total Time inside the forward.\n\
             # TYPE kiln_forward_seconds_total counter\nkiln_forward_seconds_total {:.6}",
            secs(get(&self.forward_nanos))
        );
        counter(
            &mut s,
            "kiln_structured_masks_total",
            "Structured-output token masks computed, one per constrained sequence per step.",
            get(&self.masks),
        );
        let _ = writeln!(
            s,
            "# HELP kiln_structured_mask_seconds_total Time computing and applying structured-output masks, inside the steps.\n\
             # TYPE kiln_structured_mask_seconds_total counter\nkiln_structured_mask_seconds_total {:.6}",
            secs(get(&self.mask_nanos))
        );
        let stats = pool.stats();
        let _ = writeln!(s, "# HELP kiln_pool_bytes Bytes the memory pool holds, by tag.");
        let _ = writeln!(s, "# TYPE kiln_pool_bytes gauge");
        for (tag, t) in &stats.by_tag {
            let _ = writeln!(s, "kiln_pool_bytes{{tag=\"{tag}\"}} {}", t.live);
        }
        if let Some(limit) = stats.limit_bytes {
            gauge(&mut s, "kiln_pool_limit_bytes", "The memory pool's limit.", limit);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_sizes_fill_cumulative_buckets() {
        let m = Metrics::default();
        m.batch(1);
        m.batch(3);
        m.batch(200);
        let text = m.render(&MemoryPool::unlimited());
        assert!(text.contains("kiln_batch_size_bucket{le=\"1\"} 1\n"), "{text}");
        assert!(text.contains("kiln_batch_size_bucket{le=\"4\"} 2\n"), "{text}");
        assert!(text.contains("kiln_batch_size_bucket{le=\"128\"} 2\n"), "{text}");
        assert!(text.contains("kiln_batch_size_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("kiln_batch_size_sum 204\n"), "{text}");
        assert!(text.contains("kiln_decode_steps_total 3\n"), "{text}");
        assert!(text.contains("kiln_pool_bytes{tag=\"kv\"} 0\n"), "{text}");
    }
}
