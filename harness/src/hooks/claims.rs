//! Claim checks on reply text: forbidden phrases (absolute guarantees, medical claims, superlatives banned in
//! live-commerce advertising) and discount mentions that must be backed by evidence (tool results, context).

/// Phrases a live host may not say (case-insensitive; ASCII phrases match at word boundaries).
pub const DEFAULT_FORBIDDEN_CLAIMS: &[&str] = &[
    "100% guaranteed",
    "100% guarantee",
    "guaranteed to",
    "guarantee it will",
    "never breaks",
    "never break",
    "never fades",
    "unbreakable",
    "lasts forever",
    "risk-free",
    "zero risk",
    "100% safe",
    "completely safe",
    "no side effects",
    "cures",
    "cure your",
    "heals",
    "clinically proven",
    "fda approved",
    "doctor recommended",
    "lose weight fast",
    "best in the world",
    "number one in the world",
    "cheapest anywhere",
    "lowest price ever",
    "绝对",
    "百分百保证",
    "保证100%",
    "永不",
    "永远不会",
    "包治",
    "根治",
    "治愈",
    "无副作用",
    "全网最低",
    "史上最低",
    "最低价",
    "第一品牌",
    "全国第一",
    "世界第一",
];

/// The first forbidden phrase in `text`, if any.
pub fn find_forbidden_claim<'a>(text: &str, phrases: &'a [String]) -> Option<&'a str> {
    let lower = text.to_lowercase();
    phrases
        .iter()
        .map(String::as_str)
        .filter(|p| !p.trim().is_empty())
        .find(|phrase| crate::text::contains_phrase(&lower, &phrase.to_lowercase()))
}

/// A discount the text mentions.
#[derive(Debug, Clone, PartialEq)]
pub enum DiscountMention {
    /// `20% off`, `save 15 percent`, `优惠20%`.
    Percent(f64),
    /// `8折`, `8.5折` (pay 80 % / 85 %).
    Zhe(f64),
    /// `$10 off`, `10 yuan off`, `立减10`, `减10元`.
    AmountOff(f64),
    /// `half price`, `半价`.
    Half,
    /// `buy one get one`, `BOGO`, `买一送一`.
    Bogo,
}

impl DiscountMention {
    /// The text to quote in a reason.
    pub fn describe(&self) -> String {
        let n = |x: &f64| if x.fract() == 0.0 { format!("{}", *x as i64) } else { format!("{x}") };
        match self {
            DiscountMention::Percent(p) => format!("{}%", n(p)),
            DiscountMention::Zhe(z) => format!("{}折", n(z)),
            DiscountMention::AmountOff(a) => format!("{} off", n(a)),
            DiscountMention::Half => "half price".into(),
            DiscountMention::Bogo => "buy one get one".into(),
        }
    }
}

const DISCOUNT_WORDS: &[&str] = &[
    "off",
    "discount",
    "sale",
    "save",
    "saving",
    "coupon",
    "promo",
    "promotion",
    "deal",
    "cheaper",
    "reduced",
    "markdown",
    "rebate",
    "折",
    "优惠",
    "减",
    "省",
    "券",
    "便宜",
    "特价",
    "促销",
    "满",
];

/// A number in `chars` starting at `i`: (value, index after it).
fn number_at(chars: &[char], i: usize) -> Option<(f64, usize)> {
    let mut j = i;
    while j < chars.len() && (chars[j].is_ascii_digit() || (chars[j] == '.' && j > i)) {
        j += 1;
    }
    if j > i && chars[j - 1] == '.' {
        j -= 1;
    }
    let s: String = chars[i..j].iter().collect();
    s.parse().ok().map(|v| (v, j))
}

fn window(chars: &[char], from: usize, to: usize) -> String {
    chars[from.min(chars.len())..to.min(chars.len())].iter().collect::<String>().to_lowercase()
}

fn has_discount_word(text: &str) -> bool {
    DISCOUNT_WORDS.iter().any(|w| {
        if w.is_ascii() && w.chars().all(|c| c.is_ascii_alphabetic()) {
            text.split(|c: char| !c.is_ascii_alphanumeric()).any(|tok| tok == *w || tok.starts_with(w) && *w != "off")
        } else {
            text.contains(w)
        }
    })
}

/// Every discount `text` mentions. A percentage counts only next to a discount word (so `100% cotton` does not).
pub fn discount_mentions(text: &str) -> Vec<DiscountMention> {
    let chars: Vec<char> = text.chars().collect();
    let lower = text.to_lowercase();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let starts_number =
            chars[i].is_ascii_digit() && (i == 0 || !(chars[i - 1].is_ascii_alphanumeric() || chars[i - 1] == '.'));
        if !starts_number {
            i += 1;
            continue;
        }
        let Some((value, end)) = number_at(&chars, i) else {
            i += 1;
            continue;
        };
        let after = window(&chars, end, end + 16);
        let before = window(&chars, i.saturating_sub(16), i);
        let after_trim = after.trim_start();
        if after_trim.starts_with('%') || after_trim.starts_with("percent") {
            let skipped = after.chars().count() - after_trim.chars().count();
            let pct_end = end + skipped + if after_trim.starts_with('%') { 1 } else { "percent".len() };
            let context = format!("{before} {}", window(&chars, pct_end, pct_end + 16));
            if has_discount_word(&context) {
                out.push(DiscountMention::Percent(value));
            }
        } else if after_trim.starts_with('折') && value > 0.0 && value < 10.0 {
            out.push(DiscountMention::Zhe(value));
        } else if after.split_whitespace().take(3).any(|w| w.trim_matches(|c: char| !c.is_alphanumeric()) == "off")
            || before.trim_end().ends_with('减')
            || before.trim_end().ends_with("立减")
            || before.trim_end().ends_with("省")
        {
            out.push(DiscountMention::AmountOff(value));
        }
        i = end.max(i + 1);
    }
    if lower.contains("half price")
        || lower.contains("half off")
        || lower.contains("half-price")
        || text.contains("半价")
    {
        out.push(DiscountMention::Half);
    }
    if lower.contains("buy one get one")
        || lower.contains("buy 1 get 1")
        || lower.contains("bogo")
        || text.contains("买一送一")
    {
        out.push(DiscountMention::Bogo);
    }
    out
}

/// Numbers in `text` that appear near a discount word (the evidence side is lenient: tool results are JSON
/// such as `{"type": "percent_off", "value": 20}`).
fn discount_numbers(text: &str) -> Vec<f64> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i].is_ascii_digit()
            && (i == 0 || !(chars[i - 1].is_ascii_alphanumeric() || chars[i - 1] == '.'))
            && let Some((value, end)) = number_at(&chars, i)
        {
            let context = format!("{} {}", window(&chars, i.saturating_sub(40), i), window(&chars, end, end + 40));
            let next = window(&chars, end, end + 2);
            if has_discount_word(&context) || next.trim_start().starts_with(['%', '折']) {
                out.push(value);
            }
            i = end;
            continue;
        }
        i += 1;
    }
    out
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

/// Whether `mention` is backed by the evidence texts.
pub fn discount_supported(mention: &DiscountMention, evidence: &[String]) -> bool {
    let all = evidence.join("\n");
    let mentioned = discount_mentions(&all);
    let numbers = discount_numbers(&all);
    let has_number = |x: f64| numbers.iter().any(|&n| close(n, x));
    match *mention {
        DiscountMention::Percent(p) => {
            has_number(p)
                || mentioned.iter().any(|m| matches!(m, DiscountMention::Zhe(z) if close(100.0 - z * 10.0, p)))
                || numbers.iter().any(|&n| n > 0.0 && n < 1.0 && close(((1.0 - n) * 100.0).round(), p))
                || (close(p, 50.0) && mentioned.contains(&DiscountMention::Half))
        }
        DiscountMention::Zhe(z) => {
            mentioned.iter().any(|m| matches!(m, DiscountMention::Zhe(e) if close(*e, z)))
                || mentioned.iter().any(|m| matches!(m, DiscountMention::Percent(p) if close(100.0 - z * 10.0, *p)))
                || numbers.iter().any(|&n| n > 0.0 && n < 1.0 && close(n * 10.0, z))
        }
        DiscountMention::AmountOff(a) => has_number(a),
        DiscountMention::Half => {
            mentioned.contains(&DiscountMention::Half)
                || mentioned.iter().any(|m| matches!(m, DiscountMention::Percent(p) if close(*p, 50.0)))
                || mentioned.iter().any(|m| matches!(m, DiscountMention::Zhe(z) if close(*z, 5.0)))
        }
        DiscountMention::Bogo => mentioned.contains(&DiscountMention::Bogo),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Vec<String> {
        DEFAULT_FORBIDDEN_CLAIMS.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn forbidden_phrases_match_case_insensitively_at_word_boundaries() {
        let p = defaults();
        assert_eq!(find_forbidden_claim("This zipper NEVER BREAKS, trust me", &p), Some("never breaks"));
        assert_eq!(find_forbidden_claim("It's 100% guaranteed!", &p), Some("100% guaranteed"));
        assert_eq!(find_forbidden_claim("这款面霜绝对有效", &p), Some("绝对"));
        assert_eq!(find_forbidden_claim("It secures tightly", &p), None, "`cures` inside `secures`");
        assert_eq!(find_forbidden_claim("Soft cotton, machine washable.", &p), None);
    }

    #[test]
    fn discount_mentions_need_discount_context() {
        assert_eq!(discount_mentions("20% off today"), vec![DiscountMention::Percent(20.0)]);
        assert_eq!(discount_mentions("save 15 percent now"), vec![DiscountMention::Percent(15.0)]);
        assert_eq!(discount_mentions("100% cotton, size M"), vec![]);
        assert_eq!(discount_mentions("今天8.5折"), vec![DiscountMention::Zhe(8.5)]);
        assert_eq!(discount_mentions("$10 off with the coupon"), vec![DiscountMention::AmountOff(10.0)]);
        assert_eq!(discount_mentions("下单立减30元"), vec![DiscountMention::AmountOff(30.0)]);
        assert_eq!(discount_mentions("Half price for fans!"), vec![DiscountMention::Half]);
        assert_eq!(discount_mentions("It costs 199 and ships in 2 days"), vec![]);
    }

    #[test]
    fn evidence_backs_equivalent_forms() {
        let ev = vec![
            r#"{"promotions": [{"type": "percent_off", "value": 20}, {"coupon": "FANS10", "amount_off": 10}]}"#
                .to_string(),
        ];
        assert!(discount_supported(&DiscountMention::Percent(20.0), &ev));
        assert!(discount_supported(&DiscountMention::AmountOff(10.0), &ev));
        assert!(!discount_supported(&DiscountMention::Percent(30.0), &ev));
        assert!(!discount_supported(&DiscountMention::Half, &ev));
        let zh = vec!["全场8折".to_string()];
        assert!(discount_supported(&DiscountMention::Percent(20.0), &zh));
        assert!(discount_supported(&DiscountMention::Zhe(8.0), &zh));
        let price_only = vec![r#"{"price": 20, "stock": 30}"#.to_string()];
        assert!(!discount_supported(&DiscountMention::Percent(20.0), &price_only), "a price is not a discount");
    }
}
