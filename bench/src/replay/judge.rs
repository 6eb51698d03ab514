//! The optional judge (`--judge URL`): an OpenAI-compatible model scores each measured reply.
//!
//! The judge is itself a harness (`harness/judge/`): its rules and the rubric skill become the system
//! prompt; the user message is the case (comment, history, room), the tool results the agent saw and the
//! reply. The model answers with one JSON object `{"accuracy": 0|1, "effectiveness": 0|0.5|1, "reason"}`;
//! AVG is the per-case mean of the two, before any rounding.

use std::path::Path;

use nextn_agent::llm::{ChatRequest, LlmClient, LlmError, OpenAiClient};
use nextn_harness::{Harness, RequestContext};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::cases::Case;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// 1: no factual error, unsupported claim, false promise or capability overreach; else 0.
    pub accuracy: f64,
    /// 1: addresses the viewer's intent with useful information; 0.5 partly; 0 not at all.
    pub effectiveness: f64,
    /// Mean of the two.
    pub avg: f64,
    #[serde(default)]
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum JudgeError {
    #[error("judge harness {dir}: {source}")]
    Harness { dir: String, source: nextn_harness::HarnessError },
    #[error("judge endpoint: {0}")]
    Llm(#[from] LlmError),
    #[error("the judge's answer is not a verdict ({reason}): {text}")]
    Verdict { reason: String, text: String },
}

/// Parse the first JSON object in `text` (code fences and prose around it are ignored) as a verdict.
pub fn parse_verdict(text: &str) -> Result<Verdict, JudgeError> {
    let bad = |reason: &str| JudgeError::Verdict { reason: reason.into(), text: text.chars().take(300).collect() };
    let start = text.find('{').ok_or_else(|| bad("no JSON object"))?;
    let mut de = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
    let v = match de.next() {
        Some(Ok(v)) => v,
        _ => return Err(bad("malformed JSON")),
    };
    let num = |k: &str| v.get(k).and_then(|x| x.as_f64().or_else(|| x.as_str().and_then(|s| s.trim().parse().ok())));
    let accuracy = num("accuracy").ok_or_else(|| bad("no numeric `accuracy`"))?;
    let effectiveness = num("effectiveness").ok_or_else(|| bad("no numeric `effectiveness`"))?;
    if accuracy != 0.0 && accuracy != 1.0 {
        return Err(bad("accuracy must be 0 or 1"));
    }
    if ![0.0, 0.5, 1.0].contains(&effectiveness) {
        return Err(bad("effectiveness must be 0, 0.5 or 1"));
    }
    let reason = v.get("reason").and_then(Value::as_str).unwrap_or_default().to_string();
    Ok(Verdict { accuracy, effectiveness, avg: (accuracy + effectiveness) / 2.0, reason })
}

pub struct Judge {
    harness: Harness,
    client: Box<dyn LlmClient>,
}

impl Judge {
    /// The judge harness in `harness_dir`, asking the endpoint at `url` for `model`.
    pub fn new(harness_dir: &Path, url: &str, model: &str) -> Result<Self, JudgeError> {
        let harness = Harness::load(harness_dir).map_err(|source| JudgeError::Harness { dir: harness_dir.display().to_string(), source })?;
        let client = OpenAiClient::new(url, model)?.with_stream(false);
        Ok(Judge { harness, client: Box::new(client) })
    }

    /// The user message for one case: what the viewer said, the context, what the tools returned and the reply.
    pub fn message(case: &Case, tool_results: &[String], reply: &str) -> String {
        json!({
            "viewer_comment": case.comment,
            "history": case.history,
            "room": case.room,
            "tool_results": tool_results,
            "host_reply": reply,
        })
        .to_string()
    }

    /// Score one reply (greedy, one call).
    pub fn judge(&mut self, case: &Case, tool_results: &[String], reply: &str) -> Result<Verdict, JudgeError> {
        let user = Self::message(case, tool_results, reply);
        let ctx = RequestContext::new(user.clone());
        let system = self
            .harness
            .build_prompt(&ctx, None)
            .map_err(|source| JudgeError::Harness { dir: self.harness.dir().display().to_string(), source })?
            .system;
        let req = ChatRequest {
            messages: vec![json!({"role": "system", "content": system}), json!({"role": "user", "content": user})],
            max_tokens: 256,
            temperature: 0.0,
            top_p: 1.0,
            ..ChatRequest::default()
        };
        let out = self.client.generate(&req)?;
        parse_verdict(&out.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_parse_from_fenced_json_and_avg_is_the_unrounded_mean() {
        let v = parse_verdict("Here:\n```json\n{\"accuracy\": 1, \"effectiveness\": 0.5, \"reason\": \"partly\"}\n```").unwrap();
        assert_eq!((v.accuracy, v.effectiveness, v.avg), (1.0, 0.5, 0.75));
        assert_eq!(v.reason, "partly");
    }

    #[test]
    fn out_of_rubric_scores_are_refused() {
        assert!(parse_verdict("{\"accuracy\": 0.5, \"effectiveness\": 1}").is_err());
        assert!(parse_verdict("{\"accuracy\": 1, \"effectiveness\": 0.7}").is_err());
        assert!(parse_verdict("no json here").is_err());
    }

    #[test]
    fn the_bundled_judge_harness_loads_and_carries_the_rubric() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../harness/judge");
        let h = Harness::load(&dir).unwrap();
        let p = h.build_prompt(&RequestContext::new("{\"viewer_comment\": \"how much?\"}"), None).unwrap();
        assert!(p.system.contains("Accuracy") && p.system.contains("Effectiveness"), "{}", p.system);
    }
}
