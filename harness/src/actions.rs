//! Actions for the avatar and sentences for TTS.
//!
//! The model ends its reply with action markers, which the harness documents in `rules.md`:
//! `[show_product:p007]` shows a product card (with its action link), `[show_coupon:LIVE20]` shows a coupon.
//! [`parse_actions`] separates the speech from the markers; [`resolve_actions`] keeps the actions whose ids
//! this request's tool results or room data returned ([`KnownIds::from_evidence`]) and drops the others with a
//! reason. [`split_sentences`] cuts speech into sentences for TTS.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    ShowProduct,
    ShowCoupon,
}

impl ActionKind {
    fn from_tag(tag: &str) -> Option<Self> {
        match tag {
            "show_product" => Some(ActionKind::ShowProduct),
            "show_coupon" => Some(ActionKind::ShowCoupon),
            _ => None,
        }
    }
}

/// A marker as the model wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionMark {
    pub kind: ActionKind,
    pub id: String,
    /// The marker text, e.g. `[show_product:p007]`.
    pub text: String,
}

/// An executable action: `{"type":"show_product","product_id":"p007","link_id":"lk-p007"}` or
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

/// A marker left out, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DroppedAction {
    pub marker: String,
    pub reason: String,
}

/// The speech with every action marker removed (whitespace tidied), and the markers in order.
pub fn parse_actions(reply: &str) -> (String, Vec<ActionMark>) {
    let mut speech = String::new();
    let mut marks = Vec::new();
    let mut rest = reply;
    while let Some(open) = rest.find('[') {
        let after = &rest[open + 1..];
        let parsed = after.find(']').and_then(|close| {
            let inner = &after[..close];
            let (tag, id) = inner.split_once(':')?;
            let kind = ActionKind::from_tag(tag.trim())?;
            let id = id.trim();
            let valid = !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'));
            valid.then(|| (ActionMark { kind, id: id.to_string(), text: format!("[{inner}]") }, close))
        });
        match parsed {
            Some((mark, close)) => {
                speech.push_str(&rest[..open]);
                marks.push(mark);
                rest = &after[close + 1..];
            }
            None => {
                speech.push_str(&rest[..=open]);
                rest = after;
            }
        }
    }
    speech.push_str(rest);
    let tidy = speech.split_whitespace().collect::<Vec<_>>().join(" ");
    // A marker removed before punctuation leaves "word ." behind.
    let tidy = [" .", " !", " ?", " ,", " 。", " ！", " ？", " ，"].iter().fold(tidy, |t, p| t.replace(p, &p[1..]));
    (tidy, marks)
}

/// Product ids (with their action link, when known) and coupon codes seen in this request's evidence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KnownIds {
    pub products: BTreeMap<String, Option<String>>,
    pub coupons: BTreeSet<String>,
}

impl KnownIds {
    /// Scan evidence texts (JSON tool results, room data; plain texts are skipped) for product objects
    /// (`id` or `product_id`, optional `link_id`), coupon objects (`code`) and the room's
    /// `current_product_id` / `ongoing_promotion`.
    pub fn from_evidence(evidence: &[String]) -> Self {
        let mut known = KnownIds::default();
        for text in evidence {
            if let Ok(v) = serde_json::from_str::<Value>(text) {
                known.scan(&v);
            }
        }
        known
    }

    fn add_product(&mut self, id: &str, link: Option<&str>) {
        let entry = self.products.entry(id.to_string()).or_default();
        if entry.is_none() {
            *entry = link.map(str::to_string);
        }
    }

    fn scan(&mut self, v: &Value) {
        match v {
            Value::Array(items) => items.iter().for_each(|i| self.scan(i)),
            Value::Object(m) => {
                let s = |k: &str| m.get(k).and_then(Value::as_str);
                let link = s("link_id");
                if let Some(id) = s("product_id").or_else(|| s("id").filter(|id| looks_like_product_id(id))) {
                    self.add_product(id, link);
                }
                if let Some(code) = s("code") {
                    self.coupons.insert(code.to_string());
                }
                if let Some(id) = s("current_product_id") {
                    self.add_product(id, None);
                }
                if let Some(code) = s("ongoing_promotion") {
                    self.coupons.insert(code.to_string());
                }
                if let Some(Value::Array(codes)) = m.get("promotion_codes") {
                    self.coupons.extend(codes.iter().filter_map(Value::as_str).map(str::to_string));
                }
                m.values().for_each(|x| self.scan(x));
            }
            _ => {}
        }
    }
}

/// Catalogue ids look like `p007`: a letter prefix and digits.
fn looks_like_product_id(id: &str) -> bool {
    let digits = id.trim_start_matches(|c: char| c.is_ascii_alphabetic());
    !digits.is_empty() && digits.len() < id.len() && digits.chars().all(|c| c.is_ascii_digit())
}

/// The actions whose ids are known (in marker order, duplicates collapsed) and the markers dropped.
pub fn resolve_actions(marks: &[ActionMark], known: &KnownIds) -> (Vec<Action>, Vec<DroppedAction>) {
    let mut actions = Vec::new();
    let mut dropped = Vec::new();
    for m in marks {
        let action = match m.kind {
            ActionKind::ShowProduct => match known.products.iter().find(|(id, _)| id.eq_ignore_ascii_case(&m.id)) {
                Some((id, link)) => Action::ShowProduct { product_id: id.clone(), link_id: link.clone() },
                None => {
                    dropped.push(DroppedAction { marker: m.text.clone(), reason: format!("product `{}` was not returned by any tool or the room data", m.id) });
                    continue;
                }
            },
            ActionKind::ShowCoupon => match known.coupons.iter().find(|c| c.eq_ignore_ascii_case(&m.id)) {
                Some(code) => Action::ShowCoupon { code: code.clone() },
                None => {
                    dropped.push(DroppedAction { marker: m.text.clone(), reason: format!("coupon `{}` was not returned by any tool or the room data", m.id) });
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

/// Sentences of `text` for TTS: cut after `.`, `!`, `?` (followed by a space or the end) and after `。`, `！`,
/// `？`, `~`, `～`; decimals (`79.5`) and a few abbreviations (`e.g.`, `i.e.`, `etc.`) do not end a sentence.
pub fn split_sentences(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let end = match c {
            '。' | '！' | '？' | '～' => true,
            '.' | '!' | '?' | '~' => {
                let next = chars.get(i + 1).copied();
                let at_break = next.is_none_or(|n| n.is_whitespace() || matches!(n, '"' | '\'' | ')' | '”'));
                let decimal = c == '.' && i > 0 && chars[i - 1].is_ascii_digit() && next.is_some_and(|n| n.is_ascii_digit());
                let word: String = chars[start..i].iter().rev().take_while(|c| !c.is_whitespace()).collect::<Vec<_>>().into_iter().rev().collect();
                let abbrev = c == '.' && ["e.g", "i.e", "etc", "vs", "approx"].contains(&word.to_lowercase().as_str());
                at_break && !decimal && !abbrev
            }
            _ => false,
        };
        if end {
            // Keep closing punctuation runs ("?!", "。」") with the sentence.
            while i + 1 < chars.len() && matches!(chars[i + 1], '.' | '!' | '?' | '。' | '！' | '？' | '"' | '”' | '」' | ')') {
                i += 1;
            }
            let s: String = chars[start..=i].iter().collect();
            if !s.trim().is_empty() {
                out.push(s.trim().to_string());
            }
            start = i + 1;
        }
        i += 1;
    }
    let tail: String = chars[start.min(chars.len())..].iter().collect();
    if !tail.trim().is_empty() {
        out.push(tail.trim().to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_leave_the_speech_and_keep_their_order() {
        let (speech, marks) = parse_actions("The puffer is 459 yuan! [show_product:p007] Use [show_coupon:LIVE20] at checkout.");
        assert_eq!(speech, "The puffer is 459 yuan! Use at checkout.");
        assert_eq!(marks.iter().map(|m| (m.kind, m.id.as_str())).collect::<Vec<_>>(), [(ActionKind::ShowProduct, "p007"), (ActionKind::ShowCoupon, "LIVE20")]);
        // Brackets that are not markers stay.
        let (speech, marks) = parse_actions("Sizes [S, M] left [show_thing:x] [show_product:] ok");
        assert_eq!(speech, "Sizes [S, M] left [show_thing:x] [show_product:] ok");
        assert!(marks.is_empty());
    }

    #[test]
    fn only_ids_from_tools_or_room_become_actions() {
        let evidence = vec![
            r#"{"id":"p007","name":"Puffer","link_id":"lk-p007","promotion_codes":["LIVE20"]}"#.to_string(),
            r#"{"current_product_id":"p006","ongoing_promotion":"KNIT2"}"#.to_string(),
            "plain text p009".to_string(),
        ];
        let known = KnownIds::from_evidence(&evidence);
        let (_, marks) = parse_actions("[show_product:p007][show_product:P007][show_product:p006][show_product:p009][show_coupon:live20][show_coupon:FAKE]");
        let (actions, dropped) = resolve_actions(&marks, &known);
        assert_eq!(
            serde_json::to_value(&actions).unwrap(),
            serde_json::json!([
                {"type": "show_product", "product_id": "p007", "link_id": "lk-p007"},
                {"type": "show_product", "product_id": "p006"},
                {"type": "show_coupon", "code": "LIVE20"}
            ])
        );
        assert_eq!(dropped.iter().map(|d| d.marker.as_str()).collect::<Vec<_>>(), ["[show_product:p009]", "[show_coupon:FAKE]"]);
    }

    #[test]
    fn sentences_split_on_english_and_chinese_punctuation() {
        assert_eq!(split_sentences("It's 79.5 yuan. Grab it now! Any size?"), ["It's 79.5 yuan.", "Grab it now!", "Any size?"]);
        assert_eq!(split_sentences("好的。这款有货！明天发货"), ["好的。", "这款有货！", "明天发货"]);
        assert_eq!(split_sentences("Layers, e.g. the scarf. Nice?!"), ["Layers, e.g. the scarf.", "Nice?!"]);
        assert!(split_sentences("  ").is_empty());
    }
}
