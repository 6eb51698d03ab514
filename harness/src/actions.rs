//! Actions for the avatar, and sentences for TTS.
//!
//! The model may end its reply with action markers that the front end turns into on-screen actions:
//!
//! ```text
//! The puffer is 20% off right now, grab it below! [show_product:p007] [show_coupon:LIVE20]
//! ```
//!
//! - `[show_product:ID]` pins the product `ID` (an id a tool result or the room data showed, e.g. `p007`).
//! - `[show_coupon:CODE]` shows the coupon `CODE` (a code a tool result or the room data showed).
//!
//! [`parse_actions`] splits a reply into the speech (markers removed) and the marks; [`resolve_actions`] keeps
//! only marks whose id the evidence shows ([`KnownIds::from_evidence`]), so the avatar never shows a product or
//! coupon no tool returned. Markers are not speech: grounding and length hooks check the speech only.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    ShowProduct,
    ShowCoupon,
}

/// One marker as the model wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionMark {
    pub kind: ActionKind,
    pub id: String,
    /// The marker as written, e.g. `[show_product:p007]`.
    pub text: String,
}

/// A resolved action for the avatar: `{"type":"show_product","product_id":"p007","link_id":"lk-p007"}` or
/// `{"type":"show_coupon","code":"LIVE20"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Action {
    ShowProduct {
        product_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        link_id: Option<String>,
    },
    ShowCoupon {
        code: String,
    },
}

/// A mark left out, and why (for the trace).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DroppedAction {
    /// The marker as written.
    pub text: String,
    pub reason: String,
}

/// `[show_product:ID]` / `[show_coupon:CODE]`; spaces allowed around the colon, ids are `[A-Za-z0-9_-]+`.
static MARKER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\[\s*(show_product|show_coupon)\s*:\s*([A-Za-z0-9_\-]+)\s*\]").expect("valid marker regex")
});

/// Whether `text` holds an action marker (hooks that look for tool syntax ignore these).
pub fn has_action_markers(text: &str) -> bool {
    MARKER.is_match(text)
}

/// The reply without its markers (whitespace tidied), and the marks in order.
pub fn parse_actions(reply: &str) -> (String, Vec<ActionMark>) {
    let marks = MARKER
        .captures_iter(reply)
        .map(|c| ActionMark {
            kind: if &c[1] == "show_product" { ActionKind::ShowProduct } else { ActionKind::ShowCoupon },
            id: c[2].to_string(),
            text: c[0].to_string(),
        })
        .collect();
    (strip_markers(reply), marks)
}

/// `reply` with markers removed, runs of spaces collapsed and no space left before punctuation.
pub fn strip_markers(reply: &str) -> String {
    if !has_action_markers(reply) {
        return reply.to_string();
    }
    let removed = MARKER.replace_all(reply, " ");
    let lines: Vec<String> = removed.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
    let mut out = lines.join("\n").trim().to_string();
    for p in [" .", " ,", " !", " ?", " 。", " ，", " ！", " ？"] {
        out = out.replace(p, &p[1..]);
    }
    out
}

/// The product ids (with link ids when known) and coupon codes the evidence shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KnownIds {
    pub products: BTreeMap<String, Option<String>>,
    pub coupons: BTreeSet<String>,
}

static PRODUCT_ID: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^p\d+$").expect("valid id regex"));

impl KnownIds {
    /// Scan every evidence text that parses as JSON (tool results, room data), at any depth: objects with an
    /// `id` like `p007` or a `product_id` (and a `link_id`) are products; objects with a `code` are coupons;
    /// `current_product_id` and `ongoing_promotion` (a code or an object with one) count too. Texts that are not
    /// JSON are skipped: ids in prose are not trusted.
    pub fn from_evidence(evidence: &[String]) -> KnownIds {
        let mut known = KnownIds::default();
        for text in evidence {
            if let Ok(v) = serde_json::from_str::<Value>(text.trim()) {
                known.scan(&v);
            }
        }
        known
    }

    fn add_product(&mut self, id: &str, link: Option<&str>) {
        let entry = self.products.entry(id.to_string()).or_default();
        if let Some(l) = link {
            *entry = Some(l.to_string());
        }
    }

    fn scan(&mut self, v: &Value) {
        match v {
            Value::Array(items) => items.iter().for_each(|i| self.scan(i)),
            Value::Object(map) => {
                let s = |k: &str| map.get(k).and_then(Value::as_str);
                let link = s("link_id");
                if let Some(id) = s("product_id") {
                    self.add_product(id, link);
                } else if let Some(id) = s("id").filter(|id| PRODUCT_ID.is_match(id)) {
                    self.add_product(id, link);
                }
                if let Some(id) = s("current_product_id") {
                    self.add_product(id, None);
                }
                if let Some(code) = s("code") {
                    self.coupons.insert(code.to_string());
                }
                if let Some(code) = s("ongoing_promotion") {
                    self.coupons.insert(code.to_string());
                }
                if let Some(codes) = map.get("promotion_codes").and_then(Value::as_array) {
                    self.coupons.extend(codes.iter().filter_map(Value::as_str).map(str::to_string));
                }
                map.values().for_each(|x| self.scan(x));
            }
            _ => {}
        }
    }
}

/// The actions whose ids the evidence shows, in order with duplicates collapsed, and the marks dropped.
/// Ids match case-sensitively for products and case-insensitively for coupon codes (codes are read aloud).
pub fn resolve_actions(marks: &[ActionMark], known: &KnownIds) -> (Vec<Action>, Vec<DroppedAction>) {
    let mut actions: Vec<Action> = Vec::new();
    let mut dropped = Vec::new();
    for m in marks {
        let action = match m.kind {
            ActionKind::ShowProduct => match known.products.get(&m.id) {
                Some(link) => Action::ShowProduct { product_id: m.id.clone(), link_id: link.clone() },
                None => {
                    let reason = format!("product `{}` is not in any tool result or room data", m.id);
                    dropped.push(DroppedAction { text: m.text.clone(), reason });
                    continue;
                }
            },
            ActionKind::ShowCoupon => match known.coupons.iter().find(|c| c.eq_ignore_ascii_case(&m.id)) {
                Some(code) => Action::ShowCoupon { code: code.clone() },
                None => {
                    let reason = format!("coupon `{}` is not in any tool result or room data", m.id);
                    dropped.push(DroppedAction { text: m.text.clone(), reason });
                    continue;
                }
            },
        };
        if !actions.contains(&action) {
            actions.push(action);
        }
    }
    (actions, dropped)
}

/// Split `text` into sentences for TTS, keeping the end punctuation: `.` `!` `?` (followed by a space or the end,
/// so `79.5` and `e.g.` stay whole), and `。` `！` `？` `~` `～` (always). Closing quotes and brackets stay with
/// their sentence.
pub fn split_sentences(text: &str) -> Vec<String> {
    const ABBREVIATIONS: &[&str] = &["e.g.", "i.e.", "etc.", "vs.", "mr.", "mrs.", "ms.", "dr.", "no.", "approx."];
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let ends = match c {
            '。' | '！' | '？' | '~' | '～' => true,
            '.' | '!' | '?' => {
                let next = chars.get(i + 1).copied();
                let at_break = next.is_none_or(|n| n.is_whitespace() || matches!(n, '"' | '\'' | ')' | '”' | '’'));
                let word: String = chars[start..=i].iter().collect::<String>();
                let last = word.split_whitespace().last().unwrap_or("").to_lowercase();
                at_break && !(c == '.' && ABBREVIATIONS.contains(&last.as_str()))
            }
            _ => false,
        };
        i += 1;
        if ends {
            // Repeated marks ("?!", "。。") and closing quotes belong to this sentence.
            while i < chars.len()
                && matches!(chars[i], '.' | '!' | '?' | '。' | '！' | '？' | '~' | '～' | '"' | '”' | '’' | ')' | '）')
            {
                i += 1;
            }
            push_sentence(&chars[start..i], &mut out);
            start = i;
        }
    }
    push_sentence(&chars[start..], &mut out);
    out
}

fn push_sentence(chars: &[char], out: &mut Vec<String>) {
    let s: String = chars.iter().collect::<String>().trim().to_string();
    if !s.is_empty() {
        out.push(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_parsed_in_order_and_removed_from_speech() {
        let (speech, marks) = parse_actions("It's 20% off now! [show_product:p007] [show_coupon: LIVE20 ]");
        assert_eq!(speech, "It's 20% off now!");
        assert_eq!(marks.len(), 2);
        assert_eq!((marks[0].kind, marks[0].id.as_str()), (ActionKind::ShowProduct, "p007"));
        assert_eq!(
            (marks[1].kind, marks[1].id.as_str(), marks[1].text.as_str()),
            (ActionKind::ShowCoupon, "LIVE20", "[show_coupon: LIVE20 ]")
        );
        let (speech, marks) = parse_actions("Here [show_product:p001] it is .");
        assert_eq!(speech, "Here it is.");
        assert_eq!(marks.len(), 1);
        assert_eq!(parse_actions("no markers [like this]").0, "no markers [like this]");
    }

    #[test]
    fn known_ids_come_from_nested_json_evidence() {
        let ev = vec![
            r#"{"products": [{"id": "p007", "link_id": "lk-p007", "name": "Puffer"}, {"id": "x1"}]}"#.to_string(),
            r#"{"promotions": [{"code": "LIVE20", "discount": {"value": 20}}]}"#.to_string(),
            r#"{"room": {"current_product_id": "p003", "ongoing_promotion": "KNIT2"}}"#.to_string(),
            r#"{"variants": [{"product_id": "p009"}]}"#.to_string(),
            "The p999 is great and SAVE50 works".to_string(),
        ];
        let k = KnownIds::from_evidence(&ev);
        assert_eq!(k.products.get("p007"), Some(&Some("lk-p007".to_string())));
        assert_eq!(k.products.get("p003"), Some(&None));
        assert!(k.products.contains_key("p009"));
        assert!(!k.products.contains_key("x1") && !k.products.contains_key("p999"));
        assert!(k.coupons.contains("LIVE20") && k.coupons.contains("KNIT2") && !k.coupons.contains("SAVE50"));
    }

    #[test]
    fn resolve_keeps_known_ids_drops_unknown_and_collapses_duplicates() {
        let ev = vec![r#"[{"id": "p007", "link_id": "lk-p007"}, {"id": "p001"}, {"code": "LIVE20"}]"#.to_string()];
        let k = KnownIds::from_evidence(&ev);
        let (_, marks) = parse_actions(
            "x [show_product:p007] [show_product:p007] [show_product:p404] [show_coupon:live20] [show_product:p001]",
        );
        let (actions, dropped) = resolve_actions(&marks, &k);
        let json = serde_json::to_string(&actions).unwrap();
        assert_eq!(
            json,
            r#"[{"type":"show_product","product_id":"p007","link_id":"lk-p007"},{"type":"show_coupon","code":"LIVE20"},{"type":"show_product","product_id":"p001"}]"#
        );
        assert_eq!(dropped.len(), 1);
        assert!(dropped[0].reason.contains("p404"));
    }

    #[test]
    fn sentences_split_on_end_marks_but_not_decimals_or_abbreviations() {
        assert_eq!(
            split_sentences("It's 79.5 yuan. Go half a size up, e.g. an M! Want it?"),
            vec!["It's 79.5 yuan.", "Go half a size up, e.g. an M!", "Want it?"]
        );
        assert_eq!(split_sentences("有货哦！今天下单明天发~快来。"), vec!["有货哦！", "今天下单明天发~", "快来。"]);
        assert_eq!(split_sentences("Really?! Yes."), vec!["Really?!", "Yes."]);
        assert_eq!(split_sentences("no end mark"), vec!["no end mark"]);
        assert!(split_sentences("  ").is_empty());
    }
}
