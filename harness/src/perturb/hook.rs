//! Dimension `hook`: how the hooks react, never what they protect (every built-in stays on).
//!
//! Kinds: `set_retry_budget` (a built-in or external hook that retries: 1 ..= min(3, max_loops - 1)),
//! `set_feedback` (`feedback.reply_retry` / `feedback.tool_call_retry`: the wording and structure of the message
//! a `Retry` puts before the model), `set_modification` (`reply_length.on_violation` truncate ↔ retry,
//! `tool_result.max_chars` within 3000..=8000). Applied after `prompt`, so budgets respect the variant's
//! `max_loops`.

use serde_json::{Value, json};

use super::{Ctx, PerturbError, Tree, json_of, pretty};
use crate::harness::{HARNESS_JSON, HOOKS_JSON};
use crate::hooks::FeedbackConfig;

/// Feedback after a refused reply: different wording and structure, each with `{reason}`.
const REPLY_FEEDBACK: &[&str] = &[
    "(system) The reply was held back because {reason}. Please answer again.",
    "[hook feedback]\nproblem: {reason}\naction: write a new reply that fixes it",
    "Note from the moderator: {reason}. Try the reply once more.",
    "(check failed) {reason} -- reply again, shorter and grounded.",
    "Your last answer cannot go on air: {reason}. Give a corrected answer.",
];
/// Feedback after a tool call that did not parse.
const TOOL_CALL_FEEDBACK: &[&str] = &[
    "(system) That tool call was malformed: {reason}. Send it again in the tool-call format.",
    "[hook feedback]\nproblem: {reason}\naction: repeat the tool call in the required format",
    "The tool call could not be read ({reason}). Please write it again.",
    "(parse error) {reason}. Re-send the call.",
];

/// Built-ins that retry (the others have budget 0 and never ask the model again).
const RETRYING: &[&str] = &[
    "tool_call_syntax",
    "tool_args",
    "leaked_reasoning",
    "leaked_tool_syntax",
    "forbidden_claims",
    "grounding",
    "invented_discount",
    "reply_length",
];

/// Default retry budget of a built-in (as in `hooks/config.rs`).
fn default_budget(name: &str) -> u64 {
    match name {
        "tool_call_syntax" | "tool_args" => 2,
        _ => 1,
    }
}

pub fn apply(tree: &mut Tree, ctx: &mut Ctx<'_>) -> Result<(), PerturbError> {
    let text = tree.text(HOOKS_JSON)?.unwrap_or_else(|| "{}".into());
    let mut hooks = json_of(HOOKS_JSON, &text)?;
    if !hooks.is_object() {
        return Err(PerturbError::Input { file: HOOKS_JSON.into(), message: "expected a JSON object".into() });
    }
    let config = json_of(HARNESS_JSON, &tree.text(HARNESS_JSON)?.unwrap_or_else(|| "{}".into()))?;
    let max_loops = config.get("max_loops").and_then(Value::as_u64).unwrap_or(4);
    let top = 3.min(max_loops.saturating_sub(1)).max(1);

    // 1. Retry budgets.
    for name in RETRYING {
        let b = &mut hooks["builtins"][*name];
        if !b.is_object() {
            *b = json!({});
        }
        if b.get("enabled").and_then(Value::as_bool) == Some(false) || !ctx.rng.chance(0.6 * ctx.strength) {
            continue;
        }
        let old = b.get("retry_budget").and_then(Value::as_u64).unwrap_or_else(|| default_budget(name));
        let options: Vec<u64> = (1..=top).filter(|&v| v != old).collect();
        if let Some(&new) = (!options.is_empty()).then(|| ctx.rng.pick(&options)) {
            b["retry_budget"] = json!(new);
            ctx.record("set_retry_budget", name, HOOKS_JSON, old.to_string(), new.to_string());
        }
    }
    if let Some(ext) = hooks.get_mut("external").and_then(Value::as_array_mut) {
        for h in ext.iter_mut() {
            let name = h.get("name").and_then(Value::as_str).unwrap_or("").to_string();
            let old = h.get("retry_budget").and_then(Value::as_u64).unwrap_or(1);
            let options: Vec<u64> = (1..=top).filter(|&v| v != old).collect();
            if !options.is_empty() && ctx.rng.chance(0.6 * ctx.strength) {
                let new = *ctx.rng.pick(&options);
                h["retry_budget"] = json!(new);
                ctx.record("set_retry_budget", &name, HOOKS_JSON, old.to_string(), new.to_string());
            }
        }
    }
    // Empty builtin objects added above only to index into: drop them again so the file says what changed.
    if let Some(b) = hooks.get_mut("builtins").and_then(Value::as_object_mut) {
        b.retain(|_, v| v.as_object().is_none_or(|o| !o.is_empty()));
    }

    // 2. Feedback wording and structure (always one of the two: the most visible hook surface).
    let defaults = FeedbackConfig::default();
    let current = |key: &str, default: &str| {
        hooks.get("feedback").and_then(|f| f.get(key)).and_then(Value::as_str).unwrap_or(default).to_string()
    };
    let (reply_old, tool_old) =
        (current("reply_retry", &defaults.reply_retry), current("tool_call_retry", &defaults.tool_call_retry));
    let change_reply = ctx.rng.chance(0.5 + 0.5 * ctx.strength);
    let change_tool = ctx.rng.chance(0.5 * ctx.strength) || !change_reply;
    for (key, old, bank, on) in
        [("reply_retry", reply_old, REPLY_FEEDBACK, change_reply), ("tool_call_retry", tool_old, TOOL_CALL_FEEDBACK, change_tool)]
    {
        if !on {
            continue;
        }
        let options: Vec<&str> = bank.iter().copied().filter(|t| *t != old).collect();
        let new = ctx.rng.pick(&options).to_string();
        if !hooks["feedback"].is_object() {
            hooks["feedback"] = json!({});
        }
        hooks["feedback"][key] = json!(new);
        ctx.record("set_feedback", &format!("feedback.{key}"), HOOKS_JSON, old, new);
    }

    // 3. Which modifications apply.
    if ctx.rng.chance(0.5 * ctx.strength) {
        let b = &mut hooks["builtins"]["reply_length"];
        if !b.is_object() {
            *b = json!({});
        }
        let old = b.get("on_violation").and_then(Value::as_str).unwrap_or("truncate").to_string();
        let new = if old == "truncate" { "retry" } else { "truncate" };
        b["on_violation"] = json!(new);
        ctx.record("set_modification", "reply_length.on_violation", HOOKS_JSON, old, new);
    }
    if ctx.rng.chance(0.5 * ctx.strength) {
        let b = &mut hooks["builtins"]["tool_result"];
        if !b.is_object() {
            *b = json!({});
        }
        let old = b.get("max_chars").and_then(Value::as_u64).unwrap_or(4000);
        let options: Vec<u64> = (3..=8).map(|k| k * 1000).filter(|&v| v != old).collect();
        let new = *ctx.rng.pick(&options);
        b["max_chars"] = json!(new);
        ctx.record("set_modification", "tool_result.max_chars", HOOKS_JSON, old.to_string(), new.to_string());
    }
    tree.set_text(HOOKS_JSON, pretty(&hooks));
    Ok(())
}
