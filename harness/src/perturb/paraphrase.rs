//! The template paraphrase bank: word and phrase substitutions that keep meaning, sentence frames, and the
//! naming banks for skills and tools. Deterministic given the [`Rng`]; no model involved.

use std::sync::LazyLock;

use regex::Regex;

use super::Rng;

/// Phrase → equivalent phrases. Matched case-insensitively on word boundaries; the first letter's case is kept.
const PHRASES: &[(&str, &[&str])] = &[
    ("do not", &["don't", "never"]),
    ("never", &["do not ever", "under no circumstances"]),
    ("if", &["when", "in case"]),
    ("only", &["solely", "just"]),
    ("say", &["tell the viewer", "state"]),
    ("ask", &["invite", "request"]),
    ("keep", &["hold", "leave"]),
    ("answer", &["reply", "respond"]),
    ("viewer", &["audience member", "viewer in chat"]),
    ("questions", &["queries", "asks"]),
    ("plainly", &["clearly", "simply"]),
    ("point to", &["highlight", "mention"]),
    ("instead", &["rather", "in its place"]),
    ("light", &["casual", "easy-going"]),
    ("warmly", &["kindly", "with warmth"]),
    ("short", &["brief", "compact"]),
    ("offer", &["propose", "suggest"]),
    ("politely", &["courteously", "kindly"]),
    ("help", &["assist", "support"]),
    ("check", &["verify", "look up"]),
    ("whether", &["if"]),
];

/// Sentence frames for a rule or description; `{}` is the original with its first letter lower-cased.
const RULE_FRAMES: &[&str] =
    &["Always remember: {}", "Rule of thumb: {}", "Important: {}", "As a host, {}", "Keep in mind: {}"];
const SKILL_DESCRIPTION_FRAMES: &[&str] = &[
    "Use this skill for {}",
    "Covers {}",
    "Pick this when the comment is about {}",
    "Guidance for {}",
    "Handles viewer comments on {}",
];
const TOOL_DESCRIPTION_FRAMES: &[&str] =
    &["{}", "Use it for this: {}", "What it returns: {}", "Live data tool. {}", "{} Call it when the answer depends on it."];
/// Parameter descriptions; `{}` is the parameter name in words.
const PARAMETER_FRAMES: &[&str] = &[
    "The {} to use.",
    "Which {} the call is about.",
    "{} (as given by the viewer or a previous tool result).",
    "Value for the {}.",
    "The {} in question.",
];

/// Word → synonyms for building new skill and tool names.
const NAME_WORDS: &[(&str, &[&str])] = &[
    ("get", &["fetch", "lookup", "read"]),
    ("product", &["item", "goods", "article"]),
    ("products", &["items", "catalog", "goods"]),
    ("list", &["show", "browse", "all"]),
    ("promotions", &["deals", "offers", "discounts"]),
    ("check", &["query", "lookup", "inspect"]),
    ("stock", &["inventory", "availability"]),
    ("search", &["find", "match", "seek"]),
    ("policy", &["terms", "rules", "info"]),
    ("shipping", &["delivery", "postage", "freight"]),
    ("after", &["post"]),
    ("sales", &["purchase", "order"]),
    ("room", &["stream", "live", "session"]),
    ("status", &["state", "now", "info"]),
    ("price", &["pricing", "cost"]),
    ("size", &["sizing", "measure"]),
    ("fit", &["fitting", "cut"]),
    ("details", &["facts", "specs", "info"]),
    ("greetings", &["hellos", "welcome"]),
    ("chitchat", &["smalltalk", "banter"]),
    ("negative", &["unhappy", "critical"]),
    ("feedback", &["comments", "complaints"]),
];

static WORD_RE: LazyLock<Vec<(Regex, &'static [&'static str])>> = LazyLock::new(|| {
    PHRASES
        .iter()
        .map(|(p, alts)| (Regex::new(&format!(r"(?i)\b{}\b", regex::escape(p))).expect("valid phrase regex"), *alts))
        .collect()
});

/// Backticked spans and `[...]` markers: never touched by a paraphrase.
static PROTECTED: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"`[^`]*`|\[[^\]]*\]").expect("valid regex"));

fn lower_first(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) if f.is_uppercase() && !c.clone().next().is_some_and(char::is_uppercase) => {
            f.to_lowercase().chain(c).collect()
        }
        _ => s.to_string(),
    }
}

fn upper_first(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

fn with_case_of(original: &str, replacement: &str) -> String {
    if original.chars().next().is_some_and(char::is_uppercase) { upper_first(replacement) } else { replacement.into() }
}

/// Whether `rewrite` may stand for `original` (a model's paraphrase): one line of prose, of comparable length,
/// keeping every backticked name, `[marker]` and figure of the original; `Err` says what it broke.
pub fn acceptable_rewrite(original: &str, rewrite: &str) -> Result<(), String> {
    static FIGURE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\d+(?:[.,:]\d+)*").expect("valid regex"));
    if rewrite.is_empty() {
        return Err("empty".into());
    }
    if rewrite.contains('\n') || rewrite.contains('<') {
        return Err("not one line of prose".into());
    }
    let (n, m) = (original.chars().count(), rewrite.chars().count());
    if m * 3 < n || m > 3 * n + 40 {
        return Err(format!("{m} characters for a {n}-character original"));
    }
    if rewrite == original {
        return Err("unchanged".into());
    }
    for token in PROTECTED.find_iter(original).chain(FIGURE.find_iter(original)) {
        if !rewrite.contains(token.as_str()) {
            return Err(format!("drops `{}`", token.as_str().trim_matches('`')));
        }
    }
    // Same subject: a quarter of the original's content words (4+ letters) stay, so a refusal or an answer to
    // some other question ("Sorry, I can't do that") is not taken for a paraphrase.
    let words = |t: &str| -> Vec<String> {
        t.split(|c: char| !c.is_alphabetic()).filter(|w| w.chars().count() >= 4).map(str::to_lowercase).collect()
    };
    let kept: Vec<String> = words(rewrite);
    let content = words(original);
    let shared = content.iter().filter(|w| kept.contains(w)).count();
    if !content.is_empty() && shared * 4 < content.len().max(4) {
        return Err(format!("keeps {shared} of the original's {} content words", content.len()));
    }
    Ok(())
}

/// Substitute up to `max` bank phrases in `text` (outside backticks and brackets).
pub fn substitute(rng: &mut Rng, text: &str, max: usize) -> String {
    let mut out = text.to_string();
    let mut order: Vec<usize> = (0..WORD_RE.len()).collect();
    rng.shuffle(&mut order);
    let mut done = 0;
    for i in order {
        if done >= max {
            break;
        }
        let (re, alts) = &WORD_RE[i];
        let protected: Vec<(usize, usize)> = PROTECTED.find_iter(&out).map(|m| (m.start(), m.end())).collect();
        let Some(m) = re.find_iter(&out).find(|m| !protected.iter().any(|&(s, e)| m.start() < e && m.end() > s)) else {
            continue;
        };
        let choice: &str = rng.pick::<&str>(alts);
        let alt = with_case_of(m.as_str(), choice);
        out = format!("{}{}{}", &out[..m.start()], alt, &out[m.end()..]);
        done += 1;
    }
    out
}

fn frame(rng: &mut Rng, frames: &[&str], text: &str) -> String {
    rng.pick(frames).replace("{}", &lower_first(text.trim()))
}

/// A paraphrase of a rule's text (never equal to it).
pub fn rule(rng: &mut Rng, text: &str) -> String {
    let mut out = substitute(rng, text, 2);
    if out == text || rng.chance(0.4) {
        out = frame(rng, RULE_FRAMES, &out);
    }
    out
}

/// A rewritten skill description (never equal to it). A trailing period is kept off the frame.
pub fn skill_description(rng: &mut Rng, text: &str) -> String {
    let core = text.trim().trim_end_matches('.');
    let substituted = substitute(rng, core, 1);
    let out = format!("{}.", frame(rng, SKILL_DESCRIPTION_FRAMES, &substituted));
    if out == text { format!("Covers {}.", lower_first(core)) } else { out }
}

/// A rewritten tool description (never equal to it).
pub fn tool_description(rng: &mut Rng, text: &str) -> String {
    let mut out = substitute(rng, text.trim(), 2);
    let framed = frame(rng, TOOL_DESCRIPTION_FRAMES, &out);
    if framed != out {
        out = upper_first(&framed);
    }
    if out == text { format!("Use it for this: {}", lower_first(text)) } else { out }
}

/// A description for a parameter called `name` (e.g. `product_id` → "The product id to use.").
pub fn parameter_description(rng: &mut Rng, name: &str, current: Option<&str>) -> String {
    let words = name.replace('_', " ");
    let out = upper_first(&frame(rng, PARAMETER_FRAMES, &words));
    if Some(out.as_str()) == current { format!("The {words} (see the tool description).") } else { out }
}

/// A new snake_case or kebab-case name from `name` (`sep` `_` or `-`): words swapped for synonyms, or, when no
/// word has one, a qualifier added. Never equal to `name`.
pub fn new_name(rng: &mut Rng, name: &str, sep: char) -> String {
    let words: Vec<&str> = name.split(sep).collect();
    let mut out: Vec<String> = words
        .iter()
        .map(|w| match NAME_WORDS.iter().find(|(k, _)| k == w) {
            Some((_, alts)) if rng.chance(0.7) => rng.pick(alts).to_string(),
            _ => w.to_string(),
        })
        .collect();
    if out.join(&sep.to_string()) == name {
        let qualifiers = ["live", "shop", "host", "desk", "info"];
        let q = rng.pick(&qualifiers).to_string();
        if rng.chance(0.5) { out.insert(0, q) } else { out.push(q) }
    }
    out.join(&sep.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paraphrases_change_text_but_never_backticks_or_markers() {
        let mut rng = Rng::new(3);
        for _ in 0..50 {
            let t = "Never say `check_stock` if [show_product:p007] is only for the viewer.";
            let p = rule(&mut rng, t);
            assert_ne!(p, t);
            assert!(p.contains("`check_stock`") && p.contains("[show_product:p007]"), "{p}");
        }
    }

    #[test]
    fn model_rewrites_must_keep_protected_tokens_and_stay_prose() {
        let t = "Stock of one `check_stock` variant, 3 sizes [show_product:p007].";
        assert!(acceptable_rewrite(t, "How many of a variant are left: `check_stock`, 3 sizes [show_product:p007].").is_ok());
        assert!(acceptable_rewrite(t, "How many are left [show_product:p007], 3 sizes.").unwrap_err().contains("check_stock"));
        assert!(acceptable_rewrite(t, "Left in stock via `check_stock`, sizes [show_product:p007].").unwrap_err().contains("3"));
        assert!(acceptable_rewrite(t, "<tool_call>`check_stock` 3 [show_product:p007]").is_err());
        assert!(acceptable_rewrite(t, "").is_err());
        let d = "What a product is made of, materials, fabric, colors, features, care and washing.";
        assert!(acceptable_rewrite(d, "Sorry, I can't do that, but ask me about any product!").unwrap_err().contains("content words"));
        assert!(acceptable_rewrite(d, "Materials and fabric of a product, its colors, features and washing care.").is_ok());
        assert!(acceptable_rewrite(t, t).is_err());
    }

    #[test]
    fn new_names_differ_and_keep_the_separator_shape() {
        let mut rng = Rng::new(9);
        for name in ["get_product", "room_status", "zzz_qqq"] {
            for _ in 0..20 {
                let n = new_name(&mut rng, name, '_');
                assert_ne!(n, name);
                assert!(n.contains('_') && n.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{n}");
            }
        }
    }
}
