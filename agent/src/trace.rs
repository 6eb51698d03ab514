//! Per-request traces: one JSON line per event.
//!
//! A request's trace records the harness version, the prompt blocks (name, hash, size) and the skills
//! chosen, each generation (tokens, TTFT, decode speed, MTP acceptance), each tool call (arguments,
//! latency, result or error), each hook decision, the final reply, and the wall time with its split
//! (prompt assembly, model, tools, hooks). Every line is
//! `{"request_id": …, "t_ms": <since the trace began>, "event": "<kind>", …fields}`.

use std::io::{self, Write};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// One prompt block as assembled: its name, content hash and size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptBlock {
    pub name: String,
    pub hash: String,
    pub chars: usize,
}

impl PromptBlock {
    /// A block record for `text` (hash: [`block_hash`]).
    pub fn of(name: impl Into<String>, text: &str) -> Self {
        PromptBlock { name: name.into(), hash: block_hash(text), chars: text.chars().count() }
    }
}

/// A stable content hash for prompt blocks: 64-bit FNV-1a of the UTF-8 bytes, 16 hex digits.
pub fn block_hash(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum TraceEvent {
    Start {
        request_id: String,
        harness_version: String,
        /// The live-stream comment (user input) being answered.
        comment: String,
        /// Which LLM client answers ([`crate::llm::LlmClient::name`]).
        llm: String,
    },
    Prompt {
        blocks: Vec<PromptBlock>,
        skills: Vec<String>,
    },
    Generation {
        loop_index: usize,
        prompt_tokens: usize,
        completion_tokens: usize,
        ttft_ms: f64,
        decode_tokens_per_s: f64,
        wall_ms: f64,
        finish_reason: String,
        /// MTP acceptance statistics, when speculating.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        spec: Option<Value>,
        text: String,
    },
    ToolCall {
        loop_index: usize,
        server: String,
        tool: String,
        arguments: Value,
        latency_ms: f64,
        ok: bool,
        /// Answered from an identical earlier call of this request (the server was not called again).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cached: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    Hook {
        point: String,
        hook: String,
        decision: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// A fault that degraded the request: an MCP server that did not start, died or timed out, a tool error
    /// or malformed result, an LLM failure, the budget running out, a tool the harness names that no server
    /// offers, a hook left out.
    Fault {
        stage: String,
        target: String,
        error: String,
    },
    /// Something worth knowing that is not a fault (an action dropped, a reply cut after streamed sentences).
    Notice {
        kind: String,
        detail: String,
    },
    /// The live-room status fetched from a server's room-status tool (no `--room` given).
    Room {
        server: String,
        tool: String,
        latency_ms: f64,
        ok: bool,
        /// The room status as the tool returned it (evidence for the reply's figures).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// A sentence of the final reply, released to TTS.
    Sentence {
        index: usize,
        text: String,
    },
    Reply {
        /// `null` when the comment or reply was blocked.
        text: Option<String>,
        loops: usize,
        outcome: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        actions: Vec<Value>,
    },
    Timing {
        wall_ms: f64,
        prompt_ms: f64,
        model_ms: f64,
        tools_ms: f64,
        hooks_ms: f64,
    },
}

impl TraceEvent {
    /// The `event` tag.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Start { .. } => "start",
            Self::Prompt { .. } => "prompt",
            Self::Generation { .. } => "generation",
            Self::ToolCall { .. } => "tool_call",
            Self::Hook { .. } => "hook",
            Self::Fault { .. } => "fault",
            Self::Notice { .. } => "notice",
            Self::Sentence { .. } => "sentence",
            Self::Room { .. } => "room",
            Self::Reply { .. } => "reply",
            Self::Timing { .. } => "timing",
        }
    }
}

/// One JSON line: `{"request_id", "t_ms", "event", …the event's fields}` (the `start` event's own
/// `request_id` is the same key).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRecord {
    pub request_id: String,
    pub t_ms: f64,
    pub event: TraceEvent,
}

impl TraceRecord {
    pub fn to_value(&self) -> Value {
        let mut m = serde_json::Map::new();
        m.insert("request_id".into(), json!(self.request_id));
        m.insert("t_ms".into(), json!(self.t_ms));
        if let Ok(Value::Object(fields)) = serde_json::to_value(&self.event) {
            for (k, v) in fields {
                m.insert(k, v);
            }
        }
        Value::Object(m)
    }

    pub fn from_value(value: Value) -> Result<Self, serde_json::Error> {
        use serde::de::Error;
        let Value::Object(mut m) = value else {
            return Err(serde_json::Error::custom("a trace record must be a JSON object"));
        };
        let t_ms = m.remove("t_ms").and_then(|v| v.as_f64()).ok_or_else(|| serde_json::Error::missing_field("t_ms"))?;
        let request_id = m
            .get("request_id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| serde_json::Error::missing_field("request_id"))?;
        let event = serde_json::from_value(Value::Object(m))?;
        Ok(TraceRecord { request_id, t_ms, event })
    }
}

impl Serialize for TraceRecord {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

impl<'de> Deserialize<'de> for TraceRecord {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        TraceRecord::from_value(v).map_err(serde::de::Error::custom)
    }
}

/// Where wall time went, for [`Trace::add_time`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Prompt,
    Model,
    Tools,
    Hooks,
}

/// The events of one request.
#[derive(Debug, Clone)]
pub struct Trace {
    request_id: String,
    started: Instant,
    records: Vec<TraceRecord>,
    /// Accumulated prompt / model / tools / hooks time.
    split: [Duration; 4],
}

impl Trace {
    pub fn new(request_id: impl Into<String>) -> Self {
        Self::starting_at(request_id, Instant::now())
    }

    /// A trace whose clock starts at `started` (when the request arrived).
    pub fn starting_at(request_id: impl Into<String>, started: Instant) -> Self {
        Trace { request_id: request_id.into(), started, records: Vec::new(), split: [Duration::ZERO; 4] }
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Time since the trace began.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn push(&mut self, event: TraceEvent) {
        let t_ms = self.started.elapsed().as_secs_f64() * 1e3;
        self.records.push(TraceRecord { request_id: self.request_id.clone(), t_ms, event });
    }

    pub fn records(&self) -> &[TraceRecord] {
        &self.records
    }

    pub fn events(&self) -> impl Iterator<Item = &TraceEvent> {
        self.records.iter().map(|r| &r.event)
    }

    /// Add `d` to a phase of the wall-time split.
    pub fn add_time(&mut self, phase: Phase, d: Duration) {
        self.split[phase as usize] += d;
    }

    /// Run `f`, adding its duration to `phase`.
    pub fn timed<T>(&mut self, phase: Phase, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.add_time(phase, t.elapsed());
        out
    }

    /// A [`TraceEvent::Timing`] from the accumulated split and the time since the trace began.
    pub fn timing_event(&self) -> TraceEvent {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        TraceEvent::Timing {
            wall_ms: ms(self.started.elapsed()),
            prompt_ms: ms(self.split[Phase::Prompt as usize]),
            model_ms: ms(self.split[Phase::Model as usize]),
            tools_ms: ms(self.split[Phase::Tools as usize]),
            hooks_ms: ms(self.split[Phase::Hooks as usize]),
        }
    }

    /// Push the [`TraceEvent::Timing`] event (call once, at the end).
    pub fn finish_timing(&mut self) {
        let ev = self.timing_event();
        self.push(ev);
    }

    /// One JSON object per line.
    pub fn write_jsonl(&self, w: &mut impl Write) -> io::Result<()> {
        for r in &self.records {
            serde_json::to_writer(&mut *w, r).map_err(io::Error::other)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    }

    pub fn to_jsonl(&self) -> String {
        let mut buf = Vec::new();
        self.write_jsonl(&mut buf).expect("writing to a Vec does not fail");
        String::from_utf8(buf).expect("serde_json writes UTF-8")
    }

    /// Parse JSON lines back into records (blank lines skipped).
    pub fn parse_jsonl(text: &str) -> Result<Vec<TraceRecord>, serde_json::Error> {
        text.lines().filter(|l| !l.trim().is_empty()).map(serde_json::from_str).collect()
    }

    /// Totals: loops, generations and tokens, tool calls (and failures), hooks by decision, reply outcome,
    /// MTP acceptance (drafted / accepted summed over generations) and the timing split.
    pub fn summary(&self) -> Value {
        let mut generations = 0usize;
        let (mut prompt_tokens, mut completion_tokens) = (0usize, 0usize);
        let (mut ttft_first, mut model_wall_ms) = (None::<f64>, 0.0f64);
        let (mut drafted, mut accepted, mut speculated) = (0u64, 0u64, false);
        let (mut tool_calls, mut tool_errors, mut tools_latency_ms) = (0usize, 0usize, 0.0f64);
        let mut tools: Vec<String> = Vec::new();
        let mut hooks = serde_json::Map::new();
        let mut hooks_fired = 0usize;
        let (mut reply, mut outcome, mut loops) = (Value::Null, Value::Null, None::<usize>);
        let mut timing = Value::Null;
        let (mut faults, mut actions) = (Vec::<Value>::new(), Value::Null);
        let first_sentence_ms: Option<f64>;
        let mut skills = Value::Null;
        let mut llm = Value::Null;
        for ev in self.events() {
            match ev {
                TraceEvent::Start { llm: l, .. } => llm = json!(l),
                TraceEvent::Prompt { skills: s, .. } => skills = json!(s),
                TraceEvent::Generation { prompt_tokens: p, completion_tokens: c, ttft_ms, wall_ms, spec, .. } => {
                    generations += 1;
                    prompt_tokens += p;
                    completion_tokens += c;
                    ttft_first.get_or_insert(*ttft_ms);
                    model_wall_ms += wall_ms;
                    if let Some(s) = spec {
                        speculated = true;
                        drafted += s.get("drafted").and_then(Value::as_u64).unwrap_or(0);
                        accepted += s.get("accepted").and_then(Value::as_u64).unwrap_or(0);
                    }
                }
                TraceEvent::ToolCall { tool, ok, latency_ms, .. } => {
                    tool_calls += 1;
                    tools_latency_ms += latency_ms;
                    if !ok {
                        tool_errors += 1;
                    }
                    tools.push(tool.clone());
                }
                TraceEvent::Hook { hook, decision, .. } => {
                    hooks_fired += 1;
                    let entry = hooks.entry(hook.clone()).or_insert_with(|| json!({}));
                    let n = entry.get(decision).and_then(Value::as_u64).unwrap_or(0);
                    entry[decision.as_str()] = json!(n + 1);
                }
                TraceEvent::Reply { text, loops: l, outcome: o, actions: a } => {
                    reply = json!(text);
                    outcome = json!(o);
                    loops = Some(*l);
                    actions = json!(a);
                }
                TraceEvent::Fault { stage, target, error } => faults.push(json!({"stage": stage, "target": target, "error": error})),
                TraceEvent::Notice { .. } => {}
                TraceEvent::Sentence { .. } | TraceEvent::Room { .. } => {}
                TraceEvent::Timing { wall_ms, prompt_ms, model_ms, tools_ms, hooks_ms } => {
                    timing = json!({
                        "wall_ms": wall_ms, "prompt_ms": prompt_ms, "model_ms": model_ms,
                        "tools_ms": tools_ms, "hooks_ms": hooks_ms,
                    });
                }
            }
        }
        first_sentence_ms = self.records.iter().find(|r| matches!(r.event, TraceEvent::Sentence { .. })).map(|r| r.t_ms);
        let spec = if speculated {
            json!({
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
            })
        } else {
            Value::Null
        };
        json!({
            "request_id": self.request_id,
            "llm": llm,
            "skills": skills,
            "loops": loops.unwrap_or(generations),
            "generations": generations,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "first_ttft_ms": ttft_first,
            "model_wall_ms": model_wall_ms,
            "spec": spec,
            "tool_calls": tool_calls,
            "tool_errors": tool_errors,
            "tools": tools,
            "tools_latency_ms": tools_latency_ms,
            "hooks_fired": hooks_fired,
            "hooks": Value::Object(hooks),
            "reply": reply,
            "outcome": outcome,
            "actions": actions,
            "faults": faults,
            "time_to_first_sentence_ms": first_sentence_ms,
            "timing": timing,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Trace {
        let mut t = Trace::new("req-1");
        t.push(TraceEvent::Start {
            request_id: "req-1".into(),
            harness_version: "h-0.1".into(),
            comment: "这件多少钱？".into(),
            llm: "scripted".into(),
        });
        t.push(TraceEvent::Prompt { blocks: vec![PromptBlock::of("persona", "你是主播")], skills: vec!["pricing".into()] });
        t.push(TraceEvent::Generation {
            loop_index: 0,
            prompt_tokens: 100,
            completion_tokens: 20,
            ttft_ms: 12.5,
            decode_tokens_per_s: 40.0,
            wall_ms: 500.0,
            finish_reason: "stop".into(),
            spec: Some(json!({"drafted": 10, "accepted": 7})),
            text: "<tool_call>…</tool_call>".into(),
        });
        t.push(TraceEvent::ToolCall {
            loop_index: 0,
            server: "shop".into(),
            tool: "get_price".into(),
            arguments: json!({"sku": "A1"}),
            latency_ms: 3.0,
            ok: true,
            cached: false,
            result: Some("99".into()),
            error: None,
        });
        t.push(TraceEvent::Hook { point: "pre_reply".into(), hook: "length".into(), decision: "allow".into(), reason: None });
        t.push(TraceEvent::Generation {
            loop_index: 1,
            prompt_tokens: 130,
            completion_tokens: 10,
            ttft_ms: 8.0,
            decode_tokens_per_s: 41.0,
            wall_ms: 250.0,
            finish_reason: "stop".into(),
            spec: Some(json!({"drafted": 6, "accepted": 3})),
            text: "99 元".into(),
        });
        t.push(TraceEvent::Reply { text: Some("99 元".into()), loops: 2, outcome: "answered".into(), actions: Vec::new() });
        t.add_time(Phase::Model, Duration::from_millis(750));
        t.add_time(Phase::Tools, Duration::from_millis(3));
        t.finish_timing();
        t
    }

    #[test]
    fn events_serialize_tagged_with_request_id_and_time() {
        let t = sample();
        let text = t.to_jsonl();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 8);
        let kinds: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["start", "prompt", "generation", "tool_call", "hook", "generation", "reply", "timing"]);
        for l in &lines {
            assert_eq!(l["request_id"], "req-1");
            assert!(l["t_ms"].as_f64().unwrap() >= 0.0);
        }
        assert_eq!(lines[0]["harness_version"], "h-0.1");
        assert_eq!(lines[0]["comment"], "这件多少钱？");
        assert_eq!(lines[1]["blocks"][0]["name"], "persona");
        assert_eq!(lines[1]["blocks"][0]["hash"].as_str().unwrap().len(), 16);
        assert_eq!(lines[1]["blocks"][0]["chars"], 4);
        assert_eq!(lines[1]["skills"], json!(["pricing"]));
        assert_eq!(lines[2]["spec"]["accepted"], 7);
        assert_eq!(lines[3]["arguments"]["sku"], "A1");
        assert_eq!(lines[3]["result"], "99");
        assert!(lines[3].get("error").is_none(), "None fields are omitted");
        assert!(lines[4].get("reason").is_none());
        assert_eq!(lines[6]["outcome"], "answered");
        assert!((lines[7]["model_ms"].as_f64().unwrap() - 750.0).abs() < 1e-9);
        // Field order: request_id, t_ms, event first.
        assert!(text.lines().next().unwrap().starts_with(r#"{"request_id":"req-1","t_ms":"#));
    }

    #[test]
    fn jsonl_round_trips() {
        let t = sample();
        let back = Trace::parse_jsonl(&t.to_jsonl()).unwrap();
        assert_eq!(back.len(), t.records().len());
        for (b, r) in back.iter().zip(t.records()) {
            assert_eq!(b.request_id, r.request_id);
            assert!((b.t_ms - r.t_ms).abs() <= 1e-9 * r.t_ms.abs().max(1.0));
            if let (TraceEvent::Timing { wall_ms: a, .. }, TraceEvent::Timing { wall_ms: c, .. }) = (&b.event, &r.event) {
                assert!((a - c).abs() <= 1e-9 * c.abs().max(1.0));
            } else {
                assert_eq!(b.event, r.event);
            }
        }
    }

    #[test]
    fn summary_totals() {
        let s = sample().summary();
        assert_eq!(s["loops"], 2);
        assert_eq!(s["generations"], 2);
        assert_eq!(s["prompt_tokens"], 230);
        assert_eq!(s["completion_tokens"], 30);
        assert_eq!(s["first_ttft_ms"], 12.5);
        assert_eq!(s["spec"]["drafted"], 16);
        assert_eq!(s["spec"]["accepted"], 10);
        assert_eq!(s["tool_calls"], 1);
        assert_eq!(s["tool_errors"], 0);
        assert_eq!(s["tools"], json!(["get_price"]));
        assert_eq!(s["hooks_fired"], 1);
        assert_eq!(s["hooks"]["length"]["allow"], 1);
        assert_eq!(s["outcome"], "answered");
        assert_eq!(s["skills"], json!(["pricing"]));
        assert!((s["timing"]["tools_ms"].as_f64().unwrap() - 3.0).abs() < 1e-9);
        assert!(s["timing"]["wall_ms"].as_f64().unwrap() >= 0.0);
    }

    #[test]
    fn empty_trace_summary() {
        let s = Trace::new("x").summary();
        assert_eq!(s["loops"], 0);
        assert_eq!(s["spec"], Value::Null);
        assert_eq!(s["timing"], Value::Null);
    }

    #[test]
    fn block_hash_is_stable_fnv1a() {
        assert_eq!(block_hash(""), "cbf29ce484222325");
        assert_eq!(block_hash("a"), "af63dc4c8601ec8c");
        assert_ne!(block_hash("主播"), block_hash("主播 "));
    }

    #[test]
    fn timed_accumulates() {
        let mut t = Trace::new("x");
        let v = t.timed(Phase::Hooks, || 7);
        assert_eq!(v, 7);
        let TraceEvent::Timing { hooks_ms, wall_ms, .. } = t.timing_event() else { unreachable!() };
        assert!(hooks_ms >= 0.0 && wall_ms >= hooks_ms);
    }
}
