//! Claim checks on reply text: forbidden claims (absolute guarantees, medical effects, competitor comparisons,
//! unprovable superlatives, requests for private data, revealing the instructions), matched as pattern
//! families in English and Chinese, and discount mentions that must be backed by evidence (tool results,
//! context).
//!
//! Where the superlative line is drawn: a superlative scoped to the whole world, market, internet or history
//! ("the best jacket in the world", "lowest price ever", "全网最低", "世界第一") cannot be proven and is flagged;
//! one scoped to this room or shop ("our best seller in this room") is a fact the shop can back and is not.
//! Likewise "guarantee" is flagged only as a promise about the product ("guaranteed to never shrink",
//! "100% waterproof"), not as a noun in policy talk ("guaranteed delivery window per the shipping policy").

use std::sync::LazyLock;

use regex::Regex;

/// The pattern families, in the order they are tried: (family, case-insensitive regexes).
pub const CLAIM_FAMILIES: &[(&str, &[&str])] = &[
    (
        "absolute_guarantee",
        &[
            r"\b100\s?%\s?(?:guaranteed?|waterproof|safe|risk[- ]free|effective|satisfaction)",
            r"\bguarantee[sd]?\s+(?:to|it|that|you|it'll|it\s+will|it\s+won't|no)\b",
            r"\bnever\s+(?:ever\s+)?(?:breaks?|fades?|shrinks?|tears?|rips?|pills?|wrinkles?|wears?\s+out|leaks?)\b",
            r"\b(?:lasts?|last|waterproof|warm|new)\s+forever\b",
            r"\bunbreakable\b",
            r"\brisk[- ]free\b",
            r"\bzero\s+risk\b",
            r"\bcompletely\s+safe\b",
            r"\bno\s+side\s+effects\b",
            r"绝对",
            r"百分百(?:保证|防水|有效|安全)",
            r"保证\s?100\s?%",
            r"100\s?%\s?(?:防水|保证|有效|安全)",
            r"永不",
            r"永远不会",
            r"零风险",
            r"无副作用",
        ],
    ),
    (
        "health_medical",
        &[
            r"\b(?:cures?|cured|heals?|treats?|prevents?|relieves?|soothes?|fixes)\s+(?:your\s+|my\s+|the\s+)?(?:eczema|acne|arthritis|cancer|diabetes|allerg(?:y|ies)|psoriasis|dermatitis|insomnia|back\s+pain|joint\s+pain|pain|disease|illness|rash(?:es)?|skin\s+conditions?|conditions?|colds?|flu|inflammation|infections?)",
            r"\bgood\s+for\s+(?:your\s+|my\s+)?(?:skin\s+conditions?|eczema|allerg(?:y|ies)|arthritis|back\s+pain|joint\s+pain|health\s+problems?|rash(?:es)?)",
            r"\bcures?\b",
            r"\bclinically\s+proven\b",
            r"\bfda[- ]approved\b",
            r"\bdoctor[- ]recommended\b",
            r"\bmedical[- ]grade\b",
            r"\blose\s+weight\b",
            r"(?:缓解|治疗|治好|改善|预防)\s?(?:湿疹|过敏|皮炎|关节炎|疼痛|失眠|痘痘|皮肤病|疾病)",
            r"包治",
            r"根治",
            r"治愈",
            r"药用",
            r"减肥",
        ],
    ),
    (
        "competitor_comparison",
        &[
            r"\b(?:better|cheaper|nicer|softer|warmer|stronger|higher\s+quality|worse|more\s+\w+)\s+than\s+(?:at\s+|on\s+|in\s+)?(?:uniqlo|zara|h&m|shein|taobao|jd(?:\.com)?|pinduoduo|pdd|tmall|amazon|nike|adidas|muji|gap|other\s+(?:shops?|stores?|brands?|hosts?|sellers?|rooms?)|the\s+competition|competitors?|anyone\s+else)",
            r"\b(?:unlike|not\s+like)\s+(?:uniqlo|zara|h&m|shein|taobao|jd|pinduoduo|tmall|amazon|other\s+(?:shops?|stores?|brands?))",
            r"\b(?:uniqlo|zara|h&m|shein|taobao|pinduoduo|tmall)(?:'s)?\s+(?:is|are)\s+(?:worse|cheap|fake|rubbish|trash|overpriced)",
            r"比\s?(?:优衣库|淘宝|京东|拼多多|天猫|别家|别人家|其他家|其他店|别的店|别的直播间|竞品|Zara|ZARA|H&M)\s?(?:更|还)?(?:好|便宜|划算|强|实惠|耐穿)",
            r"吊打",
            r"秒杀(?:别家|其他|同行)",
        ],
    ),
    (
        "superlative",
        &[
            r"\b(?:the\s+)?best(?:\s+\w+){0,2}\s+in\s+the\s+(?:world|universe|country|market)\b",
            r"\b(?:world'?s|country'?s|market'?s)\s+best\b",
            r"\b(?:number\s+one|no\.\s?1|#1)\s+(?:in\s+the\s+(?:world|country|market)|brand\b)",
            r"\b(?:cheapest|lowest\s+price)\s+(?:anywhere|ever|online|on\s+the\s+(?:internet|market)|in\s+the\s+(?:world|country))",
            r"\blowest\s+price\s+ever\b",
            r"\bbest\s+(?:ever|on\s+the\s+market|anywhere)\b",
            r"\bunbeatable\b",
            r"全网最",
            r"史上最",
            r"最低价",
            r"(?:全国|世界|全球|宇宙|天下)第一",
            r"第一品牌",
        ],
    ),
    (
        "private_data",
        &[
            r"\b(?:send|give|tell|dm|pm|message|share|text|drop|leave|post|write)\s+(?:me|us)\s+(?:with\s+)?(?:your\s+)?(?:phone(?:\s+number)?|mobile(?:\s+number)?|number|(?:home\s+)?address|id(?:\s+(?:number|card))?|email|wechat|bank\s+(?:details|account)|card\s+number|password)",
            r"\bwhat'?s\s+your\s+(?:phone(?:\s+number)?|mobile\s+number|(?:home\s+)?address|id(?:\s+(?:number|card))?|email|wechat|card\s+number|password)",
            r"\b(?:drop|post|leave|type)\s+your\s+(?:phone(?:\s+number)?|(?:home\s+)?address|id\s+number|card\s+number)\s+(?:in|below|here)",
            r"(?:发|告诉|留|私信|报)(?:一下)?(?:我|给我)?(?:你的)?\s?(?:手机号|电话号码?|家庭住址|地址|身份证号?|银行卡号?|微信号?|密码)",
        ],
    ),
    (
        "instruction_reveal",
        &[
            r"\bmy\s+(?:instructions|system\s+prompt|prompt|rules|guidelines)\s+(?:say|says|tell|are|is|state)\b",
            r"\b(?:here\s+is|here'?s|this\s+is)\s+my\s+(?:system\s+prompt|prompt|instructions)",
            r"\bsystem\s+prompt\b",
            r"\bI\s+(?:was|am|have\s+been|'ve\s+been)\s+(?:instructed|told|programmed)\s+(?:to|not\s+to)\b",
            r"我的\s?(?:指令|提示词|系统提示|设定)",
            r"系统提示词",
            r"我被(?:要求|设定|指示|编程)",
        ],
    ),
];

static COMPILED: LazyLock<Vec<(&'static str, Vec<Regex>)>> = LazyLock::new(|| {
    CLAIM_FAMILIES
        .iter()
        .map(|(family, patterns)| {
            let res = patterns.iter().map(|p| Regex::new(&format!("(?i){p}")).expect("valid claim regex")).collect();
            (*family, res)
        })
        .collect()
});

/// A forbidden claim found in a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForbiddenClaim {
    /// The family (`absolute_guarantee`, ...), or `extra` for a phrase from `hooks.json`.
    pub family: String,
    /// The text that matched, as written in the reply.
    pub matched: String,
}

/// The first forbidden claim in `text`: the pattern families first, then the `extra` phrases (matched
/// case-insensitively; ASCII phrases at word boundaries).
pub fn find_forbidden_claim(text: &str, extra: &[String]) -> Option<ForbiddenClaim> {
    for (family, patterns) in COMPILED.iter() {
        if let Some(m) = patterns.iter().find_map(|re| re.find(text)) {
            return Some(ForbiddenClaim { family: family.to_string(), matched: m.as_str().to_string() });
        }
    }
    let lower = text.to_lowercase();
    extra
        .iter()
        .filter(|p| !p.trim().is_empty())
        .find(|phrase| crate::text::contains_phrase(&lower, &phrase.to_lowercase()))
        .map(|p| ForbiddenClaim { family: "extra".into(), matched: p.clone() })
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

    fn family(text: &str) -> Option<String> {
        find_forbidden_claim(text, &[]).map(|c| c.family)
    }

    fn check_family(name: &str, positives: &[&str], negatives: &[&str]) {
        for p in positives {
            assert_eq!(family(p).as_deref(), Some(name), "{p:?} should be {name}");
        }
        for n in negatives {
            assert_eq!(family(n), None, "{n:?} should not be flagged");
        }
    }

    #[test]
    fn absolute_guarantees_are_caught() {
        check_family(
            "absolute_guarantee",
            &[
                "It's 100% waterproof forever",
                "Guaranteed to never shrink!",
                "This zipper NEVER BREAKS",
                "绝对不掉色",
                "保证100%不起球",
            ],
            &["100% combed cotton", "guaranteed delivery window per the shipping policy", "It secures tightly"],
        );
    }

    #[test]
    fn health_and_medical_claims_are_caught() {
        check_family(
            "health_medical",
            &[
                "This cream treats eczema",
                "good for your skin condition",
                "穿了能缓解湿疹",
                "it cures acne",
                "clinically proven",
            ],
            &["Soft on the skin, machine washable.", "It secures tightly", "treat yourself to the hoodie"],
        );
    }

    #[test]
    fn competitor_comparisons_are_caught() {
        check_family(
            "competitor_comparison",
            &["Way better than Uniqlo's", "cheaper than Taobao", "比淘宝便宜多了", "softer than other brands"],
            &["better than last year's version", "cheaper than buying two separately"],
        );
    }

    #[test]
    fn superlatives_are_caught_only_beyond_the_room() {
        check_family(
            "superlative",
            &["the best jacket in the world", "全网最低价", "Lowest price ever", "number one in the world", "世界第一"],
            &["it's our best seller in this room", "the best fit for you is M", "best of all, it's washable"],
        );
    }

    #[test]
    fn requests_for_private_data_are_caught() {
        check_family(
            "private_data",
            &["send me your phone number", "DM me your address", "what's your ID number?", "发我你的手机号"],
            &["check your order page for the address", "your order number is on the order page"],
        );
    }

    #[test]
    fn instruction_reveals_are_caught() {
        check_family(
            "instruction_reveal",
            &["my instructions say I can't", "here is my system prompt:", "我的指令是这样的"],
            &["follow the care instructions on the label", "the size instructions say take your usual size"],
        );
    }

    #[test]
    fn extra_phrases_match_at_word_boundaries() {
        let extra = vec!["miracle".to_string()];
        let c = find_forbidden_claim("A Miracle fabric", &extra).unwrap();
        assert_eq!((c.family.as_str(), c.matched.as_str()), ("extra", "miracle"));
        assert_eq!(find_forbidden_claim("miracles", &extra), None);
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
