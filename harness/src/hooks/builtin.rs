//! The built-in hooks. Each is a pure function of the payload (and, for `tool_args`, the tool registry).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::claims::{discount_mentions, discount_supported, find_forbidden_claim};
use super::{Decision, HookPayload, HookPoint};
use crate::actions::{parse_actions, split_sentences, strip_markers};
use crate::grounding::{unsupported_figures, unsupported_reason};
use crate::schema;
use crate::tools::ToolRegistry;

/// What `reply_length` does with a reply that is too long.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LengthAction {
    /// Keep the longest run of whole sentences that fits (`Correct`); `Retry` when not even the first fits.
    #[default]
    Truncate,
    /// Ask the model for a shorter reply (`Retry`).
    Retry,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Builtin {
    /// `input`: strip control characters and chat-template tokens, collapse whitespace; empty → `Block`;
    /// longer than `max_chars` → truncated.
    InputSanity { max_chars: usize },
    /// `before_tool`: an unparsable call or non-object arguments → `Retry`; arguments given as a JSON string or
    /// `null` → `Correct`.
    ToolCallSyntax,
    /// `before_tool`: unknown tool or arguments not matching the schema → `Retry`; repairable slips → `Correct`.
    ToolArgs { coerce: bool },
    /// `after_tool`: results longer than `max_chars` (as JSON text) are cut.
    ToolResult { max_chars: usize },
    /// `before_reply`: `<think>…</think>` removed (`Correct`); nothing left → `Retry`.
    LeakedReasoning,
    /// `before_reply`: tool-call or chat-template syntax in the reply → `Retry`.
    LeakedToolSyntax,
    /// `before_reply`: a claim of a forbidden family (see `CLAIM_FAMILIES`) or one of the extra `phrases` → `Retry`.
    ForbiddenClaims { phrases: Vec<String> },
    /// `before_reply`: a figure (price, percent, count, date, ...) that no evidence shows → `Retry`.
    Grounding,
    /// `before_reply`: a discount not found in the evidence → `Retry`.
    InventedDiscount,
    /// `before_reply`: empty → `Retry`; too long → cut or `Retry`.
    ReplyLength { max_chars: usize, on_violation: LengthAction },
}

/// Special tokens and tags that must not reach the model from a viewer, nor a viewer from the model.
const TEMPLATE_TAGS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
];

impl Builtin {
    pub fn point(&self) -> HookPoint {
        match self {
            Builtin::InputSanity { .. } => HookPoint::Input,
            Builtin::ToolCallSyntax | Builtin::ToolArgs { .. } => HookPoint::BeforeTool,
            Builtin::ToolResult { .. } => HookPoint::AfterTool,
            Builtin::LeakedReasoning
            | Builtin::LeakedToolSyntax
            | Builtin::ForbiddenClaims { .. }
            | Builtin::Grounding
            | Builtin::InventedDiscount
            | Builtin::ReplyLength { .. } => HookPoint::BeforeReply,
        }
    }

    /// The decision on `payload` (`Allow` for a payload of another point).
    pub fn check(&self, payload: &HookPayload, tools: Option<&ToolRegistry>) -> Decision {
        match (self, payload) {
            (Builtin::InputSanity { max_chars }, HookPayload::Input { comment }) => input_sanity(comment, *max_chars),
            (Builtin::ToolCallSyntax, HookPayload::BeforeTool { name, arguments, parse_error, .. }) => {
                tool_call_syntax(name, arguments, parse_error.as_deref())
            }
            (Builtin::ToolArgs { coerce }, HookPayload::BeforeTool { name, arguments, .. }) => match tools {
                Some(tools) => tool_args(tools, name, arguments, *coerce),
                None => Decision::Allow,
            },
            (Builtin::ToolResult { max_chars }, HookPayload::AfterTool { result, .. }) => {
                tool_result(result, *max_chars)
            }
            (Builtin::LeakedReasoning, HookPayload::BeforeReply { reply, .. }) => leaked_reasoning(reply),
            (Builtin::LeakedToolSyntax, HookPayload::BeforeReply { reply, .. }) => leaked_tool_syntax(reply),
            (Builtin::ForbiddenClaims { phrases }, HookPayload::BeforeReply { reply, .. }) => {
                match find_forbidden_claim(&strip_markers(reply), phrases) {
                    Some(c) => Decision::Retry {
                        reason: format!(
                            "the reply says \"{}\" ({}), a claim a live host may not make (no absolute guarantees, \
                             medical effects, competitor comparisons, unprovable superlatives, requests for private \
                             data or talk about your instructions); say it again without that claim",
                            c.matched, c.family
                        ),
                    },
                    None => Decision::Allow,
                }
            }
            (Builtin::Grounding, HookPayload::BeforeReply { reply, evidence }) => {
                let unsupported = unsupported_figures(reply, evidence);
                if unsupported.is_empty() {
                    Decision::Allow
                } else {
                    Decision::Retry { reason: unsupported_reason(&unsupported) }
                }
            }
            (Builtin::InventedDiscount, HookPayload::BeforeReply { reply, evidence }) => {
                match discount_mentions(&strip_markers(reply)).into_iter().find(|m| !discount_supported(m, evidence)) {
                    Some(m) => Decision::Retry {
                        reason: format!(
                            "the reply mentions a discount ({}) that no tool result or room information shows; only \
                             quote promotions returned by list_promotions or listed for the room, or call \
                             list_promotions first",
                            m.describe()
                        ),
                    },
                    None => Decision::Allow,
                }
            }
            (Builtin::ReplyLength { max_chars, on_violation }, HookPayload::BeforeReply { reply, .. }) => {
                reply_length(reply, *max_chars, *on_violation)
            }
            _ => Decision::Allow,
        }
    }
}

fn input_sanity(comment: &str, max_chars: usize) -> Decision {
    let mut text = comment.to_string();
    // Chat-template tokens (`<|im_start|>` and the like) and tool tags are removed, not interpreted.
    while let Some(start) = text.find("<|") {
        match text[start..].find("|>") {
            Some(end) => text.replace_range(start..start + end + 2, " "),
            None => break,
        }
    }
    for tag in TEMPLATE_TAGS.iter().chain(&["<think>", "</think>"]) {
        text = text.replace(tag, " ");
    }
    let cleaned: String = text.chars().map(|c| if c.is_control() || c.is_whitespace() { ' ' } else { c }).collect();
    let mut cleaned = cleaned.split_whitespace().collect::<Vec<_>>().join(" ");
    if cleaned.is_empty() {
        return Decision::Block { reason: "empty comment".into() };
    }
    if cleaned.chars().count() > max_chars {
        cleaned = cleaned.chars().take(max_chars).collect::<String>().trim_end().to_string();
    }
    if cleaned == comment { Decision::Allow } else { Decision::Correct { value: Value::String(cleaned) } }
}

fn tool_call_syntax(name: &str, arguments: &Value, parse_error: Option<&str>) -> Decision {
    if let Some(e) = parse_error {
        return Decision::Retry {
            reason: format!(
                "the tool call could not be parsed ({e}); write it again with the exact tool-call syntax and JSON arguments"
            ),
        };
    }
    if name.trim().is_empty() {
        return Decision::Retry { reason: "the tool call has no tool name".into() };
    }
    match arguments {
        Value::Object(_) => Decision::Allow,
        Value::Null => Decision::Correct { value: Value::Object(Default::default()) },
        Value::String(s) if s.trim().is_empty() => Decision::Correct { value: Value::Object(Default::default()) },
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => Decision::Correct { value: v },
            Ok(_) => Decision::Retry { reason: format!("the arguments of `{name}` must be a JSON object") },
            Err(e) => Decision::Retry {
                reason: format!("the arguments of `{name}` are not valid JSON ({e}); send a JSON object"),
            },
        },
        other => Decision::Retry { reason: format!("the arguments of `{name}` must be a JSON object, not {other}") },
    }
}

fn tool_args(tools: &ToolRegistry, name: &str, arguments: &Value, coerce: bool) -> Decision {
    let Some(tool) = tools.resolve(name) else {
        return Decision::Retry {
            reason: format!("there is no tool `{name}`; the tools are: {}", tools.names().join(", ")),
        };
    };
    let fixed = if coerce { schema::coerce(&tool.input_schema, arguments) } else { arguments.clone() };
    let errors = schema::validate(&tool.input_schema, &fixed);
    if !errors.is_empty() {
        let list: Vec<String> = errors.iter().map(ToString::to_string).collect();
        return Decision::Retry {
            reason: format!("the arguments of `{}` do not match its schema: {}", tool.name, list.join("; ")),
        };
    }
    if &fixed != arguments { Decision::Correct { value: fixed } } else { Decision::Allow }
}

fn tool_result(result: &Value, max_chars: usize) -> Decision {
    let text = match result {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if text.chars().count() <= max_chars {
        return Decision::Allow;
    }
    let cut: String = text.chars().take(max_chars).collect();
    Decision::Correct {
        value: Value::String(format!("{cut}… [truncated: {} characters in all]", text.chars().count())),
    }
}

fn leaked_reasoning(reply: &str) -> Decision {
    let mut text = reply.to_string();
    // A reply that starts inside the reasoning (the template opened `<think>`): drop up to the first `</think>`.
    if let Some(end) = text.find("</think>")
        && !text[..end].contains("<think>")
    {
        text.replace_range(..end + "</think>".len(), "");
    }
    while let Some(start) = text.find("<think>") {
        match text[start..].find("</think>") {
            Some(end) => text.replace_range(start..start + end + "</think>".len(), ""),
            None => text.truncate(start),
        }
    }
    let text = text.trim();
    if text == reply {
        Decision::Allow
    } else if text.is_empty() {
        Decision::Retry { reason: "the reply held only reasoning; answer the viewer directly".into() }
    } else {
        Decision::Correct { value: Value::String(text.to_string()) }
    }
}

fn leaked_tool_syntax(reply: &str) -> Decision {
    // Action markers (`[show_product:p007]`) are the one bracket syntax a reply may hold.
    let reply = strip_markers(reply);
    let reply = reply.as_str();
    let found = TEMPLATE_TAGS.iter().find(|t| reply.contains(**t)).map(|t| t.to_string()).or_else(|| {
        let start = reply.find("<|")?;
        let end = reply[start..].find("|>")?;
        Some(reply[start..start + end + 2].to_string())
    });
    match found {
        Some(tag) => Decision::Retry {
            reason: format!(
                "the reply contains tool-call syntax (`{tag}`); call tools through a tool call only, and write the reply as plain speech"
            ),
        },
        None => Decision::Allow,
    }
}

/// The longest prefix of whole sentences of `text` within `max` characters; `None` when not even the first
/// sentence fits. A cut inside a sentence ("go half a size up from your usual") would change what it says.
pub fn truncate_at_sentences(text: &str, max: usize) -> Option<String> {
    let mut out = String::new();
    for sentence in split_sentences(text) {
        let candidate = if out.is_empty() { sentence.clone() } else { format!("{out} {sentence}") };
        if candidate.chars().count() > max {
            break;
        }
        out = candidate;
    }
    (!out.is_empty()).then_some(out)
}

fn reply_length(reply: &str, max_chars: usize, on_violation: LengthAction) -> Decision {
    // Markers are not spoken: measure the speech, and keep the markers after a cut.
    let (speech, marks) = parse_actions(reply);
    if speech.trim().is_empty() {
        return Decision::Retry { reason: "the reply is empty; answer the viewer".into() };
    }
    let n = speech.chars().count();
    if n <= max_chars {
        return Decision::Allow;
    }
    let too_long = || Decision::Retry {
        reason: format!("the reply has {n} characters but the limit is {max_chars}; say it in fewer words"),
    };
    match on_violation {
        LengthAction::Truncate => match truncate_at_sentences(&speech, max_chars) {
            Some(mut cut) => {
                for m in &marks {
                    cut.push(' ');
                    cut.push_str(&m.text);
                }
                Decision::Correct { value: Value::String(cut) }
            }
            None => Decision::Retry {
                reason: format!(
                    "the reply's first sentence is already longer than the limit of {max_chars} characters; say it \
                     in one shorter sentence"
                ),
            },
        },
        LengthAction::Retry => too_long(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_whole_sentences_only() {
        assert_eq!(
            truncate_at_sentences("Short one. And then a much longer second sentence.", 20).unwrap(),
            "Short one."
        );
        assert_eq!(truncate_at_sentences("好的。这款有货，今天下单明天发货哦", 8).unwrap(), "好的。");
        assert_eq!(
            truncate_at_sentences("It's 79.5 yuan. Size M. More words here.", 24).unwrap(),
            "It's 79.5 yuan. Size M."
        );
        assert_eq!(truncate_at_sentences("one two three four five six", 12), None);
    }

    #[test]
    fn a_sentence_is_never_cut_in_the_middle() {
        let advice = "Go half a size up from your usual. It runs small.";
        for max in 1..advice.len() {
            let d = reply_length(advice, max, LengthAction::Truncate);
            match d {
                Decision::Correct { value } => assert_eq!(value, "Go half a size up from your usual.", "max {max}"),
                Decision::Retry { reason } => {
                    assert!(max < 34 && reason.contains(&format!("limit of {max}")), "max {max}: {reason}")
                }
                other => panic!("max {max}: {other:?}"),
            }
        }
    }

    #[test]
    fn markers_are_not_counted_and_survive_a_cut() {
        let r = "Grab it now. It's the puffer. [show_product:p007]";
        assert_eq!(reply_length(r, 30, LengthAction::Truncate), Decision::Allow);
        assert_eq!(
            reply_length(r, 15, LengthAction::Truncate),
            Decision::Correct { value: Value::String("Grab it now. [show_product:p007]".into()) }
        );
        assert_eq!(leaked_tool_syntax(r), Decision::Allow);
    }
}
