//! Dimension `tool-def`: how tools are named and described to the model. The function is untouched: a renamed
//! tool is a `tools.json` `rename`, so the registry maps the new name to the same real MCP tool; a new
//! parameter description is written into a copy of the tool's schema (same properties, types and `required`).
//!
//! Kinds: `rename_tool`, `rewrite_tool_description`, `rewrite_parameter_description` (target `tool.param`),
//! `update_tool_reference` (a backticked mention in a skill, rules.md, faq.jsonl or harness.json, or a bare
//! mention in another tool's description or parameter description, now uses the new name, so the text and the
//! tool list agree). Targets are the tool's `tools.json` key (its real name, or
//! `server/name`).

use std::collections::BTreeSet;

use regex::Regex;
use serde_json::{Map, Value, json};

use super::{Ctx, PerturbError, Tree, json_of, paraphrase, pretty};
use crate::harness::{FAQ_JSONL, HARNESS_JSON, RULES_MD, TOOLS_JSON};
use crate::tools::ToolOverride;

/// One tool as the harness presents it.
struct Tool {
    /// The `tools.json` key (existing, or the real name for a new entry).
    key: String,
    real: String,
    /// The name the model sees now.
    shown: String,
    description: Option<String>,
    schema: Option<Value>,
}

fn tools_of(tree: &Tree, ctx: &Ctx<'_>) -> Result<(Map<String, Value>, Vec<Tool>), PerturbError> {
    let text = tree.text(TOOLS_JSON)?.unwrap_or_else(|| "{\"tools\": {}}".into());
    let root = json_of(TOOLS_JSON, &text)?;
    let entries = root.get("tools").and_then(Value::as_object).cloned().unwrap_or_default();
    let entry = |key: &str| -> Result<Option<ToolOverride>, PerturbError> {
        entries
            .get(key)
            .map(|v| serde_json::from_value::<ToolOverride>(v.clone()))
            .transpose()
            .map_err(|e| PerturbError::Input { file: TOOLS_JSON.into(), message: format!("tools.{key}: {e}") })
    };
    let mut tools = Vec::new();
    let mut seen = BTreeSet::new();
    let mut specs: Vec<_> = ctx.tools.iter().collect();
    specs.sort_by(|a, b| (&a.name, &a.server).cmp(&(&b.name, &b.server)));
    for spec in specs {
        let full = format!("{}/{}", spec.server, spec.name);
        let key = if entries.contains_key(&full) { full } else { spec.name.clone() };
        if !seen.insert(key.clone()) {
            continue; // the same name from a second server: one entry covers both, leave it alone
        }
        let o = entry(&key)?.unwrap_or_default();
        if o.hidden {
            continue;
        }
        tools.push(Tool {
            shown: o.rename.clone().unwrap_or_else(|| spec.name.clone()),
            description: o.description.clone().or_else(|| Some(spec.description.clone()).filter(|d| !d.is_empty())),
            schema: o.input_schema.clone().or_else(|| Some(spec.input_schema.clone())),
            real: spec.name.clone(),
            key,
        });
    }
    // Entries for tools no server listed (offline): what tools.json itself says.
    for key in entries.keys() {
        if seen.contains(key) {
            continue;
        }
        let o = entry(key)?.unwrap_or_default();
        let real = key.rsplit('/').next().unwrap_or(key).to_string();
        if o.hidden || seen.contains(&real) {
            continue;
        }
        tools.push(Tool {
            shown: o.rename.clone().unwrap_or_else(|| real.clone()),
            description: o.description.clone(),
            schema: o.input_schema.clone(),
            real,
            key: key.clone(),
        });
    }
    Ok((entries, tools))
}

/// The files whose backticked tool names follow a rename.
fn reference_files(tree: &Tree) -> Vec<String> {
    let mut files = tree.skill_files();
    files.extend([RULES_MD, FAQ_JSONL, HARNESS_JSON].iter().map(|s| s.to_string()).filter(|f| tree.files.contains_key(f)));
    files
}

pub fn apply(tree: &mut Tree, ctx: &mut Ctx<'_>) -> Result<(), PerturbError> {
    let (mut entries, tools) = tools_of(tree, ctx)?;
    if tools.is_empty() {
        return Ok(());
    }
    // Every name in use (shown, real, aliases): a new name must collide with none.
    let mut taken: BTreeSet<String> = tools.iter().flat_map(|t| [t.shown.clone(), t.real.clone()]).collect();
    for v in entries.values() {
        if let Some(a) = v.get("aliases").and_then(Value::as_array) {
            taken.extend(a.iter().filter_map(|x| x.as_str().map(String::from)));
        }
    }
    // 1. Decide: which tools change, how, and their new names (so every text below can follow the renames).
    let mut chosen: Vec<usize> = (0..tools.len()).filter(|_| ctx.rng.chance(0.4 + 0.6 * ctx.strength)).collect();
    if chosen.is_empty() {
        chosen.push(ctx.rng.below(tools.len()));
    }
    let mut plan: Vec<(bool, bool)> = vec![(false, false); tools.len()]; // (description, parameters)
    let mut renames: Vec<(String, String, String)> = Vec::new(); // (key, old name, new)
    for &i in &chosen {
        let t = &tools[i];
        let desc = t.description.is_some() && ctx.rng.chance(0.5 + 0.5 * ctx.strength);
        let has_params = t.schema.as_ref().and_then(|s| s.get("properties")).and_then(Value::as_object).is_some_and(|p| !p.is_empty());
        let params = has_params && ctx.rng.chance(ctx.strength);
        plan[i] = (desc, params);
        if !(desc || params) || ctx.rng.chance(0.5 + 0.5 * ctx.strength) {
            let new = (0..16).map(|_| paraphrase::new_name(&mut ctx.rng, &t.shown, '_')).find(|n| !taken.contains(n));
            if let Some(new) = new {
                taken.insert(new.clone());
                ctx.record("rename_tool", &t.key, TOOLS_JSON, t.shown.clone(), new.clone());
                renames.push((t.key.clone(), t.shown.clone(), new.clone()));
                // A mention by the real name also means this tool.
                if t.real != t.shown {
                    renames.push((t.key.clone(), t.real.clone(), new));
                }
            }
        }
    }
    // Tool texts name other tools as bare words ("the id from search_products"): they follow too.
    let follow = |text: &str| -> String {
        let mut out = text.to_string();
        for (_, old, new) in &renames {
            let re = Regex::new(&format!(r"\b{}\b", regex::escape(old))).expect("valid name regex");
            out = re.replace_all(&out, new.as_str()).into_owned();
        }
        out
    };

    // 2. Write every tool whose name, description or parameter descriptions change.
    for (i, t) in tools.iter().enumerate() {
        let (desc, params) = plan[i];
        let mut entry = entries.get(&t.key).and_then(Value::as_object).cloned().unwrap_or_default();
        let mut changed = false;
        if let Some((_, _, new)) = renames.iter().find(|r| r.0 == t.key) {
            entry.insert("rename".into(), json!(new));
            changed = true;
        }
        if let Some(old) = &t.description {
            let new = if desc {
                let template = paraphrase::tool_description(&mut ctx.rng, old);
                ctx.rewrite("tool description", &t.key, TOOLS_JSON, old, template)?
            } else {
                old.clone()
            };
            let new = follow(&new);
            if &new != old {
                let kind = if desc { "rewrite_tool_description" } else { "update_tool_reference" };
                ctx.record(kind, &t.key, TOOLS_JSON, old.clone(), new.clone());
                entry.insert("description".into(), json!(new));
                changed = true;
            }
        }
        if let Some(mut schema) = t.schema.clone()
            && let Some(props) = schema.get_mut("properties").and_then(Value::as_object_mut)
        {
            let mut touched = false;
            for (name, p) in props.iter_mut() {
                let Some(p) = p.as_object_mut() else { continue };
                let old = p.get("description").and_then(Value::as_str).map(String::from);
                let new = match (&old, params) {
                    (Some(o), true) => {
                        let template = paraphrase::rule(&mut ctx.rng, o);
                        ctx.rewrite("parameter description", &format!("{}.{name}", t.key), TOOLS_JSON, o, template)?
                    }
                    (None, true) => paraphrase::parameter_description(&mut ctx.rng, name, None),
                    (Some(o), false) => o.clone(),
                    (None, false) => continue,
                };
                let new = follow(&new);
                if Some(&new) != old.as_ref() {
                    let kind = if params { "rewrite_parameter_description" } else { "update_tool_reference" };
                    ctx.record(kind, &format!("{}.{name}", t.key), TOOLS_JSON, old.unwrap_or_default(), new.clone());
                    p.insert("description".into(), json!(new));
                    touched = true;
                }
            }
            if touched {
                entry.insert("input_schema".into(), schema);
                changed = true;
            }
        }
        if changed {
            entries.insert(t.key.clone(), Value::Object(entry));
        }
    }
    tree.set_text(TOOLS_JSON, pretty(&json!({"tools": entries})));

    // Backticked mentions follow the renames.
    for file in reference_files(tree) {
        let Some(mut text) = tree.text(&file)? else { continue };
        let before = text.clone();
        for (key, old, new) in &renames {
            let (from, to) = (format!("`{old}`"), format!("`{new}`"));
            if text.contains(&from) {
                text = text.replace(&from, &to);
                ctx.record("update_tool_reference", key, &file, from, to);
            }
        }
        if text != before {
            tree.set_text(&file, text);
        }
    }
    Ok(())
}
