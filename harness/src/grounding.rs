//! Grounding: every number the reply states must appear as a number in the evidence (tool results, room data,
//! product specs, FAQ answers). A live host that says "¥79" when no tool said 79 has invented a price.
//!
//! [`figures`] finds the figures a text states, classified by what they measure ([`FigureKind`]) and with their
//! numeric values; [`unsupported_figures`] keeps those whose values the evidence does not show. Equality is by
//! value after normalising (`79`, `79.0`, `¥79`, `79 CNY`, `1,299` vs `1299`), with a few equivalences a host
//! uses when speaking: a 折 figure is supported by its own number or the percent off (8折 = 20% off = pay 0.8),
//! a time by its 12- or 24-hour hour, a date by its numeric components. Action markers (`[show_product:p007]`)
//! are not speech and hold no figures. Digits inside identifiers (`LIVE20`, `p007`, `2XL`) are not numeric
//! figures; the identifier itself is a claim ([`codes`]: a coupon code, a size label, a product id) that the evidence
//! must show verbatim, so an invented `SAVE50` or `4XL` is caught like an invented price.

use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;

use crate::actions::strip_markers;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FigureKind {
    /// `¥79`, `79 CNY`, `79元`, `79块`, `$27.99`, `79 yuan`.
    Price,
    /// `20%`, `20 percent`, `百分之20`.
    Percent,
    /// `8折`, `8.5折`.
    Zhe,
    /// `12 pieces`, `3件`, `5 left in stock`.
    Count,
    /// `shipping fee 8`, `运费8元`.
    Fee,
    /// `over 199`, `满199`, `orders of 800`.
    Threshold,
    /// `7 days`, `2-3 days`, `48小时`.
    Duration,
    /// `2026-12-31`, `Dec 31`, `12月31日`.
    Date,
    /// `20:00`, `8pm`, `8点`.
    Time,
    /// `170cm`, `60kg`, `size 37`, `38码`.
    Size,
    /// Any other digit run.
    Number,
    /// A code or label with digits in it (`LIVE20`, `4XL`, `p007`), checked as text, not by value.
    Code,
}

/// A figure as the text states it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figure {
    pub kind: FigureKind,
    /// As written, with its currency sign or unit (`$27.99`, `199 yuan`).
    pub text: String,
    /// The numbers it states: one, two for a range, (year,) month, day for a date, hour (24 h) and minute for a
    /// time.
    pub values: Vec<f64>,
}

const MONTHS: [&str; 12] = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"];

static DATE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?ix)
        (?P<y1>\d{4})[-/.](?P<m1>\d{1,2})[-/.](?P<d1>\d{1,2})
      | (?:(?P<y2>\d{4})\s?年\s?)?(?P<m2>\d{1,2})\s?月\s?(?P<d2>\d{1,2})\s?[日号]
      | \b(?P<mn3>jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\.?\s+(?P<d3>\d{1,2})(?:st|nd|rd|th)?\b(?:,?\s+(?P<y3>\d{4}))?
      | \b(?P<d4>\d{1,2})(?:st|nd|rd|th)?\s+(?:of\s+)?(?P<mn4>jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\b",
    )
    .expect("valid date regex")
});

static TIME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?ix)
        (?P<h1>\d{1,2}):(?P<mi1>\d{2})(?:\s?(?P<ap1>am|pm)\b)?
      | (?P<h2>\d{1,2})\s?(?P<ap2>am|pm)\b
      | (?P<h3>\d{1,2})\s?点(?:(?P<mi3>\d{1,2})分?)?",
    )
    .expect("valid time regex")
});

/// A number (thousands separators allowed), an optional range, and the words around it that say what it is.
static NUMBER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?ix)
        (?P<pre>[¥￥$]\s?|(?:usd|cny|rmb)\s?|百分之)?
        (?P<n>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)
        (?:\s?(?:-|–|~|～|to|到|至)\s?(?P<n2>\d+(?:\.\d+)?))?
        (?P<suf>\s?(?:%|percent|per\s?cent|折|元|块|yuan|cny|rmb|usd|dollars?|件|个|pieces?|pcs|items?|units?|
            business\s+days?|working\s+days?|days?|hours?|hrs?|weeks?|months?|minutes?|mins?|天|小时|周|个月|分钟|
            cm|kg|mm|码|inch(?:es)?|in\b|g\b|gsm|oz))?",
    )
    .expect("valid number regex")
});

/// Every number in evidence text (thousands separators read both as one number and as a list).
static EVIDENCE_NUMBER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?").expect("valid regex"));

fn num(s: &str) -> Option<f64> {
    s.replace(',', "").parse().ok()
}

fn month_number(name: &str) -> Option<f64> {
    let n = name.to_lowercase();
    MONTHS.iter().position(|m| n.starts_with(m)).map(|i| (i + 1) as f64)
}

/// Whether the byte range `start..end` of `text` is glued to letters (an identifier such as `LIVE20` or `2XL`).
fn in_identifier(text: &str, start: usize, end: usize) -> bool {
    let before = text[..start].chars().next_back();
    let after = text[end..].chars().next();
    let glued = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    glued(before) || glued(after)
}

fn context_after(text: &str, end: usize, chars: usize) -> String {
    text[end..].chars().take(chars).collect::<String>().to_lowercase()
}

fn context_before(text: &str, start: usize, chars: usize) -> String {
    let head = &text[..start];
    let skip = head.chars().count().saturating_sub(chars);
    head.chars().skip(skip).collect::<String>().to_lowercase()
}

/// The figures `text` states, in order. Action markers are removed first.
pub fn figures(text: &str) -> Vec<Figure> {
    let text = strip_markers(text);
    let text = text.as_str();
    let mut taken: Vec<(usize, usize)> = Vec::new();
    let mut out: Vec<(usize, Figure)> = Vec::new();
    let free = |taken: &[(usize, usize)], s: usize, e: usize| taken.iter().all(|&(a, b)| e <= a || s >= b);

    for c in DATE.captures_iter(text) {
        let m = c.get(0).expect("match");
        let g = |k: &str| c.name(k).map(|x| x.as_str());
        let (y, mo, d) = if let Some(y) = g("y1") {
            (Some(y), g("m1").and_then(num), g("d1").and_then(num))
        } else if let Some(mo) = g("m2") {
            (g("y2"), num(mo), g("d2").and_then(num))
        } else if let Some(mn) = g("mn3") {
            (g("y3"), month_number(mn), g("d3").and_then(num))
        } else {
            (None, g("mn4").and_then(month_number), g("d4").and_then(num))
        };
        let (Some(mo), Some(d)) = (mo, d) else { continue };
        let mut values: Vec<f64> = y.and_then(num).into_iter().collect();
        values.extend([mo, d]);
        taken.push((m.start(), m.end()));
        out.push((m.start(), Figure { kind: FigureKind::Date, text: m.as_str().trim().to_string(), values }));
    }
    for c in TIME.captures_iter(text) {
        let m = c.get(0).expect("match");
        if !free(&taken, m.start(), m.end()) || in_identifier(text, m.start(), m.end()) {
            continue;
        }
        let g = |k: &str| c.name(k).map(|x| x.as_str());
        let hour = g("h1").or(g("h2")).or(g("h3")).and_then(num).unwrap_or(0.0);
        let minute = g("mi1").or(g("mi3")).and_then(num).unwrap_or(0.0);
        let pm = g("ap1").or(g("ap2")).is_some_and(|a| a.eq_ignore_ascii_case("pm"));
        let am = g("ap1").or(g("ap2")).is_some_and(|a| a.eq_ignore_ascii_case("am"));
        let hour = if pm && hour < 12.0 {
            hour + 12.0
        } else if am && hour == 12.0 {
            0.0
        } else {
            hour
        };
        taken.push((m.start(), m.end()));
        out.push((
            m.start(),
            Figure { kind: FigureKind::Time, text: m.as_str().trim().to_string(), values: vec![hour, minute] },
        ));
    }
    for c in NUMBER.captures_iter(text) {
        let m = c.get(0).expect("match");
        let n = c.name("n").expect("number group");
        let mut end = m.end();
        let mut suffix = c.name("suf").map(|s| s.as_str().trim().to_lowercase()).unwrap_or_default();
        // A unit word glued to more letters (`3 dayss`, `5 items`→ fine, `2 pcsX`) is not a unit.
        if suffix.chars().last().is_some_and(|c| c.is_ascii_alphabetic())
            && text[end..].chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        {
            suffix.clear();
            end = c.name("n2").map_or(n.end(), |x| x.end());
        }
        let start = m.start();
        if !free(&taken, start, end) {
            continue;
        }
        let pre = c.name("pre").map(|p| p.as_str().trim().to_lowercase()).unwrap_or_default();
        if pre.is_empty() && suffix.is_empty() && in_identifier(text, n.start(), end) {
            continue;
        }
        if !suffix.is_empty() && text[..n.start()].chars().next_back().is_some_and(|c| c.is_ascii_alphabetic()) {
            continue;
        }
        let mut values: Vec<f64> = num(n.as_str()).into_iter().collect();
        let mut written_end = end;
        if let Some(n2) = c.name("n2") {
            // A range counts only with a unit ("2-3 days"); "2026-12" or "9-5" alone are two numbers.
            if suffix.is_empty() {
                written_end = n.end();
            } else {
                values.extend(num(n2.as_str()));
            }
        }
        let context = format!("{} | {}", context_before(text, start, 16), context_after(text, end, 16));
        let kind = classify(&pre, &suffix, &context);
        taken.push((start, written_end));
        out.push((start, Figure { kind, text: text[start..written_end].trim().to_string(), values }));
        if let (Some(n2), true) = (c.name("n2"), suffix.is_empty()) {
            // The second number of a unitless pair is a figure of its own.
            if let Some(v) = num(n2.as_str()) {
                taken.push((n2.start(), n2.end()));
                let kind = classify("", "", &context_before(text, n2.start(), 16));
                out.push((n2.start(), Figure { kind, text: n2.as_str().to_string(), values: vec![v] }));
            }
        }
    }
    out.sort_by_key(|(start, _)| *start);
    out.into_iter().map(|(_, f)| f).collect()
}

/// `context` is the text just before the number, ` | `, and the text just after it.
fn classify(pre: &str, suffix: &str, context: &str) -> FigureKind {
    let before = context.split(" | ").next().unwrap_or("");
    let has = |words: &[&str]| words.iter().any(|w| before.contains(w));
    let around = |words: &[&str]| words.iter().any(|w| context.contains(w));
    let price = matches!(pre, "¥" | "￥" | "$" | "usd" | "cny" | "rmb")
        || ["元", "块", "yuan", "cny", "rmb", "usd", "dollar", "dollars"].contains(&suffix);
    let threshold = has(&["over", "above", "orders of", "spend", "at least", "满", "超过"]);
    let fee = has(&["fee", "shipping", "postage", "运费", "邮费"]);
    if pre == "百分之" || ["%", "percent", "per cent", "percent"].contains(&suffix) || suffix.starts_with("per") {
        FigureKind::Percent
    } else if suffix == "折" {
        FigureKind::Zhe
    } else if price || (suffix.is_empty() && (threshold || fee)) {
        if threshold {
            FigureKind::Threshold
        } else if fee {
            FigureKind::Fee
        } else {
            FigureKind::Price
        }
    } else if suffix.contains("day")
        || ["hour", "hours", "hr", "hrs", "week", "weeks", "month", "months", "minute", "minutes", "min", "mins"]
            .contains(&suffix)
        || ["天", "小时", "周", "个月", "分钟"].contains(&suffix)
    {
        FigureKind::Duration
    } else if ["件", "个", "piece", "pieces", "pcs", "item", "items", "unit", "units"].contains(&suffix)
        || around(&["stock", "left", "库存", "还剩", "剩"])
    {
        FigureKind::Count
    } else if ["cm", "kg", "mm", "码", "inch", "inches", "in", "g", "gsm", "oz"].contains(&suffix)
        || has(&["size", "尺码", "waist"])
    {
        FigureKind::Size
    } else {
        FigureKind::Number
    }
}

/// Every number in the evidence texts.
pub fn evidence_numbers(evidence: &[String]) -> Vec<f64> {
    let mut out = Vec::new();
    for text in evidence {
        for m in EVIDENCE_NUMBER.find_iter(text) {
            // `LIVE20` and `p007` hold no figures; a trailing letter is fine (`31T23:59` in a timestamp, `170cm`).
            let mut before = text[..m.start()].chars().rev();
            let (prev, prev2) = (before.next(), before.next());
            let iso_time = prev == Some('T') && prev2.is_some_and(|c| c.is_ascii_digit()); // `2026-12-24T21:00`
            if prev.is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && !iso_time {
                continue;
            }
            out.extend(num(m.as_str()));
            if m.as_str().contains(',') {
                out.extend(m.as_str().split(',').filter_map(num));
            }
        }
    }
    out
}

fn same(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Whether `figure` is backed by `numbers` (from [`evidence_numbers`]).
fn supported(figure: &Figure, numbers: &[f64]) -> bool {
    let has = |x: f64| numbers.iter().any(|&n| same(n, x));
    match figure.kind {
        // 8折 = pay 80 % = 20 % off = 0.8.
        FigureKind::Zhe => {
            figure.values.iter().all(|&z| has(z) || has(100.0 - z * 10.0) || has(z * 10.0) || has(z / 10.0))
        }
        // 20 % = 0.2, or the 折 / pay-rate form of the same discount (8 / 0.8 / 80).
        FigureKind::Percent => {
            figure.values.iter().all(|&p| has(p) || has(p / 100.0) || has((100.0 - p) / 10.0) || has(1.0 - p / 100.0))
        }
        FigureKind::Time => {
            let (h, m) = (figure.values[0], figure.values[1]);
            let hour = has(h) || (h >= 12.0 && has(h - 12.0)) || (h < 12.0 && has(h + 12.0));
            hour && (m == 0.0 || has(m))
        }
        _ => figure.values.iter().all(|&v| has(v)),
    }
}

/// Maximal runs of ASCII letters, digits and `_`.
fn word_runs(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| !w.is_empty())
}

/// Letters after a number that make it a figure with a unit (`170cm`, `8pm`), not a code.
const GLUED_UNITS: [&str; 24] = [
    "st", "nd", "rd", "th", "cm", "mm", "kg", "g", "gsm", "oz", "in", "am", "pm", "h", "hr", "hrs", "min", "mins",
    "d", "day", "days", "pcs", "x", "k",
];

/// The codes `text` states: words mixing letters and digits (`LIVE20`, `4XL`, `p007`), action markers removed; a
/// number with a glued unit or ordinal suffix (`170cm`, `8pm`, `2nd`) is a figure, not a code. Deduplicated.
pub fn codes(text: &str) -> Vec<Figure> {
    let text = strip_markers(text);
    let mut out: Vec<Figure> = Vec::new();
    for w in word_runs(&text) {
        let has_digit = w.chars().any(|c| c.is_ascii_digit());
        let has_letter = w.chars().any(|c| c.is_ascii_alphabetic());
        let digits_then = w.trim_start_matches(|c: char| c.is_ascii_digit());
        let unit = digits_then.len() < w.len() && GLUED_UNITS.contains(&digits_then.to_ascii_lowercase().as_str());
        if has_digit && has_letter && !unit && !out.iter().any(|f| f.text.eq_ignore_ascii_case(w)) {
            out.push(Figure { kind: FigureKind::Code, text: w.to_string(), values: Vec::new() });
        }
    }
    out
}

/// The letter-size labels with a digit that `text` names (`4XL`, `3xs`): a viewer who asks for a size the shop does
/// not make may hear it named back ("it doesn't come in 4XL"), so the agent counts these from the viewer's words as
/// evidence; other codes a viewer writes (a "hidden coupon") are not.
pub fn size_labels(text: &str) -> Vec<String> {
    let is_size = |w: &str| {
        let rest = w.trim_start_matches(|c: char| c.is_ascii_digit()).to_ascii_uppercase();
        rest.len() < w.len() && matches!(rest.as_str(), "XL" | "XS" | "XXL" | "XXS")
    };
    word_runs(text).filter(|w| is_size(w)).map(str::to_string).collect()
}

/// The figures of `reply` that no evidence text shows: numbers by value, codes as whole words (any case).
pub fn unsupported_figures(reply: &str, evidence: &[String]) -> Vec<Figure> {
    let numbers = evidence_numbers(evidence);
    let words: std::collections::HashSet<String> =
        evidence.iter().flat_map(|e| word_runs(e).map(str::to_ascii_lowercase)).collect();
    let mut out: Vec<Figure> = figures(reply).into_iter().filter(|f| !supported(f, &numbers)).collect();
    out.extend(codes(reply).into_iter().filter(|c| !words.contains(&c.text.to_ascii_lowercase())));
    out
}

/// Characters that end a clause, for [`refused_clause_prefix`].
const CLAUSE_ENDS: &[char] = &[',', ';', ':', '.', '!', '?', '，', '；', '：', '。', '！', '？', '、'];

/// `reply` up to and including the first word of the clause that states `figure` (its first occurrence; clauses
/// end at `, ; : . ! ?` and their full-width forms): a retry that may not begin with this text keeps every
/// clause before that one open and must start the refused clause with another word. A Han character counts as
/// a word. `None` when `reply` does not contain `figure`.
///
/// "Tonight you can use LIVE20, WELCOME30, and shipping to International is 120 yuan." with "120 yuan" gives
/// "Tonight you can use LIVE20, WELCOME30, and".
pub fn refused_clause_prefix(reply: &str, figure: &str) -> Option<String> {
    let at = reply.find(figure).filter(|_| !figure.is_empty())?;
    let clause = reply[..at].rfind(CLAUSE_ENDS).map_or(0, |i| i + reply[i..].chars().next().map_or(1, char::len_utf8));
    let start = clause + reply[clause..].len() - reply[clause..].trim_start().len();
    let mut chars = reply[start..].char_indices();
    let end = match chars.next() {
        None => return None,
        Some((_, c)) if is_han(c) || !c.is_alphanumeric() => start + c.len_utf8(),
        Some(_) => start + chars.find(|&(_, c)| !c.is_alphanumeric() || is_han(c)).map_or(reply.len() - start, |(i, _)| i),
    };
    Some(reply[..end].to_string())
}

fn is_han(c: char) -> bool {
    matches!(c, '\u{4e00}'..='\u{9fff}' | '\u{3400}'..='\u{4dbf}')
}

/// The `Retry` reason for unsupported figures.
pub fn unsupported_reason(figures: &[Figure]) -> String {
    let list: Vec<String> = figures.iter().map(|f| format!("\"{}\"", f.text)).collect();
    format!(
        "the reply states figures that no tool result or room data shows: {}; quote only numbers from tool results, \
         or call the tool first",
        list.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refused_clause_prefix_ends_at_the_first_word_of_the_figures_clause() {
        let r = "Tonight you can use LIVE20, WELCOME30, and shipping to International is 120 yuan.";
        assert_eq!(refused_clause_prefix(r, "120 yuan").as_deref(), Some("Tonight you can use LIVE20, WELCOME30, and"));
        // The figure in the first clause: only the reply's first word.
        assert_eq!(refused_clause_prefix("The tee is 79 yuan.", "79 yuan").as_deref(), Some("The"));
        // The clause starts with the figure itself; a second sentence.
        assert_eq!(refused_clause_prefix("Yes! 120 yuan to ship.", "120 yuan").as_deref(), Some("Yes! 120"));
        // Han characters are words of their own; full-width punctuation ends clauses.
        assert_eq!(refused_clause_prefix("有的，运费120元。", "120元").as_deref(), Some("有的，运"));
        assert_eq!(refused_clause_prefix("签收7天内可退。", "7天").as_deref(), Some("签"));
        assert_eq!(refused_clause_prefix("The tee is 79 yuan.", "99 yuan"), None);
        assert_eq!(refused_clause_prefix("The tee.", ""), None);
    }

    fn kinds(text: &str) -> Vec<(FigureKind, String, Vec<f64>)> {
        figures(text).into_iter().map(|f| (f.kind, f.text, f.values)).collect()
    }

    #[test]
    fn figures_are_classified_with_their_values() {
        use FigureKind::*;
        let k = kinds("It's ¥79, or $27.99, 199 yuan and 1,299元 with 20% off");
        assert_eq!(k[0], (Price, "¥79".into(), vec![79.0]));
        assert_eq!(k[1], (Price, "$27.99".into(), vec![27.99]));
        assert_eq!(k[2], (Price, "199 yuan".into(), vec![199.0]));
        assert_eq!(k[3], (Price, "1,299元".into(), vec![1299.0]));
        assert_eq!(k[4], (Percent, "20%".into(), vec![20.0]));
        assert_eq!(kinds("今天8.5折")[0], (Zhe, "8.5折".into(), vec![8.5]));
        assert_eq!(kinds("百分之30")[0].0, Percent);
        assert_eq!(kinds("only 5 left in stock")[0].0, Count);
        assert_eq!(kinds("3件")[0].0, Count);
        assert_eq!(kinds("shipping fee is 8")[0].0, Fee);
        assert_eq!(kinds("free over 199")[0].0, Threshold);
        assert_eq!(kinds("满199减30")[0].0, Threshold);
        assert_eq!(kinds("arrives in 2-3 days")[0], (Duration, "2-3 days".into(), vec![2.0, 3.0]));
        assert_eq!(kinds("48小时内发货")[0].0, Duration);
        assert_eq!(kinds("until 2026-12-31")[0], (Date, "2026-12-31".into(), vec![2026.0, 12.0, 31.0]));
        assert_eq!(kinds("ends Dec 31")[0], (Date, "Dec 31".into(), vec![12.0, 31.0]));
        assert_eq!(kinds("12月31日截止")[0], (Date, "12月31日".into(), vec![12.0, 31.0]));
        assert_eq!(kinds("live at 20:00")[0], (Time, "20:00".into(), vec![20.0, 0.0]));
        assert_eq!(kinds("back at 8pm")[0], (Time, "8pm".into(), vec![20.0, 0.0]));
        assert_eq!(kinds("at 170cm")[0].0, Size);
        assert_eq!(kinds("take size 37")[0].0, Size);
        assert_eq!(kinds("we have 3 colours")[0].0, Number);
    }

    #[test]
    fn identifiers_and_action_markers_are_not_figures() {
        assert!(figures("Use LIVE20 on p007 in 2XL [show_product:p007] [show_coupon:LIVE20]").is_empty());
    }

    #[test]
    fn codes_are_claims_the_evidence_must_show_as_words() {
        let texts = |t: &str| codes(t).into_iter().map(|f| f.text).collect::<Vec<_>>();
        assert_eq!(texts("Use LIVE20 on p007 in 2XL, live20 again [show_coupon:SAVE50]"), ["LIVE20", "p007", "2XL"]);
        // Units, times and ordinals glued to a number are figures, not codes.
        assert!(codes("170cm, 60kg, 8pm, the 2nd drop, 3pcs").is_empty());
        let ev = vec![r#"{"code":"LIVE20","id":"p007","sizes":["S","M","L","XL","2XL"],"link":"lk-p009"}"#.to_string()];
        for reply in ["Use live20!", "p007 is back", "2XL is in", "p009 too"] {
            assert!(unsupported_figures(reply, &ev).is_empty(), "{reply}");
        }
        assert_eq!(size_labels("do you have 4XL or 3xs? not XL, LIVE20"), ["4XL", "3xs"]);
        let asked = [ev[0].clone(), size_labels("got it in 4XL?").join(" ")];
        assert!(unsupported_figures("Sorry, it doesn't come in 4XL.", &asked).is_empty());
        // An invented code, a size the evidence does not list, and a code the evidence only has inside a word.
        for (reply, code) in [("Use SAVE50 now", "SAVE50"), ("有4XL码", "4XL"), ("use VE20", "VE20")] {
            let bad = unsupported_figures(reply, &ev);
            assert_eq!((bad.len(), bad[0].kind, bad[0].text.as_str()), (1, FigureKind::Code, code), "{reply}");
        }
    }

    #[test]
    fn evidence_supports_equal_values_in_any_form() {
        let ev = vec![
            r#"{"price":79,"currency":"CNY","sizes":["36","37"],"valid_until":"2026-12-31T23:59:59+08:00"}"#
                .to_string(),
        ];
        for reply in ["¥79", "79 CNY", "79.0 yuan", "79元", "size 37", "until Dec 31", "2026-12-31", "12月31日"] {
            assert!(unsupported_figures(reply, &ev).is_empty(), "{reply}");
        }
        assert_eq!(unsupported_figures("¥89", &ev)[0].text, "¥89");
        let zh = vec!["全场8折".to_string()];
        assert!(unsupported_figures("20% off today", &zh).is_empty());
        let pct = vec![r#"{"discount":{"type":"percent","value":20}}"#.to_string()];
        assert!(unsupported_figures("今天8折", &pct).is_empty());
        assert!(!unsupported_figures("今天7折", &pct).is_empty());
        let hours = vec!["09:00-22:00 daily".to_string()];
        assert!(unsupported_figures("we're here until 10pm", &hours).is_empty());
        assert!(!unsupported_figures("we're here until 11pm", &hours).is_empty());
        let big = vec!["{\"viewers\": 12873}".to_string()];
        assert!(unsupported_figures("12,873 of you are watching", &big).is_empty());
    }
}
