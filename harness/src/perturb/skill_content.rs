//! Dimension `skill-content`: the reply rules inside each `SKILL.md` body.
//!
//! Kinds: `mask_rule` (the line is removed; `after` is empty), `paraphrase_rule` (the text after `[ID]`
//! rewritten from the bank), `reorder_rules` (a run of consecutive rule lines shuffled; before/after are the id
//! orders). Essential rules (see the module docs of [`super`]) are only ever reordered; a skill keeps at least one
//! rule.

use std::collections::BTreeSet;
use std::path::Path;

use super::{Ctx, PerturbError, Tree, paraphrase};
use crate::skill::{Skill, parse_rules, parse_skill};

/// The skill in `file`, or an input error naming it.
pub(crate) fn skill_of(file: &str, text: &str) -> Result<Skill, PerturbError> {
    parse_skill(Path::new(file), text).map_err(|e| PerturbError::Input { file: file.into(), message: e.message() })
}

/// Ids listed under `essential:` in the front matter (top level or under `metadata`).
pub(crate) fn listed_essential(skill: &Skill) -> BTreeSet<String> {
    let top = skill.metadata.get("essential");
    let nested = skill.metadata.get("metadata").and_then(|m| m.get("essential"));
    top.into_iter().chain(nested).filter_map(|v| v.as_list()).flatten().collect()
}

/// Whether a rule must survive unchanged in wording: listed as essential, or it names a tool, an action
/// marker or a figure.
pub fn is_essential_rule(listed: &BTreeSet<String>, id: &str, text: &str) -> bool {
    listed.contains(id) || text.contains('`') || text.contains("[show_") || text.chars().any(|c| c.is_ascii_digit())
}

/// Index of the first body line (after the closing `---` of the front matter).
pub(crate) fn body_start(lines: &[&str]) -> usize {
    let mut fences = 0;
    for (i, l) in lines.iter().enumerate() {
        if l.trim_end() == "---" {
            fences += 1;
            if fences == 2 {
                return i + 1;
            }
        }
    }
    0
}

/// A rule line: index in the file, id, and the text after `[ID]`.
struct RuleLine {
    index: usize,
    id: String,
    text: String,
}

fn rule_lines(lines: &[&str]) -> Vec<RuleLine> {
    let start = body_start(lines);
    lines
        .iter()
        .enumerate()
        .skip(start)
        .filter_map(|(i, l)| {
            parse_rules(l, 1).into_iter().next().map(|r| RuleLine { index: i, id: r.id, text: r.text })
        })
        .collect()
}

/// `line` with the text after its `[ID]` replaced by `text`.
fn with_text(line: &str, text: &str) -> String {
    let close = line.find(']').map_or(line.len(), |i| i + 1);
    format!("{} {text}", &line[..close])
}

pub fn apply(tree: &mut Tree, ctx: &mut Ctx<'_>) -> Result<(), PerturbError> {
    // 1. Candidates: every non-essential rule, by file.
    let files = tree.skill_files();
    let mut texts = Vec::new();
    let mut candidates: Vec<(usize, usize)> = Vec::new(); // (file index, rule index)
    let mut rules_per_file = Vec::new();
    for (fi, file) in files.iter().enumerate() {
        let text = tree.text(file)?.unwrap_or_default();
        let skill = skill_of(file, &text)?;
        let listed = listed_essential(&skill);
        let lines: Vec<&str> = text.split('\n').collect();
        let rules = rule_lines(&lines);
        for (ri, r) in rules.iter().enumerate() {
            if !is_essential_rule(&listed, &r.id, &r.text) {
                candidates.push((fi, ri));
            }
        }
        rules_per_file.push((skill.name, rules));
        texts.push(text);
    }

    // 2. Decide: masks first (a skill keeps one rule), then paraphrases of the rest; at least one change.
    let mut order = candidates.clone();
    ctx.rng.shuffle(&mut order);
    let n_mask = ctx.count(candidates.len(), 0.25, 0);
    let mut masked: BTreeSet<(usize, usize)> = BTreeSet::new();
    for &(fi, ri) in &order {
        if masked.len() >= n_mask {
            break;
        }
        let left = rules_per_file[fi].1.len() - masked.iter().filter(|(f, _)| *f == fi).count();
        if left > 1 {
            masked.insert((fi, ri));
        }
    }
    let mut paraphrased: BTreeSet<(usize, usize)> = BTreeSet::new();
    for &c in &candidates {
        if !masked.contains(&c) && ctx.rng.chance(0.6 * ctx.strength) {
            paraphrased.insert(c);
        }
    }
    if masked.is_empty() && paraphrased.is_empty() && !candidates.is_empty() {
        paraphrased.insert(*ctx.rng.pick(&candidates));
    }

    // 3. Apply per file: paraphrase, reorder runs, then drop masked lines.
    for (fi, file) in files.iter().enumerate() {
        let (skill, rules) = &rules_per_file[fi];
        let mut lines: Vec<String> = texts[fi].split('\n').map(str::to_string).collect();
        for (ri, r) in rules.iter().enumerate() {
            if paraphrased.contains(&(fi, ri)) {
                let new = paraphrase::rule(&mut ctx.rng, &r.text);
                lines[r.index] = with_text(&lines[r.index], &new);
                ctx.record("paraphrase_rule", &format!("{skill}#{}", r.id), file, r.text.clone(), new);
            }
        }
        // Runs of consecutive rule lines, shuffled whole (masked lines go with them and are dropped below).
        let mut runs: Vec<Vec<usize>> = Vec::new();
        for (ri, r) in rules.iter().enumerate() {
            match runs.last_mut() {
                Some(run) if rules[*run.last().unwrap_or(&0)].index + 1 == r.index => run.push(ri),
                _ => runs.push(vec![ri]),
            }
        }
        for run in runs.iter().filter(|r| r.len() > 1) {
            if !ctx.rng.chance(ctx.strength) {
                continue;
            }
            let mut perm = run.clone();
            ctx.rng.shuffle_changed(&mut perm);
            // A reorder that masking would undo (only masked rules moved) is no change at all.
            let visible = |v: &[usize]| v.iter().copied().filter(|&ri| !masked.contains(&(fi, ri))).collect::<Vec<_>>();
            if visible(run) == visible(&perm) {
                continue;
            }
            let originals: Vec<String> = run.iter().map(|&ri| lines[rules[ri].index].clone()).collect();
            for (slot, &from) in run.iter().zip(&perm) {
                lines[rules[*slot].index] = originals[run.iter().position(|&r| r == from).unwrap_or(0)].clone();
            }
            let ids = |v: &[usize]| v.iter().map(|&ri| rules[ri].id.clone()).collect::<Vec<_>>().join(",");
            ctx.record("reorder_rules", skill, file, ids(run), ids(&perm));
        }
        let drop: BTreeSet<usize> = rules
            .iter()
            .enumerate()
            .filter(|(ri, _)| masked.contains(&(fi, *ri)))
            .map(|(_, r)| {
                ctx.record("mask_rule", &format!("{skill}#{}", r.id), file, r.text.clone(), "");
                r.index
            })
            .collect();
        // Masked lines are found by id, since a reorder may have moved them.
        let masked_ids: Vec<&str> = rules.iter().filter(|r| drop.contains(&r.index)).map(|r| r.id.as_str()).collect();
        let kept: Vec<String> = lines
            .into_iter()
            .filter(|l| parse_rules(l, 1).first().is_none_or(|r| !masked_ids.contains(&r.id.as_str())))
            .collect();
        let new = kept.join("\n");
        if new != texts[fi] {
            tree.set_text(file, new);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_naming_tools_markers_or_figures_or_listed_are_essential() {
        let listed: BTreeSet<String> = ["PP4".to_string()].into();
        assert!(is_essential_rule(&listed, "PP1", "Quote the price from `get_product`."));
        assert!(is_essential_rule(&listed, "PP2", "End with [show_product:ID]."));
        assert!(is_essential_rule(&listed, "PP3", "Returns within 7 days."));
        assert!(is_essential_rule(&listed, "PP4", "Say so plainly."));
        assert!(!is_essential_rule(&listed, "PP5", "Say so plainly."));
    }

    #[test]
    fn front_matter_essential_lists_are_read_at_top_level_and_under_metadata() {
        let text = "---\nname: s\ndescription: d\nversion: 1\nessential: [A1]\nmetadata:\n  essential: [A2]\n---\n- [A1] x\n- [A2] y\n";
        let s = skill_of("skills/s/SKILL.md", text).unwrap();
        assert_eq!(listed_essential(&s), ["A1".to_string(), "A2".to_string()].into());
    }
}
