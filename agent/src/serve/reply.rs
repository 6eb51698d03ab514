//! The model's raw reply text → an OpenAI assistant message: `<think>` reasoning to `reasoning_content`,
//! `<tool_call>` blocks (parsed by [`parse_reply`]) to `tool_calls`, the rest to `content`.
//!
//! [`IncrementalReply`] does the same while tokens arrive, for streaming: it releases reasoning and content
//! text only once no later token can change it. Text that could be the start of a tool call (`<tool_call>`,
//! `<function=`, or a partial prefix of one), or of a stop string, or trailing whitespace, is held back; once
//! a tool-call marker is seen everything after it is held until the end, where the calls are emitted whole.

use serde_json::{json, Value};

use crate::toolcall::{parse_reply, ToolCall, THINK_CLOSE, THINK_OPEN, TOOL_CALL_OPEN};

const FUNCTION_OPEN: &str = "<function=";

/// How to read a reply.
#[derive(Debug, Clone, Default)]
pub struct ReplyOptions {
    /// The tools offered to the model; `None`: no tools (or `tool_choice: "none"`), so no call is parsed.
    pub tools: Option<Vec<Value>>,
    /// `false`: keep only the first call.
    pub parallel_tool_calls: bool,
    /// The prompt ended inside an open `<think>` block, so the reply starts with reasoning.
    pub thinking_open: bool,
    /// Stop strings (the caller cuts the text at a full match; partial matches are held back).
    pub stop: Vec<String>,
}

/// A finished assistant message.
#[derive(Debug, Clone, PartialEq)]
pub struct AssistantReply {
    pub reasoning: Option<String>,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl AssistantReply {
    /// Parse a complete reply.
    pub fn parse(text: &str, opts: &ReplyOptions) -> AssistantReply {
        let split = split_reasoning(text, opts.thinking_open);
        let reasoning = split.reasoning.map(str::trim).filter(|r| !r.is_empty()).map(str::to_string);
        let Some(tools) = &opts.tools else {
            return AssistantReply { reasoning, content: split.rest.trim().to_string(), tool_calls: Vec::new() };
        };
        let parsed = parse_reply(split.rest, tools.as_slice());
        // A malformed call that yields no call stays visible as text rather than vanishing.
        let content = if parsed.calls.is_empty() && parsed.has_errors() { split.rest.trim().to_string() } else { parsed.text };
        let mut calls = parsed.calls;
        if !opts.parallel_tool_calls {
            calls.truncate(1);
        }
        let reasoning = match (reasoning, parsed.reasoning) {
            (Some(a), Some(b)) => Some(format!("{a}\n\n{b}")),
            (a, b) => a.or(b),
        };
        AssistantReply { reasoning, content, tool_calls: calls }
    }

    /// OpenAI `tool_calls` entries: ids `call_<request>_<i>`, arguments as a JSON string.
    pub fn openai_tool_calls(&self, request_id: &str) -> Vec<Value> {
        self.tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "id": tool_call_id(request_id, i),
                    "type": "function",
                    "function": {"name": c.name, "arguments": Value::Object(c.arguments.clone()).to_string()},
                })
            })
            .collect()
    }

    /// The `message` object of a non-streamed reply.
    pub fn message(&self, request_id: &str) -> Value {
        let mut m = json!({"role": "assistant", "content": self.content});
        if let Some(r) = &self.reasoning {
            m["reasoning_content"] = json!(r);
        }
        if !self.tool_calls.is_empty() {
            m["tool_calls"] = Value::Array(self.openai_tool_calls(request_id));
            if self.content.is_empty() {
                m["content"] = Value::Null;
            }
        }
        m
    }
}

pub fn tool_call_id(request_id: &str, index: usize) -> String {
    let tail = request_id.rsplit('-').next().unwrap_or(request_id);
    format!("call_{tail}{index}")
}

struct Split<'a> {
    reasoning: Option<&'a str>,
    /// Whether `</think>` has been seen (the reasoning is complete).
    closed: bool,
    rest: &'a str,
}

/// Reasoning is the text before `</think>` when the prompt left `<think>` open or the reply opens one first.
fn split_reasoning(text: &str, thinking_open: bool) -> Split<'_> {
    let t = text.trim_start();
    let body = match t.strip_prefix(THINK_OPEN) {
        Some(b) => b,
        None if thinking_open => t,
        None => return Split { reasoning: None, closed: true, rest: text },
    };
    match body.find(THINK_CLOSE) {
        Some(end) => Split { reasoning: Some(&body[..end]), closed: true, rest: &body[end + THINK_CLOSE.len()..] },
        None => Split { reasoning: Some(body), closed: false, rest: "" },
    }
}

/// Where the held-back tail of `s` starts: trailing whitespace, and a suffix that is a proper prefix of a marker.
fn safe_end(s: &str, markers: &[&str]) -> usize {
    let mut end = s.trim_end().len();
    let longest = markers.iter().map(|m| m.len()).max().unwrap_or(0);
    let from = end.saturating_sub(longest);
    for (i, _) in s[..end].char_indices().filter(|(i, _)| *i >= from) {
        let tail = &s[i..end];
        if markers.iter().any(|m| m.len() > tail.len() && m.starts_with(tail)) {
            end = i;
            break;
        }
    }
    s[..end].trim_end().len()
}

/// Text released by one update.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    pub reasoning: String,
    pub content: String,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }
}

/// Streaming state: how much reasoning and content has been sent.
pub struct IncrementalReply {
    opts: ReplyOptions,
    sent_reasoning: usize,
    sent_content: usize,
    /// A tool-call marker was seen: hold the content until the end.
    holding: bool,
}

impl IncrementalReply {
    pub fn new(opts: ReplyOptions) -> Self {
        IncrementalReply { opts, sent_reasoning: 0, sent_content: 0, holding: false }
    }

    /// The reply so far is `text` (cut at any stop string): what may be sent now.
    pub fn update(&mut self, text: &str) -> Delta {
        let mut delta = Delta::default();
        let split = split_reasoning(text, self.opts.thinking_open);
        if split.reasoning.is_none() && self.sent_content == 0 && THINK_OPEN.starts_with(text.trim_start()) {
            return delta; // maybe the start of `<think>`
        }
        if let Some(r) = split.reasoning {
            let r = r.trim_start();
            let end = if split.closed { r.trim_end().len() } else { safe_end(r, &[THINK_CLOSE]) };
            delta.reasoning = take(r, &mut self.sent_reasoning, end);
        }
        if !split.closed || self.holding {
            return delta;
        }
        let c = split.rest.trim_start();
        let mut markers: Vec<&str> = self.opts.stop.iter().map(String::as_str).collect();
        let mut end = c.len();
        if self.opts.tools.is_some() {
            markers.extend([TOOL_CALL_OPEN, FUNCTION_OPEN]);
            if let Some(at) = [TOOL_CALL_OPEN, FUNCTION_OPEN].iter().filter_map(|m| c.find(m)).min() {
                self.holding = true;
                end = at;
            }
        }
        let end = safe_end(&c[..end], &markers);
        delta.content = take(c, &mut self.sent_content, end);
        delta
    }

    /// The whole reply is `text`: the rest of the reasoning and content, and the parsed message.
    pub fn finish(&mut self, text: &str) -> (Delta, AssistantReply) {
        let reply = AssistantReply::parse(text, &self.opts);
        let mut delta = Delta::default();
        if let Some(r) = &reply.reasoning {
            delta.reasoning = take(r, &mut self.sent_reasoning, r.len());
        }
        delta.content = take(&reply.content, &mut self.sent_content, reply.content.len());
        (delta, reply)
    }
}

/// `s[*sent..end]`, advancing `sent`; empty when `end` is not past it or not on a character boundary.
fn take(s: &str, sent: &mut usize, end: usize) -> String {
    if end <= *sent || !s.is_char_boundary(end) || !s.is_char_boundary(*sent) {
        return String::new();
    }
    let out = s[*sent..end].to_string();
    *sent = end;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Value> {
        vec![json!({"type": "function", "function": {"name": "check_stock", "parameters": {
            "type": "object", "properties": {"product": {"type": "string"}, "qty": {"type": "integer"}}}}})]
    }

    fn opts(with_tools: bool) -> ReplyOptions {
        ReplyOptions { tools: with_tools.then(tools), parallel_tool_calls: true, thinking_open: true, stop: Vec::new() }
    }

    const CALL_REPLY: &str = "\n</think>\n\nChecking!\n\n<tool_call>\n<function=check_stock>\n<parameter=product>\nhoodie\n\
                              </parameter>\n<parameter=qty>\n2\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn output_with_a_tool_call_becomes_openai_tool_calls() {
        let reply = AssistantReply::parse(CALL_REPLY, &opts(true));
        assert_eq!(reply.reasoning, None);
        assert_eq!(reply.content, "Checking!");
        let calls = reply.openai_tool_calls("chatcmpl-abc");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["id"], "call_abc0");
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["function"]["name"], "check_stock");
        let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"product": "hoodie", "qty": 2}));
    }

    #[test]
    fn without_tools_the_call_markup_stays_text() {
        let reply = AssistantReply::parse(CALL_REPLY, &opts(false));
        assert!(reply.tool_calls.is_empty());
        assert!(reply.content.starts_with("Checking!\n\n<tool_call>"), "{}", reply.content);
    }

    #[test]
    fn reasoning_is_kept_out_of_content() {
        let reply = AssistantReply::parse("let me think\n</think>\n\nHi there", &opts(true));
        assert_eq!(reply.reasoning.as_deref(), Some("let me think"));
        assert_eq!(reply.content, "Hi there");
        let closed = ReplyOptions { thinking_open: false, ..opts(true) };
        let reply = AssistantReply::parse("<think>hmm</think>Hello", &closed);
        assert_eq!(reply.reasoning.as_deref(), Some("hmm"));
        assert_eq!(reply.content, "Hello");
    }

    #[test]
    fn parallel_tool_calls_false_keeps_the_first_call() {
        let two = format!("{CALL_REPLY}\n{}", &CALL_REPLY[CALL_REPLY.find("<tool_call>").unwrap()..]);
        assert_eq!(AssistantReply::parse(&two, &opts(true)).tool_calls.len(), 2);
        let single = ReplyOptions { parallel_tool_calls: false, ..opts(true) };
        assert_eq!(AssistantReply::parse(&two, &single).tool_calls.len(), 1);
    }

    /// Feeding the reply a character at a time yields exactly the final reasoning and content, and no byte of
    /// the tool call as content.
    #[test]
    fn streamed_deltas_add_up_to_the_final_message() {
        for (text, with_tools) in [
            (CALL_REPLY, true),
            (CALL_REPLY, false),
            ("some reasoning </thin here\n</think>\n\nPlain answer, <b>bold</b>  ", true),
            ("\n</think>\n\nA <tool_ca>not a call", true),
        ] {
            let o = opts(with_tools);
            let mut inc = IncrementalReply::new(o.clone());
            let (mut reasoning, mut content) = (String::new(), String::new());
            let ends: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).chain([text.len()]).collect();
            for end in ends {
                let d = inc.update(&text[..end]);
                reasoning.push_str(&d.reasoning);
                content.push_str(&d.content);
                assert!(!content.contains("<tool_call") || !with_tools, "{content}");
            }
            let (d, reply) = inc.finish(text);
            reasoning.push_str(&d.reasoning);
            content.push_str(&d.content);
            assert_eq!(content, reply.content, "{text:?}");
            assert_eq!(reasoning, reply.reasoning.clone().unwrap_or_default(), "{text:?}");
        }
    }

    #[test]
    fn a_partial_stop_string_is_held_back() {
        let o = ReplyOptions { stop: vec!["END".into()], thinking_open: false, ..opts(false) };
        let mut inc = IncrementalReply::new(o);
        assert_eq!(inc.update("Hello E").content, "Hello");
        assert_eq!(inc.update("Hello EN").content, "");
        assert_eq!(inc.update("Hello ENx").content, " ENx");
    }
}
