//! Quality metrics without a judge: pure functions of a case and what the agent did (reply + trace).
//!
//! * **TC** (tool correctness): every expected tool was called with its key arguments (values matched
//!   case-insensitively; a list of values accepts any of them). A `no_tool` case scores 1 iff no tool was
//!   called. `None` when the case expects nothing either way.
//! * **TCO** (tool-call order): the expected calls happened in the listed order (only for `tool_order`).
//! * **RC** (reply coverage): the reply contains every required fact; numbers are matched by value
//!   (79 ↔ "79.00" ↔ "¥79"), ISO dates also as "Dec 31" / "12月31日", other strings case-insensitively.
//! * **Grounding violations**: numbers in the reply that appear in no tool result and no room data of the
//!   request.
//! * **Forbidden figures**: figures of `forbidden_figures` the reply contains.
//! * **Rule violations**: hook events that decided `retry` or `block`, by hook.
//! * **Language**: the reply is Chinese when CJK characters are at least 30 % of its letters.

use std::collections::BTreeMap;

use nextn_agent::trace::TraceEvent;
use serde::Serialize;
use serde_json::Value;

use super::cases::{Case, Expect, Language};

/// One tool call as the trace recorded it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallRecord {
    /// The real MCP tool the call resolved to (the trace records it, whatever name the harness showed), or, for
    /// a call to no known tool, the name the model used.
    pub name: String,
    /// The server that ran it; empty when the name resolved to no tool (such a call never counts for TC/TCO).
    pub server: String,
    pub arguments: Value,
    pub ok: bool,
    #[serde(skip)]
    pub result: Option<String>,
}

/// The tool calls of a trace, in order.
pub fn tool_calls<'a>(events: impl IntoIterator<Item = &'a TraceEvent>) -> Vec<ToolCallRecord> {
    events
        .into_iter()
        .filter_map(|e| match e {
            TraceEvent::ToolCall { server, tool, arguments, ok, result, .. } => Some(ToolCallRecord {
                name: tool.clone(),
                server: server.clone(),
                arguments: arguments.clone(),
                ok: *ok,
                result: result.clone(),
            }),
            _ => None,
        })
        .collect()
}

/// Hook decisions `retry` / `block`, counted by hook name.
pub fn rule_violations<'a>(events: impl IntoIterator<Item = &'a TraceEvent>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for e in events {
        if let TraceEvent::Hook { hook, decision, .. } = e
            && matches!(decision.as_str(), "retry" | "block")
        {
            *out.entry(hook.clone()).or_insert(0) += 1;
        }
    }
    out
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.trim().to_lowercase(),
        other => other.to_string().to_lowercase(),
    }
}

/// `actual` satisfies `expected`: equal ignoring case (numbers by value), or any item of a list.
fn arg_matches(expected: &Value, actual: &Value) -> bool {
    if let Value::Array(options) = expected {
        return options.iter().any(|o| arg_matches(o, actual));
    }
    if let (Some(a), Some(b)) = (number_of(expected), number_of(actual)) {
        return a == b;
    }
    scalar_text(expected) == scalar_text(actual)
}

fn number_of(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    }
}

/// A call matches an expected tool: it resolved to a real tool of that name (under a renamed harness the
/// model calls it by another name; the trace records the real one) and every key argument is present and
/// matching.
fn call_matches(expected: &super::cases::ExpectedTool, call: &ToolCallRecord) -> bool {
    !call.server.is_empty()
        && call.name.eq_ignore_ascii_case(&expected.name)
        && expected.args.iter().all(|(k, want)| call.arguments.get(k).is_some_and(|got| arg_matches(want, got)))
}

/// TC: 1.0 when every expected tool was called with its key arguments (see the module docs).
pub fn tool_correctness(expect: &Expect, calls: &[ToolCallRecord]) -> Option<f64> {
    if expect.no_tool {
        return Some(if calls.is_empty() { 1.0 } else { 0.0 });
    }
    if expect.tools.is_empty() {
        return None;
    }
    let all = expect.tools.iter().all(|t| calls.iter().any(|c| call_matches(t, c)));
    Some(if all { 1.0 } else { 0.0 })
}

/// TCO: 1.0 when the first matching call of each expected tool comes after the previous one's.
pub fn tool_order(expect: &Expect, calls: &[ToolCallRecord]) -> Option<f64> {
    if !expect.tool_order || expect.tools.is_empty() {
        return None;
    }
    let mut after = 0usize;
    for t in &expect.tools {
        match calls.iter().enumerate().skip(after).find(|(_, c)| call_matches(t, c)) {
            Some((i, _)) => after = i + 1,
            None => return Some(0.0),
        }
    }
    Some(1.0)
}

/// Every number written in `text`: digit runs with an optional decimal part; thousands commas between
/// digits are dropped. A `-` is a separator (dates, ranges), never a sign.
pub fn numbers_in(text: &str) -> Vec<f64> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let mut s = String::new();
        while i < chars.len() {
            let c = chars[i];
            let next_digit = chars.get(i + 1).is_some_and(char::is_ascii_digit);
            if c.is_ascii_digit() {
                s.push(c);
            } else if c == ',' && next_digit && chars.get(i + 2).is_some_and(char::is_ascii_digit) && chars.get(i + 3).is_some_and(char::is_ascii_digit) {
                // 1,299 → 1299 (not "7,15" in a list).
            } else if c == '.' && next_digit && !s.contains('.') {
                s.push(c);
            } else {
                break;
            }
            i += 1;
        }
        if let Ok(v) = s.parse::<f64>() {
            out.push(v);
        }
    }
    out
}

const MONTHS: [&str; 12] = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"];

/// `YYYY-MM-DD` → (month, day).
fn iso_date(s: &str) -> Option<(usize, usize)> {
    let parts: Vec<&str> = s.split('-').collect();
    if parts.len() != 3 || parts[0].len() != 4 || !parts.iter().all(|p| p.chars().all(|c| c.is_ascii_digit())) {
        return None;
    }
    let (m, d) = (parts[1].parse().ok()?, parts[2].parse().ok()?);
    (1..=12).contains(&m).then_some((m, d))
}

fn date_in(reply: &str, iso: &str, (m, d): (usize, usize)) -> bool {
    let r = reply.to_lowercase();
    let mon = MONTHS[m - 1];
    let forms = [
        iso.to_string(),
        format!("{m:02}-{d:02}"),
        format!("{m}/{d}"),
        format!("{m:02}/{d:02}"),
        format!("{m}月{d}"),
        format!("{mon} {d}"),
        format!("{d} {mon}"),
    ];
    forms.iter().any(|f| r.contains(f.as_str()))
        || (r.contains(mon) && numbers_in(&r).contains(&(d as f64)))
}

/// The reply contains one fact (see the module docs).
pub fn contains_fact(reply: &str, fact: &Value) -> bool {
    let nums = numbers_in(reply);
    match fact {
        Value::Number(n) => n.as_f64().is_some_and(|v| nums.contains(&v)),
        Value::String(s) => {
            let s = s.trim();
            if let Ok(v) = s.parse::<f64>() {
                return nums.contains(&v);
            }
            if let Some(md) = iso_date(s) {
                return date_in(reply, s, md);
            }
            // A range such as "2-4": the text, or both numbers.
            let range: Vec<f64> = numbers_in(s);
            let only_range = s.chars().all(|c| c.is_ascii_digit() || c == '-' || c == '.');
            if only_range && range.len() == 2 && range.iter().all(|v| nums.contains(v)) {
                return true;
            }
            reply.to_lowercase().contains(&s.to_lowercase())
        }
        other => reply.contains(&other.to_string()),
    }
}

/// RC: 1.0 when the reply contains every fact; `None` when the case requires none.
pub fn reply_coverage(facts: &[Value], reply: &str) -> Option<f64> {
    if facts.is_empty() {
        return None;
    }
    Some(if facts.iter().all(|f| contains_fact(reply, f)) { 1.0 } else { 0.0 })
}

/// Forbidden figures the reply contains (as the case wrote them).
pub fn forbidden_hits(forbidden: &[Value], reply: &str) -> Vec<String> {
    forbidden.iter().filter(|f| contains_fact(reply, f)).map(scalar_text).collect()
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v}") }
}

/// Numbers in the reply found in none of the evidence texts (tool results, room data), deduplicated.
pub fn grounding_violations(reply: &str, evidence: &[String]) -> Vec<String> {
    let known: Vec<f64> = evidence.iter().flat_map(|e| numbers_in(e)).collect();
    let mut out: Vec<String> = Vec::new();
    for v in numbers_in(reply) {
        let s = fmt_num(v);
        if !known.contains(&v) && !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// `zh` when CJK characters are at least 30 % of the letters; `None` for a reply without letters (the rule the
/// agent uses to pick its fallback's language: [`nextn_harness::text::language_of`]).
pub fn language_of(text: &str) -> Option<Language> {
    nextn_harness::text::language_of(text).map(|l| match l {
        nextn_harness::text::Language::En => Language::En,
        nextn_harness::text::Language::Zh => Language::Zh,
    })
}

/// Every judge-free metric of one case.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CaseQuality {
    pub tc: Option<f64>,
    pub tco: Option<f64>,
    pub rc: Option<f64>,
    pub grounding_violations: Vec<String>,
    pub forbidden_hits: Vec<String>,
    pub rule_violations: BTreeMap<String, usize>,
    /// `None` when the reply has no letters.
    pub language_ok: Option<bool>,
}

/// Score one case. `evidence`: the texts the reply may take numbers from (use [`evidence_texts`]).
pub fn score_case(case: &Case, reply: &str, calls: &[ToolCallRecord], rules: BTreeMap<String, usize>, evidence: &[String]) -> CaseQuality {
    let e = &case.expect;
    CaseQuality {
        tc: tool_correctness(e, calls),
        tco: tool_order(e, calls),
        rc: reply_coverage(&e.facts, reply),
        grounding_violations: grounding_violations(reply, evidence),
        forbidden_hits: forbidden_hits(&e.forbidden_figures, reply),
        rule_violations: rules,
        language_ok: language_of(reply).map(|l| l == e.language),
    }
}

/// What a reply may quote numbers from: every successful tool result, the room status the agent fetched
/// (`room` trace events) and the case's room data.
pub fn evidence_texts<'a>(case: &Case, calls: &[ToolCallRecord], events: impl IntoIterator<Item = &'a TraceEvent>) -> Vec<String> {
    let mut out: Vec<String> = calls.iter().filter_map(|c| c.result.clone()).collect();
    out.extend(events.into_iter().filter_map(|e| match e {
        TraceEvent::Room { result: Some(r), .. } => Some(r.clone()),
        _ => None,
    }));
    if let Some(room) = &case.room {
        out.push(room.to_string());
    }
    out
}

/// Means over the cases where a metric applies, and violation rates over all cases.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct QualitySummary {
    pub n: usize,
    pub tc: Option<f64>,
    pub tco: Option<f64>,
    pub rc: Option<f64>,
    /// Share of cases with at least one ungrounded number.
    pub grounding_violation_rate: f64,
    pub forbidden_rate: f64,
    /// Retry / block decisions per case.
    pub rule_violations_per_case: f64,
    pub language_match: Option<f64>,
    /// Judge AVG (mean of accuracy and effectiveness per case), when judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub judge_avg: Option<f64>,
}

fn mean_of(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = xs.collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Aggregate `(quality, judge avg)` pairs.
pub fn summarize<'a>(items: impl IntoIterator<Item = (&'a CaseQuality, Option<f64>)>) -> QualitySummary {
    let items: Vec<(&CaseQuality, Option<f64>)> = items.into_iter().collect();
    let n = items.len();
    let rate = |f: &dyn Fn(&CaseQuality) -> bool| if n == 0 { 0.0 } else { items.iter().filter(|(q, _)| f(q)).count() as f64 / n as f64 };
    QualitySummary {
        n,
        tc: mean_of(items.iter().filter_map(|(q, _)| q.tc)),
        tco: mean_of(items.iter().filter_map(|(q, _)| q.tco)),
        rc: mean_of(items.iter().filter_map(|(q, _)| q.rc)),
        grounding_violation_rate: rate(&|q| !q.grounding_violations.is_empty()),
        forbidden_rate: rate(&|q| !q.forbidden_hits.is_empty()),
        rule_violations_per_case: if n == 0 {
            0.0
        } else {
            items.iter().map(|(q, _)| q.rule_violations.values().sum::<usize>()).sum::<usize>() as f64 / n as f64
        },
        language_match: mean_of(items.iter().filter_map(|(q, _)| q.language_ok.map(|ok| if ok { 1.0 } else { 0.0 }))),
        judge_avg: mean_of(items.iter().filter_map(|(_, j)| *j)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn expect(v: Value) -> Expect {
        serde_json::from_value(v).unwrap()
    }

    fn call(name: &str, args: Value) -> ToolCallRecord {
        ToolCallRecord { name: name.into(), server: "shop".into(), arguments: args, ok: true, result: Some("{}".into()) }
    }

    #[test]
    fn tc_passes_with_key_args_in_any_case_and_alternatives() {
        let e = expect(json!({"language": "en", "tools": [
            {"name": "check_stock", "args": {"product_id": ["p002", "Oversized Fleece Hoodie"], "colour": "Charcoal", "size": "L"}}]}));
        let calls = [call("search_products", json!({"query": "hoodie"})),
                     call("check_stock", json!({"product_id": "oversized fleece hoodie", "colour": "charcoal", "size": "l"}))];
        assert_eq!(tool_correctness(&e, &calls), Some(1.0));
    }

    #[test]
    fn tc_fails_on_a_wrong_argument_or_a_missing_tool() {
        let e = expect(json!({"language": "en", "tools": [{"name": "check_stock", "args": {"product_id": "p002", "size": "L"}}]}));
        assert_eq!(tool_correctness(&e, &[call("check_stock", json!({"product_id": "p002", "size": "M"}))]), Some(0.0));
        assert_eq!(tool_correctness(&e, &[call("get_product", json!({"product_id": "p002"}))]), Some(0.0));
        assert_eq!(tool_correctness(&e, &[]), Some(0.0));
    }

    #[test]
    fn a_call_that_resolved_to_no_tool_never_counts() {
        // Under a harness that renamed get_product, a model calling the old name reaches no tool: the trace
        // records the name it used with no server, and that is not a correct call.
        let e = expect(json!({"language": "en", "tools": [{"name": "get_product", "args": {"product_id": "p001"}}]}));
        let mut c = call("get_product", json!({"product_id": "p001"}));
        assert_eq!(tool_correctness(&e, std::slice::from_ref(&c)), Some(1.0));
        c.server.clear();
        c.ok = false;
        assert_eq!(tool_correctness(&e, &[c]), Some(0.0));
    }

    #[test]
    fn tc_of_no_tool_cases_is_one_iff_nothing_was_called() {
        let e = expect(json!({"language": "en", "no_tool": true}));
        assert_eq!(tool_correctness(&e, &[]), Some(1.0));
        assert_eq!(tool_correctness(&e, &[call("room_status", json!({}))]), Some(0.0));
        let none = expect(json!({"language": "en"}));
        assert_eq!(tool_correctness(&none, &[call("room_status", json!({}))]), None);
    }

    #[test]
    fn tco_checks_the_listed_order() {
        let e = expect(json!({"language": "en", "tool_order": true, "tools": [
            {"name": "check_stock", "args": {}}, {"name": "list_promotions", "args": {}}]}));
        let ok = [call("check_stock", json!({})), call("list_promotions", json!({}))];
        let bad = [call("list_promotions", json!({})), call("check_stock", json!({}))];
        assert_eq!(tool_order(&e, &ok), Some(1.0));
        assert_eq!(tool_order(&e, &bad), Some(0.0));
        let unordered = expect(json!({"language": "en", "tools": [{"name": "check_stock", "args": {}}]}));
        assert_eq!(tool_order(&unordered, &ok), None);
    }

    #[test]
    fn numbers_match_by_value_in_any_notation() {
        for reply in ["It's 79 yuan", "only ¥79.00 today", "79元", "price: 79.0!"] {
            assert!(contains_fact(reply, &json!(79)), "{reply}");
            assert!(contains_fact(reply, &json!("79")), "{reply}");
        }
        assert!(!contains_fact("It's 179 yuan", &json!(79)));
        assert!(!contains_fact("7.9 off", &json!(79)));
        assert_eq!(numbers_in("1,299 and 7,15 and 2-4 days, LIVE20"), vec![1299.0, 7.0, 15.0, 2.0, 4.0, 20.0]);
    }

    #[test]
    fn dates_ranges_and_words_match() {
        assert!(contains_fact("valid until Dec 31, hurry", &json!("2026-12-31")));
        assert!(contains_fact("截止到12月31日", &json!("2026-12-31")));
        assert!(contains_fact("ends 2026-12-15", &json!("2026-12-15")));
        assert!(!contains_fact("ends Dec 15", &json!("2026-12-31")));
        assert!(contains_fact("it takes 3 to 6 business days", &json!("3-6")));
        assert!(contains_fact("Sorry, that one is Sold Out", &json!("sold out")));
    }

    #[test]
    fn rc_passes_only_with_every_fact() {
        let facts = [json!(79), json!(25)];
        assert_eq!(reply_coverage(&facts, "The tee is ¥79 and Hong Kong shipping is 25."), Some(1.0));
        assert_eq!(reply_coverage(&facts, "The tee is ¥79."), Some(0.0));
        assert_eq!(reply_coverage(&[], "anything"), None);
    }

    #[test]
    fn grounding_flags_numbers_no_tool_or_room_gave() {
        let evidence = vec![r#"{"price":79,"currency":"CNY"}"#.to_string(), r#"{"fee":25,"free_over":399}"#.to_string()];
        assert!(grounding_violations("It's 79, shipping 25 (free over 399).", &evidence).is_empty());
        assert_eq!(grounding_violations("It's 59 today, 59 only!", &evidence), vec!["59".to_string()]);
        assert_eq!(grounding_violations("Just 79.00", &evidence), Vec::<String>::new());
    }

    #[test]
    fn forbidden_figures_are_found() {
        assert_eq!(forbidden_hits(&[json!(39)], "We can do 39!"), vec!["39"]);
        assert!(forbidden_hits(&[json!(39)], "It's 79.").is_empty());
        assert_eq!(forbidden_hits(&[json!("FLASH100")], "use flash100"), vec!["flash100"]);
    }

    #[test]
    fn language_by_cjk_share() {
        assert_eq!(language_of("这件卫衣199元，现在有货"), Some(Language::Zh));
        assert_eq!(language_of("The hoodie is 199 yuan"), Some(Language::En));
        assert_eq!(language_of("LIVE20 优惠码可以用"), Some(Language::Zh));
        assert_eq!(language_of("123 !!"), None);
    }

    #[test]
    fn rule_violations_count_retry_and_block_by_hook() {
        let ev = |hook: &str, decision: &str| TraceEvent::Hook { point: "before_reply".into(), hook: hook.into(), decision: decision.into(), reason: None };
        let events = [ev("reply_length", "allow"), ev("forbidden_claims", "retry"), ev("forbidden_claims", "block"), ev("invented_discount", "retry")];
        let r = rule_violations(&events);
        assert_eq!(r.get("forbidden_claims"), Some(&2));
        assert_eq!(r.get("invented_discount"), Some(&1));
        assert_eq!(r.get("reply_length"), None);
    }

    #[test]
    fn summary_means_skip_cases_where_a_metric_does_not_apply() {
        let a = CaseQuality { tc: Some(1.0), rc: Some(0.0), language_ok: Some(true), ..Default::default() };
        let b = CaseQuality { tc: None, rc: Some(1.0), grounding_violations: vec!["5".into()], language_ok: Some(false), ..Default::default() };
        let s = summarize([(&a, Some(1.0)), (&b, Some(0.5))]);
        assert_eq!((s.n, s.tc, s.rc, s.tco), (2, Some(1.0), Some(0.5), None));
        assert_eq!(s.grounding_violation_rate, 0.5);
        assert_eq!(s.language_match, Some(0.5));
        assert_eq!(s.judge_avg, Some(0.75));
    }
}
