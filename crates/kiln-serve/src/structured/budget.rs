//! The size a request's regular expressions may reach, decided before anything compiles.
//! llguidance's lexer builds a counted repetition's derivatives as the output grows: one
//! nested inside another (`(a{1000}){1000}`) passes the first mask and then runs the
//! lexer out of its expression budget some tokens later, after seconds of work. Counting
//! what the repetitions expand to refuses such a regex when the request is accepted.

use regex_syntax::ast::{self, Ast, RepetitionKind, RepetitionRange};
use serde_json::Value;

use crate::error::ApiError;

/// The most pieces a regular expression may expand to with every counted repetition
/// written out (`a{100000}` is 100,000; `((a{50}){50}){50}` is 125,000).
pub const MAX_REGEX_EXPANSION: u64 = 100_000;

/// Groups nested deeper than this are refused by the parser (and bound the count's
/// recursion).
const NEST_LIMIT: u32 = 200;

/// What `rx` expands to, or `None` when it does not parse as a regular expression
/// (llguidance then says why, naming the field).
pub fn expansion(rx: &str) -> Option<u64> {
    let parsed = ast::parse::ParserBuilder::new().nest_limit(NEST_LIMIT).build().parse(rx).ok()?;
    Some(size(&parsed))
}

fn size(a: &Ast) -> u64 {
    match a {
        Ast::Repetition(r) => {
            let times = match &r.op.kind {
                RepetitionKind::ZeroOrOne | RepetitionKind::ZeroOrMore | RepetitionKind::OneOrMore => 1,
                RepetitionKind::Range(RepetitionRange::Exactly(n) | RepetitionRange::AtLeast(n)) => *n,
                RepetitionKind::Range(RepetitionRange::Bounded(_, n)) => *n,
            };
            u64::from(times.max(1)).saturating_mul(size(&r.ast))
        }
        Ast::Group(g) => size(&g.ast),
        Ast::Concat(c) => c.asts.iter().map(size).fold(0, u64::saturating_add),
        Ast::Alternation(alt) => alt.asts.iter().map(size).fold(0, u64::saturating_add),
        _ => 1,
    }
}

/// Refuses `rx`, from the request's `field` (`what` names it there), when it expands past
/// [`MAX_REGEX_EXPANSION`].
pub fn check_regex(field: &str, what: &str, rx: &str) -> Result<(), ApiError> {
    match expansion(rx) {
        Some(n) if n > MAX_REGEX_EXPANSION => Err(ApiError::invalid(
            field,
            format!(
                "{what} repeats too much: written out, its counted repetitions make {n} pieces; \
                 accepted are at most {MAX_REGEX_EXPANSION} (nest fewer counted repetitions, or use * and +)"
            ),
        )),
        _ => Ok(()),
    }
}

/// Refuses a JSON schema from `field` whose `pattern` keywords expand past the budget.
pub fn check_schema(field: &str, schema: &Value) -> Result<(), ApiError> {
    let mut stack = vec![schema];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(rx)) = o.get("pattern") {
                    check_regex(field, &format!("{field}'s pattern {rx:?}"), rx)?;
                }
                if let Some(Value::Object(props)) = o.get("patternProperties") {
                    for rx in props.keys() {
                        check_regex(field, &format!("{field}'s patternProperties key {rx:?}"), rx)?;
                    }
                }
                stack.extend(o.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_repetitions_multiply_and_the_rest_count_once() {
        assert_eq!(expansion("abc"), Some(3));
        assert_eq!(expansion("a{20}"), Some(20));
        assert_eq!(expansion("[a-z]{1,20000}"), Some(20_000));
        assert_eq!(expansion("(a{1000}){1000}"), Some(1_000_000));
        assert_eq!(expansion("((a{50}){50}){50}"), Some(125_000));
        assert_eq!(expansion("(ab|c){3,}"), Some(9));
        assert_eq!(expansion("x*y+z?"), Some(3));
        assert_eq!(expansion("(unclosed"), None);
        let deep = format!("{}a{}", "(".repeat(500), ")".repeat(500));
        assert_eq!(expansion(&deep), None, "nesting past the limit is not counted");
        let huge = "((((a{4294967295}){4294967295}){4294967295}){4294967295})";
        assert_eq!(expansion(huge), Some(u64::MAX), "the count saturates");
    }

    #[test]
    fn a_regex_or_a_schema_pattern_past_the_budget_is_refused_naming_the_field() {
        assert!(check_regex("guided_regex", "guided_regex", "(a{100}){100}").is_ok());
        let e = check_regex("guided_regex", "guided_regex", "(a{1000}){1000}").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_regex"));
        assert!(e.message.contains("1000000") && e.message.contains("at most 100000"), "{}", e.message);
        let schema = serde_json::json!({"type": "object", "properties": {
            "x": {"type": "array", "items": {"type": "string", "pattern": "((a{50}){50}){50}"}}}});
        let e = check_schema("guided_json", &schema).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_json"));
        assert!(check_schema("guided_json", &serde_json::json!({"pattern": "[0-9]{3}"})).is_ok());
    }
}
