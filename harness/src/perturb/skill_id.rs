//! Dimension `skill-id`: which skills exist and how they are named and described.
//!
//! Kinds: `mask_skill` (the folder is removed), `rename_skill` (folder and `name:` move together; `router.always`
//! follows as `update_router_always`), `rewrite_skill_description`, `add_synthetic_skill` (plausible shop skills
//! that no case needs), `add_noise_skill` (off-topic distractors). Essential skills (`router.always`,
//! `essential: true` in the front matter, or any essential rule inside) are never masked. Triggers are kept, so
//! the router still finds a renamed skill by its routing words; added skills name no tools and state no figures.

use std::collections::BTreeSet;

use super::skill_content::{body_start, is_essential_rule, listed_essential, skill_of};
use super::{Ctx, PerturbError, Tree, json_of, paraphrase, pretty};
use crate::harness::HARNESS_JSON;
use crate::skill::parse_rules;

/// A skill to add: name, description, triggers, rules (ids are assigned on insertion).
struct Template {
    name: &'static str,
    description: &'static str,
    triggers: &'static [&'static str],
    rules: &'static [&'static str],
}

const SYNTHETIC: &[Template] = &[
    Template {
        name: "gift-wrapping",
        description: "Gift wrapping, gift notes and sending an order as a present.",
        triggers: &["gift", "wrap", "wrapping", "present", "birthday", "礼物", "包装"],
        rules: &[
            "Say gift wrapping is available only if the product details or the room information say so; otherwise offer to check.",
            "Suggest writing the gift note in the order remarks at checkout.",
        ],
    },
    Template {
        name: "membership-points",
        description: "Membership levels, points and member-only perks.",
        triggers: &["member", "membership", "points", "vip", "会员", "积分"],
        rules: &[
            "Never promise points or member perks that the room information does not show.",
            "Point viewers to the membership page for their own balance; never ask for account details in chat.",
        ],
    },
    Template {
        name: "care-and-washing",
        description: "How to wash, dry, iron and store clothes.",
        triggers: &["wash", "washing", "iron", "dry", "shrink", "洗", "保养"],
        rules: &[
            "Give care advice that follows the product's material; when unsure, tell the viewer to follow the care label.",
            "Do not claim a garment will never shrink or fade.",
        ],
    },
    Template {
        name: "live-schedule",
        description: "When the next live stream is and what it will show.",
        triggers: &["schedule", "next live", "tomorrow", "预告", "直播时间"],
        rules: &[
            "Only mention upcoming streams that the room information lists; otherwise invite the viewer to follow the shop.",
        ],
    },
    Template {
        name: "bulk-orders",
        description: "Buying many pieces at once for a team, a company or an event.",
        triggers: &["bulk", "wholesale", "team order", "批发", "团购"],
        rules: &[
            "Do not quote bulk prices; point the viewer to customer service for large orders.",
        ],
    },
];

const NOISE: &[Template] = &[
    Template {
        name: "weather-chat",
        description: "Chatting about the weather and the seasons.",
        triggers: &["weather", "rain", "sunny", "天气"],
        rules: &["Keep weather talk to one friendly sentence."],
    },
    Template {
        name: "recipe-corner",
        description: "Cooking, recipes and what to eat tonight.",
        triggers: &["recipe", "cook", "cooking", "dinner", "菜谱"],
        rules: &["Share a simple recipe idea only when asked, in one sentence."],
    },
    Template {
        name: "movie-talk",
        description: "Films, series and what the host is watching.",
        triggers: &["movie", "film", "series", "电影"],
        rules: &["Do not recommend films by name; keep it light."],
    },
    Template {
        name: "travel-tips",
        description: "Travel plans and places to visit.",
        triggers: &["travel", "trip", "vacation", "旅游"],
        rules: &["Keep travel chat short and friendly."],
    },
];

/// A YAML scalar for `value`: plain when safe, else double-quoted (a JSON string is valid YAML).
pub(crate) fn yaml_scalar(value: &str) -> String {
    let special = value.starts_with(|c: char| "-?:,[]{}#&*!|>'\"%@`".contains(c))
        || value.contains(": ")
        || value.contains(" #")
        || value.trim() != value;
    if special { serde_json::to_string(value).expect("strings serialize") } else { value.to_string() }
}

/// `text` with the top-level front-matter field `key` set to `value` (continuation lines replaced too).
pub(crate) fn set_field(text: &str, key: &str, value: &str) -> String {
    let lines: Vec<&str> = text.split('\n').collect();
    let end = body_start(&lines);
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        if i < end && l.starts_with(&format!("{key}:")) {
            out.push(format!("{key}: {}", yaml_scalar(value)));
            i += 1;
            while i < end && (lines[i].starts_with([' ', '\t'])) {
                i += 1;
            }
            continue;
        }
        out.push(l.to_string());
        i += 1;
    }
    out.join("\n")
}

fn render(t: &Template, ids: &[String]) -> String {
    let triggers = t.triggers.iter().map(|s| yaml_scalar(s)).collect::<Vec<_>>().join(", ");
    let mut s = format!(
        "---\nname: {}\ndescription: {}\nversion: 1.0.0\nmetadata:\n  triggers: [{triggers}]\n---\n# {}\n\n## Rules\n",
        t.name,
        yaml_scalar(t.description),
        t.description.trim_end_matches('.')
    );
    for (id, rule) in ids.iter().zip(t.rules) {
        s.push_str(&format!("- [{id}] {rule}\n"));
    }
    s
}

/// Every rule id in the tree (rules.md and every skill), so added rules get fresh ones.
fn rule_ids(tree: &Tree) -> Result<BTreeSet<String>, PerturbError> {
    let mut ids = BTreeSet::new();
    for file in tree.skill_files().into_iter().chain([crate::harness::RULES_MD.to_string()]) {
        if let Some(text) = tree.text(&file)? {
            ids.extend(parse_rules(&text, 1).into_iter().map(|r| r.id));
        }
    }
    Ok(ids)
}

pub fn apply(tree: &mut Tree, ctx: &mut Ctx<'_>) -> Result<(), PerturbError> {
    let config_text = tree.text(HARNESS_JSON)?.unwrap_or_else(|| "{}".into());
    let mut config = json_of(HARNESS_JSON, &config_text)?;
    let always: Vec<String> = config["router"]["always"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default();

    // 1. The original skills and which may be masked.
    let mut skills = Vec::new();
    for file in tree.skill_files() {
        let text = tree.text(&file)?.unwrap_or_default();
        let skill = skill_of(&file, &text)?;
        // A skill holding a rule a case may depend on (a tool, an action marker, a figure, or listed) is kept
        // whole: masking it would mask those rules.
        let listed = listed_essential(&skill);
        let essential = always.contains(&skill.name)
            || skill.metadata.get("essential").and_then(|v| v.as_str()) == Some("true")
            || skill.rules.iter().any(|r| is_essential_rule(&listed, &r.id, &r.text));
        skills.push((file, skill, essential));
    }
    let mut names: BTreeSet<String> = skills.iter().map(|(_, s, _)| s.name.clone()).collect();
    let maskable: Vec<usize> = (0..skills.len()).filter(|&i| !skills[i].2).collect();
    let mut order = maskable.clone();
    ctx.rng.shuffle(&mut order);
    let masked: BTreeSet<usize> = order.into_iter().take(ctx.count(maskable.len(), 0.3, 0)).collect();

    // 2. Mask, rename, rewrite descriptions.
    let mut renamed_always = always.clone();
    for (i, (file, skill, _)) in skills.iter().enumerate() {
        let folder = file.trim_end_matches("/SKILL.md").to_string();
        if masked.contains(&i) {
            tree.remove_dir(&folder);
            ctx.record("mask_skill", &skill.name, file, skill.name.clone(), "");
            continue;
        }
        let mut text = tree.text(file)?.unwrap_or_default();
        let mut path = file.clone();
        if ctx.rng.chance(0.6 * ctx.strength) {
            let template = paraphrase::skill_description(&mut ctx.rng, &skill.description);
            let new = ctx.rewrite("skill description", &skill.name, file, &skill.description, template)?;
            text = set_field(&text, "description", &new);
            ctx.record("rewrite_skill_description", &skill.name, file, skill.description.clone(), new);
        }
        if ctx.rng.chance(0.5 * ctx.strength) {
            let new = (0..8)
                .map(|_| paraphrase::new_name(&mut ctx.rng, &skill.name, '-'))
                .find(|n| !names.contains(n) && n.chars().all(|c| c.is_alphanumeric() || c == '-' || c == '_'));
            if let Some(new) = new {
                text = set_field(&text, "name", &new);
                let new_folder = format!("skills/{new}");
                tree.move_dir(&folder, &new_folder);
                path = format!("{new_folder}/SKILL.md");
                ctx.record("rename_skill", &skill.name, &path, skill.name.clone(), new.clone());
                if let Some(slot) = renamed_always.iter_mut().find(|n| **n == skill.name) {
                    *slot = new.clone();
                }
                names.remove(&skill.name);
                names.insert(new);
            }
        }
        tree.set_text(&path, text);
    }
    if renamed_always != always {
        config["router"]["always"] = serde_json::json!(renamed_always);
        tree.set_text(HARNESS_JSON, pretty(&config));
        ctx.record("update_router_always", "router.always", HARNESS_JSON, always.join(","), renamed_always.join(","));
    }

    // 3. Add synthetic and noise skills with fresh names and rule ids.
    let mut ids = rule_ids(tree)?;
    for (bank, kind, share) in [(SYNTHETIC, "add_synthetic_skill", 0.4), (NOISE, "add_noise_skill", 0.5)] {
        let mut pool: Vec<&Template> = bank.iter().filter(|t| !names.contains(t.name)).collect();
        ctx.rng.shuffle(&mut pool);
        let n = ctx.count(pool.len(), share, 1);
        for t in pool.into_iter().take(n) {
            let prefix: String = t.name.split('-').filter_map(|w| w.chars().next()).collect::<String>().to_uppercase();
            let rule_ids: Vec<String> = (1..)
                .map(|k| format!("X{prefix}{k}"))
                .filter(|id| !ids.contains(id))
                .take(t.rules.len())
                .collect();
            ids.extend(rule_ids.iter().cloned());
            let path = format!("skills/{}/SKILL.md", t.name);
            tree.set_text(&path, render(t, &rule_ids));
            names.insert(t.name.to_string());
            ctx.record(kind, t.name, &path, "", t.description);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_field_replaces_one_field_with_safe_yaml() {
        let text = "---\nname: a\ndescription: old\n  more\nversion: 1\n---\nname: body stays\n";
        let out = set_field(text, "description", "Use it for this: x");
        assert_eq!(out, "---\nname: a\ndescription: \"Use it for this: x\"\nversion: 1\n---\nname: body stays\n");
        let s = skill_of("skills/a/SKILL.md", &set_field(&out, "name", "b")).unwrap();
        assert_eq!((s.name.as_str(), s.description.as_str()), ("b", "Use it for this: x"));
    }

    #[test]
    fn added_skills_parse_and_state_no_figures_or_tools() {
        for t in SYNTHETIC.iter().chain(NOISE) {
            let ids: Vec<String> = (0..t.rules.len()).map(|i| format!("X{i}")).collect();
            let s = skill_of("skills/x/SKILL.md", &render(t, &ids)).unwrap();
            assert_eq!(s.rules.len(), t.rules.len(), "{}", t.name);
            for r in &s.rules {
                assert!(!r.text.contains('`') && !r.text.chars().any(|c| c.is_ascii_digit()), "{}: {}", t.name, r.text);
            }
        }
    }
}
