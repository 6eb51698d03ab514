//! Dimension `prompt`: the system prompt's structure and numeric constraints.
//!
//! Kinds: `reorder_blocks` (`harness.json` `blocks`; the same blocks, another order), `reorder_items` (a run of
//! consecutive `rules.md` rules, or the `faq.jsonl` lines; before/after are the ids or line numbers in order),
//! `set_limit` (`max_reply_chars` within [max(60, 0.8 x), 1.5 x] in steps of 10; `max_loops` within
//! [3, the ceiling] and x - 1 ..= x + 2). Both limits are what the `constraints` block tells the model and what
//! the agent enforces, so the prompt and the runtime stay in agreement.

use serde_json::{Value, json};

use super::{Ctx, PerturbError, Tree, json_of, pretty};
use crate::harness::{FAQ_JSONL, HARNESS_JSON, RULES_MD};
use crate::limits::MAX_LOOPS_CEILING;
use crate::prompt::BlockKind;
use crate::skill::parse_rules;

/// The least reply length a variant may set: room for one short sentence with a price.
const MIN_REPLY_CHARS: u64 = 60;
/// The fewest loops a variant may set: a lookup, a second lookup, a reply.
const MIN_LOOPS: u64 = 3;

fn reorder_blocks(config: &mut Value, ctx: &mut Ctx<'_>) {
    let current: Vec<String> = match config.get("blocks").and_then(Value::as_array) {
        Some(b) => b.iter().filter_map(|v| v.as_str().map(String::from)).collect(),
        None => BlockKind::DEFAULT_ORDER.iter().map(|b| b.name().to_string()).collect(),
    };
    if current.len() < 2 {
        return;
    }
    let mut new = current.clone();
    ctx.rng.shuffle_changed(&mut new);
    config["blocks"] = json!(new);
    ctx.record("reorder_blocks", "blocks", HARNESS_JSON, current.join(","), new.join(","));
}

fn set_limits(config: &mut Value, ctx: &mut Ctx<'_>) {
    let defaults = crate::config::Constraints::default();
    let reply = config.get("max_reply_chars").and_then(Value::as_u64).unwrap_or(defaults.max_reply_chars as u64);
    let loops = config.get("max_loops").and_then(Value::as_u64).unwrap_or(u64::from(defaults.max_loops));
    if ctx.rng.chance(0.5 + 0.5 * ctx.strength) {
        let lo = MIN_REPLY_CHARS.max(reply * 8 / 10).div_ceil(10);
        let hi = (reply * 3 / 2) / 10;
        let options: Vec<u64> = (lo..=hi).map(|t| t * 10).filter(|&v| v != reply).collect();
        if !options.is_empty() {
            let new = *ctx.rng.pick(&options);
            config["max_reply_chars"] = json!(new);
            ctx.record("set_limit", "max_reply_chars", HARNESS_JSON, reply.to_string(), new.to_string());
        }
    }
    if ctx.rng.chance(0.3 + 0.5 * ctx.strength) {
        let ceiling = u64::from(MAX_LOOPS_CEILING);
        let options: Vec<u64> = (loops.saturating_sub(1).max(MIN_LOOPS)..=(loops + 2).min(ceiling)).filter(|&v| v != loops).collect();
        if !options.is_empty() {
            let new = *ctx.rng.pick(&options);
            config["max_loops"] = json!(new);
            ctx.record("set_limit", "max_loops", HARNESS_JSON, loops.to_string(), new.to_string());
        }
    }
}

/// Shuffle runs of consecutive rule lines in rules.md.
fn reorder_rules(tree: &mut Tree, ctx: &mut Ctx<'_>) -> Result<(), PerturbError> {
    let Some(text) = tree.text(RULES_MD)? else { return Ok(()) };
    let mut lines: Vec<String> = text.split('\n').map(str::to_string).collect();
    let rule_at: Vec<Option<String>> = lines.iter().map(|l| parse_rules(l, 1).into_iter().next().map(|r| r.id)).collect();
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for (i, id) in rule_at.iter().enumerate() {
        if id.is_none() {
            continue;
        }
        match runs.last_mut() {
            Some(run) if run.last() == Some(&(i.wrapping_sub(1))) => run.push(i),
            _ => runs.push(vec![i]),
        }
    }
    for run in runs.into_iter().filter(|r| r.len() > 1) {
        if !ctx.rng.chance(0.5 + 0.5 * ctx.strength) {
            continue;
        }
        let mut perm = run.clone();
        ctx.rng.shuffle_changed(&mut perm);
        let originals: Vec<String> = perm.iter().map(|&i| lines[i].clone()).collect();
        for (&slot, line) in run.iter().zip(originals) {
            lines[slot] = line;
        }
        let ids = |v: &[usize]| v.iter().filter_map(|&i| rule_at[i].clone()).collect::<Vec<_>>().join(",");
        ctx.record("reorder_items", "rules", RULES_MD, ids(&run), ids(&perm));
    }
    let new = lines.join("\n");
    if new != text {
        tree.set_text(RULES_MD, new);
    }
    Ok(())
}

/// Shuffle the FAQ entries (retrieval is by score, so only ties and the file's look change).
fn reorder_faq(tree: &mut Tree, ctx: &mut Ctx<'_>) -> Result<(), PerturbError> {
    let Some(text) = tree.text(FAQ_JSONL)? else { return Ok(()) };
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.len() < 2 || !ctx.rng.chance(ctx.strength) {
        return Ok(());
    }
    let mut perm: Vec<usize> = (0..lines.len()).collect();
    ctx.rng.shuffle_changed(&mut perm);
    let new: String = perm.iter().map(|&i| format!("{}\n", lines[i])).collect();
    let order = |v: &[usize]| v.iter().map(|i| (i + 1).to_string()).collect::<Vec<_>>().join(",");
    ctx.record("reorder_items", "faq", FAQ_JSONL, order(&(0..lines.len()).collect::<Vec<_>>()), order(&perm));
    tree.set_text(FAQ_JSONL, new);
    Ok(())
}

pub fn apply(tree: &mut Tree, ctx: &mut Ctx<'_>) -> Result<(), PerturbError> {
    let text = tree.text(HARNESS_JSON)?.unwrap_or_else(|| "{}".into());
    let mut config = json_of(HARNESS_JSON, &text)?;
    if !config.is_object() {
        return Err(PerturbError::Input { file: HARNESS_JSON.into(), message: "expected a JSON object".into() });
    }
    let before = ctx.changes.len();
    if ctx.rng.chance(0.5 + 0.5 * ctx.strength) {
        reorder_blocks(&mut config, ctx);
    }
    set_limits(&mut config, ctx);
    reorder_rules(tree, ctx)?;
    reorder_faq(tree, ctx)?;
    if ctx.changes.len() == before {
        reorder_blocks(&mut config, ctx);
    }
    if ctx.changes.iter().any(|c| c.file == HARNESS_JSON) {
        tree.set_text(HARNESS_JSON, pretty(&config));
    }
    Ok(())
}
