//! The built-in hooks. Each is a pure function of the payload (and, for `tool_args`, the tool registry).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::claims::{discount_mentions, discount_supported, find_forbidden_claim};
use super::{Decision, HookPayload, HookPoint};
use crate::schema;
use crate::tools::ToolRegistry;

/// What `reply_length` does with a reply that is too long.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LengthAction {
    /// Cut at the last sentence end that fits (`Correct`).
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
    /// `before_reply`: a forbidden phrase → `Retry`.
    ForbiddenClaims { phrases: Vec<String> },
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
                match find_forbidden_claim(reply, phrases) {
                    Some(p) => Decision::Retry {
                        reason: format!(
                            "the reply says \"{p}\", a claim a live host may not make (no absolute guarantees, medical \
                         effects or superlatives); say it again without that claim"
                        ),
                    },
                    None => Decision::Allow,
                }
            }
            (Builtin::InventedDiscount, HookPayload::BeforeReply { reply, evidence }) => {
                match discount_mentions(reply).into_iter().find(|m| !discount_supported(m, evidence)) {
                    Some(m) => Decision::Retry {
                        reason: format!(
                            "the reply mentions a discount ({}) that no tool result or room information shows; only \
                             quote promotions returned by list_promotions/get_coupons or listed for the room, or call \
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

/// Cut `text` to at most `max` characters, at the last sentence end if one falls in the second half, else at the
/// last space or comma, else hard.
pub fn truncate_reply(text: &str, max: usize) -> String {
    let chars: Vec<char> = text.chars().collect();
    if chars.len() <= max {
        return text.to_string();
    }
    let head = &chars[..max];
    let sentence_end = head.iter().rposition(|c| matches!(c, '.' | '!' | '?' | '。' | '！' | '？' | '~' | '～'));
    let soft = head.iter().rposition(|c| matches!(c, ' ' | ',' | '，' | '、' | ';' | '；'));
    let cut = match (sentence_end, soft) {
        (Some(i), _) if i + 1 >= max / 2 => i + 1,
        (_, Some(i)) if i >= max / 2 => i,
        _ => max,
    };
    chars[..cut].iter().collect::<String>().trim_end_matches([' ', ',', '，', '、', ';', '；']).to_string()
}

fn reply_length(reply: &str, max_chars: usize, on_violation: LengthAction) -> Decision {
    if reply.trim().is_empty() {
        return Decision::Retry { reason: "the reply is empty; answer the viewer".into() };
    }
    let n = reply.chars().count();
    if n <= max_chars {
        return Decision::Allow;
    }
    match on_violation {
        LengthAction::Truncate => Decision::Correct { value: Value::String(truncate_reply(reply, max_chars)) },
        LengthAction::Retry => Decision::Retry {
            reason: format!("the reply has {n} characters but the limit is {max_chars}; say it in fewer words"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_prefers_sentence_ends() {
        assert_eq!(truncate_reply("Short one. And then a much longer second sentence.", 20), "Short one.");
        assert_eq!(truncate_reply("one two three four five six", 12), "one two");
        assert_eq!(truncate_reply("abcdefghij", 4), "abcd");
        assert_eq!(truncate_reply("好的。这款有货，今天下单明天发货哦", 8), "好的。这款有货");
    }
}
