//! The process's maximum resident set size, from `getrusage`.

/// Peak resident set size of this process in bytes, when the platform reports it.
pub fn max_rss_bytes() -> Option<u64> {
    #[cfg(unix)]
    {
        // SAFETY: `rusage` is a plain C struct of integers and timevals, for which all
        // zero bytes is a valid value.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `usage` is a valid, writable `rusage` for the duration of the call.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
        if rc != 0 {
            return None;
        }
        let raw = u64::try_from(usage.ru_maxrss).ok()?;
        // Linux and the BSDs report kilobytes; macOS reports bytes.
        if cfg!(target_os = "macos") { Some(raw) } else { Some(raw * 1024) }
    }
    #[cfg(not(unix))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_grows_with_touched_memory() {
        let before = max_rss_bytes().unwrap();
        let v = vec![1u8; 64 << 20];
        std::hint::black_box(&v);
        let after = max_rss_bytes().unwrap();
        assert!(after >= before && after >= 64 << 20, "{before} -> {after}");
    }
}
