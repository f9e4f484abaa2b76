//! llama.cpp's `llama-bench -o json` output, parsed strictly: an array of tests, each with
//! its build, its shape (`n_prompt`, `n_gen`, `n_depth`, `n_threads`) and its timing
//! (`avg_ns`, `avg_ts`, `samples_ts`). Only the fields the sweep reads are typed; the
//! rest (llama-bench prints about forty) are ignored.

use serde::Deserialize;

/// One llama-bench test: a prompt-processing (`n_gen` 0) or a generation (`n_prompt` 0)
/// run of `samples_ts.len()` repetitions.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Test {
    /// The commit llama.cpp was built from.
    pub build_commit: String,
    /// Its build number.
    pub build_number: i64,
    /// The model file.
    pub model_filename: String,
    /// Threads.
    pub n_threads: u64,
    /// Prompt tokens processed.
    pub n_prompt: u64,
    /// Tokens generated.
    pub n_gen: u64,
    /// Tokens already in the context before the test (`-d`).
    #[serde(default)]
    pub n_depth: u64,
    /// Mean wall time of one repetition, nanoseconds.
    pub avg_ns: u64,
    /// Mean tokens per second.
    pub avg_ts: f64,
    /// Tokens per second of each repetition.
    pub samples_ts: Vec<f64>,
}

impl Test {
    /// The version string a peer row carries: `llama.cpp b<number> (<commit>)`.
    pub fn version(&self) -> String {
        format!("llama.cpp b{} ({})", self.build_number, self.build_commit)
    }
}

/// The tests of one `llama-bench -o json` run; an error says what is wrong with the text.
pub fn parse(stdout: &str) -> Result<Vec<Test>, String> {
    let text = stdout.trim();
    if text.is_empty() {
        return Err("llama-bench printed nothing on stdout".into());
    }
    let tests: Vec<Test> =
        serde_json::from_str(text).map_err(|e| format!("llama-bench's JSON output is malformed: {e}"))?;
    if tests.is_empty() {
        return Err("llama-bench's JSON output holds no test".into());
    }
    for t in &tests {
        if !(t.avg_ts.is_finite() && t.avg_ts > 0.0) || t.avg_ns == 0 {
            return Err(format!(
                "llama-bench test pp{} tg{} d{}: avg_ts {} / avg_ns {}: expected a positive rate",
                t.n_prompt, t.n_gen, t.n_depth, t.avg_ts, t.avg_ns
            ));
        }
    }
    Ok(tests)
}

/// The one test of `tests` with this shape, or why there is none.
pub fn find(tests: &[Test], n_prompt: u64, n_gen: u64, n_depth: u64) -> Result<&Test, String> {
    tests.iter().find(|t| (t.n_prompt, t.n_gen, t.n_depth) == (n_prompt, n_gen, n_depth)).ok_or_else(|| {
        let have: Vec<String> =
            tests.iter().map(|t| format!("pp{} tg{} d{}", t.n_prompt, t.n_gen, t.n_depth)).collect();
        format!(
            "llama-bench reported no test pp{n_prompt} tg{n_gen} d{n_depth} (it reported {})",
            have.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFILL: &str = include_str!("fixtures/llama-bench-prefill.json");
    const DECODE: &str = include_str!("fixtures/llama-bench-decode.json");

    #[test]
    fn recorded_outputs_parse_into_their_tests() {
        let pp = parse(PREFILL).unwrap();
        assert_eq!(pp.len(), 1);
        let t = find(&pp, 64, 0, 0).unwrap();
        assert!(t.avg_ts > 0.0 && t.samples_ts.len() == 1, "{t:?}");
        assert!(t.model_filename.ends_with(".gguf"), "{t:?}");
        assert!(t.version().starts_with("llama.cpp b"), "{}", t.version());
        let tg = parse(DECODE).unwrap();
        let t = find(&tg, 0, 8, 64).unwrap();
        assert!(t.avg_ts > 0.0, "{t:?}");
        assert_eq!(t.n_threads, pp[0].n_threads);
        let e = find(&tg, 64, 0, 0).unwrap_err();
        assert!(e.contains("no test pp64 tg0 d0") && e.contains("tg8 d64"), "{e}");
    }

    #[test]
    fn malformed_outputs_are_errors_that_say_what_is_wrong() {
        assert!(parse("").unwrap_err().contains("printed nothing"));
        assert!(parse("[]").unwrap_err().contains("no test"));
        assert!(parse("[\n  {\n    \"build_commit\": \"abc\"").unwrap_err().contains("malformed"));
        let zero = PREFILL.replacen("\"avg_ts\": ", "\"avg_ts\": 0.0, \"was\": ", 1);
        assert!(parse(&zero).unwrap_err().contains("expected a positive rate"), "{zero}");
    }
}
