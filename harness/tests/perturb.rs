//! `nextn_harness::perturb` (Harness-State Augmentation) on the bundled harnesses: every variant passes check,
//! keeps the task (same real tools, same argument schemas, essential rules word for word), lists every change
//! in its manifest, and is reproducible from its seed.
//!
//! Completeness is checked independently of how the perturbation works: the source and the variant are both
//! loaded and compared field by field, and every difference must be a manifest entry (and every entry a
//! difference).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use common::{TempDir, default_dir};
use nextn_harness::perturb::skill_content::is_essential_rule;
use nextn_harness::{
    Change, Dimension, Harness, Manifest, PerturbError, PerturbOptions, Rewriter, ToolRegistry, ToolSpec, perturb, perturb_with,
};
use serde_json::{Value, json};

/// The commerce server's tools, as it lists them (names, one-line descriptions, argument schemas).
fn specs() -> Vec<ToolSpec> {
    let s = |name: &str, props: Value, required: &[&str]| ToolSpec {
        server: "commerce".into(),
        name: name.into(),
        description: format!("The {} tool of the shop.", name.replace('_', " ")),
        input_schema: json!({"type": "object", "properties": props, "required": required}),
    };
    vec![
        s("search_products", json!({"query": {"type": "string", "description": "Words to look for"}, "max_results": {"type": "integer"}}), &["query"]),
        s("get_product", json!({"product_id": {"type": "string"}}), &["product_id"]),
        s("check_stock", json!({"product_id": {"type": "string"}, "colour": {"type": "string"}, "size": {"type": "string"}}), &["product_id"]),
        s("list_promotions", json!({"product_id": {"type": "string"}}), &[]),
        s("shipping_policy", json!({"region": {"type": "string"}}), &[]),
        s("after_sales_policy", json!({}), &[]),
        s("room_status", json!({}), &[]),
    ]
}

fn live_tiny() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("live-tiny")
}

fn opts(seed: u64, dims: &[Dimension], strength: f64) -> PerturbOptions {
    PerturbOptions { seed, dims: dims.to_vec(), strength }
}

fn make(src: &Path, o: &PerturbOptions) -> (TempDir, Manifest) {
    let t = TempDir::new("perturb");
    let out = t.path().join("v");
    let m = perturb(src, &out, o, &specs()).unwrap_or_else(|e| panic!("perturb {o:?}: {e}"));
    (t, m)
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(dir: &Path, rel: &str, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let child = if rel.is_empty() { name } else { format!("{rel}/{name}") };
            if e.path().is_dir() {
                walk(&e.path(), &child, out);
            } else {
                out.insert(child, std::fs::read(e.path()).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, "", &mut out);
    out
}

fn of<'a>(m: &'a Manifest, kind: &str) -> Vec<&'a Change> {
    m.changes.iter().filter(|c| c.kind == kind).collect()
}

/// Every difference between `src` and the variant `dir` is in the manifest, and every entry is a difference.
fn assert_manifest_complete(src: &Path, dir: &Path, m: &Manifest) {
    let a = Harness::load(src).unwrap();
    let b = Harness::load(dir).unwrap();
    let mut used: BTreeSet<usize> = BTreeSet::new();
    let mut find = |kind: &str, target: &str, pred: &dyn Fn(&Change) -> bool| -> bool {
        match m.changes.iter().enumerate().find(|(i, c)| !used.contains(i) && c.kind == kind && c.target == target && pred(c)) {
            Some((i, _)) => {
                used.insert(i);
                true
            }
            None => false,
        }
    };

    // Skills: masked, renamed, added.
    let renamed: BTreeMap<String, String> =
        of(m, "rename_skill").iter().map(|c| (c.before.clone(), c.after.clone())).collect();
    let masked: BTreeSet<String> = of(m, "mask_skill").iter().map(|c| c.target.clone()).collect();
    let mut expected: BTreeSet<String> = a
        .skills()
        .iter()
        .filter(|s| !masked.contains(&s.name))
        .map(|s| renamed.get(&s.name).cloned().unwrap_or_else(|| s.name.clone()))
        .collect();
    for c in of(m, "add_synthetic_skill").into_iter().chain(of(m, "add_noise_skill")) {
        expected.insert(c.target.clone());
    }
    let got: BTreeSet<String> = b.skills().iter().map(|s| s.name.clone()).collect();
    assert_eq!(got, expected, "skill set vs manifest");
    for s in a.skills() {
        if masked.contains(&s.name) {
            assert!(find("mask_skill", &s.name, &|_| true));
            // Masking a skill masks its rules: only skills without an essential rule may go.
            let none: BTreeSet<String> = BTreeSet::new();
            let essential = s.rules.iter().find(|r| is_essential_rule(&none, &r.id, &r.text));
            assert!(essential.is_none(), "skill {} masked with essential rule {:?}", s.name, essential.map(|r| &r.id));
            continue;
        }
        if let Some(new) = renamed.get(&s.name) {
            assert!(find("rename_skill", &s.name, &|c| &c.after == new));
        }
    }
    for c in of(m, "add_synthetic_skill").into_iter().chain(of(m, "add_noise_skill")) {
        assert!(find(&c.kind, &c.target, &|_| true));
    }

    // Tool references rewritten in text: (file, `old`) → `new`.
    let refs: Vec<&Change> = of(m, "update_tool_reference");
    let with_refs = |text: &str, file: &str| -> String {
        let mut t = text.to_string();
        for c in refs.iter().filter(|c| c.file == file) {
            t = t.replace(&c.before, &c.after);
        }
        t
    };

    // Skill descriptions and rules.
    for s in a.skills().iter().filter(|s| !masked.contains(&s.name)) {
        let name = renamed.get(&s.name).cloned().unwrap_or_else(|| s.name.clone());
        let v = b.skill(&name).unwrap();
        if v.description != s.description {
            assert!(find("rewrite_skill_description", &s.name, &|c| c.after == v.description), "{}", s.name);
        }
        let file = v.path.to_string_lossy().into_owned();
        let listed: BTreeSet<String> = BTreeSet::new();
        let ids_a: Vec<&str> = s.rules.iter().map(|r| r.id.as_str()).collect();
        for r in &s.rules {
            let target = format!("{name}#{}", r.id);
            match v.rules.iter().find(|x| x.id == r.id) {
                None => {
                    assert!(!is_essential_rule(&listed, &r.id, &r.text), "essential rule {target} masked");
                    assert!(find("mask_rule", &target, &|c| c.before == r.text), "{target} missing, not in manifest");
                }
                Some(x) if x.text != with_refs(&r.text, &file) => {
                    assert!(!is_essential_rule(&listed, &r.id, &r.text), "essential rule {target} reworded");
                    assert!(find("paraphrase_rule", &target, &|c| c.after == x.text), "{target} reworded, not in manifest");
                }
                Some(_) => {}
            }
        }
        let kept_a: Vec<&str> = ids_a.iter().copied().filter(|id| v.rules.iter().any(|x| x.id == *id)).collect();
        let ids_b: Vec<&str> = v.rules.iter().map(|r| r.id.as_str()).collect();
        if kept_a != ids_b {
            assert!(find("reorder_rules", &name, &|_| true), "{name}: rules reordered, not in manifest");
        }
        while kept_a != ids_b && find("reorder_rules", &name, &|_| true) {}
    }
    // Synthetic skills may also have been reworded by skill-content: those entries target new skills.
    for c in &m.changes {
        if matches!(c.kind.as_str(), "paraphrase_rule" | "mask_rule" | "reorder_rules") {
            let skill = c.target.split('#').next().unwrap_or("");
            if !a.skills().iter().any(|s| renamed.get(&s.name).unwrap_or(&s.name) == skill) {
                let _ = find(&c.kind, &c.target, &|_| true);
            }
        }
    }

    // Tools: the same real tools and argument shapes; names, descriptions, parameter descriptions as listed.
    let ra = ToolRegistry::build(specs(), a.tools_config()).unwrap();
    let rb = ToolRegistry::build(specs(), b.tools_config()).unwrap();
    assert_eq!(ra.tools().len(), rb.tools().len());
    for ta in ra.tools() {
        let tb = rb.tools().iter().find(|t| t.real_name == ta.real_name).expect("every real tool is still offered");
        assert_eq!(tb.server, ta.server);
        let key = ta.real_name.clone();
        if tb.name != ta.name {
            assert!(find("rename_tool", &key, &|c| c.before == ta.name && c.after == tb.name), "{key} renamed");
        }
        if tb.description != ta.description {
            let listed = find("rewrite_tool_description", &key, &|c| c.after == tb.description)
                || find("update_tool_reference", &key, &|c| c.after == tb.description);
            assert!(listed, "{key} description");
        }
        let strip = |s: &Value| {
            let mut s = s.clone();
            if let Some(p) = s.get_mut("properties").and_then(Value::as_object_mut) {
                for v in p.values_mut() {
                    if let Some(o) = v.as_object_mut() {
                        o.remove("description");
                    }
                }
            }
            s
        };
        assert_eq!(strip(&tb.input_schema), strip(&ta.input_schema), "{key}: argument schema changed");
        for (p, vb) in tb.input_schema["properties"].as_object().into_iter().flatten() {
            let da = ta.input_schema["properties"][p]["description"].as_str().unwrap_or("");
            let db = vb["description"].as_str().unwrap_or("");
            if da != db {
                let target = format!("{key}.{p}");
                let listed = find("rewrite_parameter_description", &target, &|c| c.after == db)
                    || find("update_tool_reference", &target, &|c| c.after == db);
                assert!(listed, "{target}");
            }
        }
    }
    let renamed_from: Vec<(&str, &str)> = of(m, "rename_tool").iter().map(|c| (c.before.as_str(), c.after.as_str())).collect();
    for t in rb.tools() {
        let texts = std::iter::once(t.description.clone())
            .chain(t.input_schema["properties"].as_object().into_iter().flatten().filter_map(|(_, p)| p["description"].as_str().map(String::from)));
        for text in texts {
            for (old, _) in &renamed_from {
                let stale = text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| w == *old);
                assert!(!stale, "{}: `{old}` was renamed but the text still says it: {text}", t.name);
            }
        }
    }
    for c in refs.iter().filter(|c| c.file != "tools.json") {
        let text = std::fs::read_to_string(dir.join(&c.file)).unwrap();
        assert!(text.contains(&c.after) && !text.contains(&c.before), "{c:?}");
        assert!(find("update_tool_reference", &c.target, &|x| x.file == c.file && x.before == c.before));
    }

    // Prompt structure and limits.
    let (ca, cb) = (a.config(), b.config());
    if ca.blocks != cb.blocks {
        let after = cb.blocks.iter().map(|k| k.name()).collect::<Vec<_>>().join(",");
        assert!(find("reorder_blocks", "blocks", &|c| c.after == after));
    }
    let limits = [
        ("max_reply_chars", ca.constraints.max_reply_chars as u64, cb.constraints.max_reply_chars as u64),
        ("max_loops", u64::from(ca.constraints.max_loops), u64::from(cb.constraints.max_loops)),
    ];
    for (name, x, y) in limits {
        if x != y {
            assert!(find("set_limit", name, &|c| c.before == x.to_string() && c.after == y.to_string()), "{name}");
        }
    }
    assert_eq!((&ca.role, &ca.style, ca.constraints.tool_timeout_ms), (&cb.role, &cb.style, cb.constraints.tool_timeout_ms));
    let rule_ids = |h: &Harness| h.rules().iter().map(|r| (r.id.clone(), r.text.clone())).collect::<Vec<_>>();
    let (ba, bb) = (rule_ids(&a), rule_ids(&b));
    assert_eq!(ba.iter().collect::<BTreeSet<_>>(), bb.iter().collect::<BTreeSet<_>>(), "boundary rules are kept word for word");
    if ba != bb {
        assert!(find("reorder_items", "rules", &|_| true), "rules.md reordered, not in manifest");
    }
    while ba != bb && find("reorder_items", "rules", &|_| true) {}
    let faq = |h: &Harness| h.faq().entries().iter().map(|e| e.q.clone()).collect::<Vec<_>>();
    if faq(&a) != faq(&b) {
        assert_eq!(faq(&a).into_iter().collect::<BTreeSet<_>>(), faq(&b).into_iter().collect::<BTreeSet<_>>());
        assert!(find("reorder_items", "faq", &|_| true));
    }

    // Hooks.
    let ha = serde_json::to_value(&a.hooks_config().builtins).unwrap();
    let hb = serde_json::to_value(&b.hooks_config().builtins).unwrap();
    for (name, va) in ha.as_object().unwrap() {
        let vb = &hb[name];
        assert_eq!(va["enabled"], vb["enabled"], "{name}: hooks stay on");
        if va["retry_budget"] != vb["retry_budget"] {
            assert!(find("set_retry_budget", name, &|c| c.after == vb["retry_budget"].to_string()), "{name} budget");
        }
        for field in ["on_violation", "max_chars"] {
            if name != "input_sanity" && va.get(field).is_some() && va[field] != vb[field] {
                let after = vb[field].as_str().map_or(vb[field].to_string(), String::from);
                assert!(find("set_modification", &format!("{name}.{field}"), &|c| c.after == after), "{name}.{field}");
            }
        }
    }
    let (fa, fb) = (&a.hooks_config().feedback, &b.hooks_config().feedback);
    for (key, x, y) in [("reply_retry", &fa.reply_retry, &fb.reply_retry), ("tool_call_retry", &fa.tool_call_retry, &fb.tool_call_retry)] {
        if x != y {
            assert!(find("set_feedback", &format!("feedback.{key}"), &|c| &c.after == y), "{key}");
        }
    }
    if a.config().router.always != b.config().router.always {
        assert!(find("update_router_always", "router.always", &|_| true));
    }

    let unexplained: Vec<&Change> = m.changes.iter().enumerate().filter(|(i, _)| !used.contains(i)).map(|(_, c)| c).collect();
    assert!(unexplained.is_empty(), "manifest entries with no difference behind them: {unexplained:#?}");

    // And at the file level: every changed, added or removed file is named by an entry.
    let (fa, fb) = (files(src), files(dir));
    let named: BTreeSet<&str> = m.changes.iter().map(|c| c.file.as_str()).collect();
    for (rel, bytes) in &fb {
        if rel != nextn_harness::MANIFEST && fa.get(rel) != Some(bytes) {
            assert!(named.contains(rel.as_str()), "{rel} changed but no entry names it");
        }
    }
    for rel in fa.keys().filter(|r| !fb.contains_key(*r)) {
        // Only skill folders go away: masked (the entry names the old path) or renamed (the old name).
        let explained = m.changes.iter().any(|c| {
            (c.kind == "mask_skill" && &c.file == rel)
                || (c.kind == "rename_skill" && rel.starts_with(&format!("skills/{}/", c.before)))
        });
        assert!(explained, "{rel} removed but no entry");
    }
}

#[test]
fn every_dimension_alone_and_together_passes_check_with_a_complete_manifest() {
    for src in [default_dir(), live_tiny()] {
        let single: Vec<Vec<Dimension>> = Dimension::ALL.iter().map(|d| vec![*d]).collect();
        for dims in single.iter().cloned().chain([Dimension::ALL.to_vec()]) {
            for (seed, strength) in [(1, 0.5), (2, 1.0), (3, 0.0)] {
                let o = opts(seed, &dims, strength);
                let (t, m) = make(&src, &o);
                let out = t.path().join("v");
                let findings = nextn_harness::check(&out);
                assert!(!nextn_harness::has_errors(&findings), "{o:?}: {findings:?}");
                for d in &dims {
                    assert!(m.changes.iter().any(|c| c.dimension == *d), "{o:?}: no change in {d}");
                }
                assert!(m.changes.iter().all(|c| dims.contains(&c.dimension)), "{o:?}: a change outside the dims");
                let (va, vb) = (nextn_harness::content_hash(&src).unwrap(), nextn_harness::content_hash(&out).unwrap());
                assert_ne!(va, vb);
                assert_eq!(m.source_version, va);
                let on_disk: Manifest =
                    serde_json::from_str(&std::fs::read_to_string(out.join(nextn_harness::MANIFEST)).unwrap()).unwrap();
                assert_eq!(on_disk, m);
                assert_manifest_complete(&src, &out, &m);
            }
        }
    }
}

#[test]
fn same_seed_gives_a_byte_identical_directory_and_another_seed_differs() {
    let o = opts(42, &Dimension::ALL, 0.7);
    let (t1, _) = make(&default_dir(), &o);
    let (t2, _) = make(&default_dir(), &o);
    assert_eq!(files(&t1.path().join("v")), files(&t2.path().join("v")));
    for seed in [43, 44, 45] {
        let (t3, _) = make(&default_dir(), &opts(seed, &Dimension::ALL, 0.7));
        assert_ne!(files(&t1.path().join("v")), files(&t3.path().join("v")), "seed {seed}");
    }
    for d in Dimension::ALL {
        let a = make(&default_dir(), &opts(5, &[d], 0.7)).1;
        let b = make(&default_dir(), &opts(6, &[d], 0.7)).1;
        assert_ne!(a.changes, b.changes, "{d}: seeds 5 and 6 made the same changes");
    }
}

#[test]
fn renamed_tools_resolve_to_the_same_real_tool_and_the_text_follows() {
    let (t, m) = make(&default_dir(), &opts(7, &[Dimension::ToolDef], 1.0));
    let h = Harness::load(t.path().join("v")).unwrap();
    let reg = ToolRegistry::build(specs(), h.tools_config()).unwrap();
    let renames = of(&m, "rename_tool");
    assert!(!renames.is_empty());
    for c in renames {
        let tool = reg.resolve(&c.after).unwrap_or_else(|| panic!("{} does not resolve", c.after));
        assert_eq!(tool.real_name, c.target);
        assert!(reg.resolve(&c.before).is_none() || c.before != tool.name, "old name {} still shown", c.before);
    }
    // Skills mention only names the model is shown (or aliases), never a stale one.
    let shown: BTreeSet<String> = reg.tools().iter().flat_map(|t| std::iter::once(t.name.clone()).chain(t.aliases.clone())).collect();
    for r in h.tool_references() {
        let shown_name = reg.tools().iter().find(|t| t.real_name == r.tool).map(|t| t.name.clone());
        assert!(shown_name.is_some(), "{r:?} names no offered tool");
    }
    for s in h.skills() {
        for cap in regex_lite_backticks(&s.body) {
            assert!(shown.contains(&cap) || !cap.contains('_'), "{}: `{cap}` is not a shown tool name", s.name);
        }
    }
}

/// Backticked snake_case words (the tool-reference convention).
fn regex_lite_backticks(text: &str) -> Vec<String> {
    text.split('`')
        .enumerate()
        .filter(|(i, w)| i % 2 == 1 && w.contains('_') && w.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
        .map(|(_, w)| w.to_string())
        .collect()
}

#[test]
fn bad_input_is_a_typed_error_naming_the_problem() {
    let t = TempDir::new("perturb-bad");
    let o = opts(1, &Dimension::ALL, 0.5);
    let e = perturb(&t.path().join("missing"), &t.path().join("out"), &o, &[]).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    let e = perturb(&default_dir(), &t.path().join("out"), &opts(1, &Dimension::ALL, 1.5), &[]).unwrap_err();
    assert!(e.to_string().contains("--strength 1.5"), "{e}");
    t.write("full/x.txt", "x");
    let e = perturb(&default_dir(), &t.path().join("full"), &o, &[]).unwrap_err();
    assert!(e.to_string().contains("not empty"), "{e}");
    let broken = common::default_copy("perturb-broken");
    std::fs::write(broken.path().join("harness.json"), "{\"max_loops\": 99}").unwrap();
    let e = perturb(broken.path(), &t.path().join("out2"), &o, &[]).unwrap_err();
    assert!(e.to_string().contains("max_loops"), "{e}");
    assert!(Dimension::parse_list("prompt,nope").unwrap_err().to_string().contains("`nope`"));
}

#[test]
fn feedback_templates_must_hold_the_reason() {
    let h = common::default_copy("perturb-feedback");
    std::fs::write(h.path().join("hooks.json"), "{\n  \"feedback\": {\"reply_retry\": \"try again\"}\n}").unwrap();
    let findings = nextn_harness::check(h.path());
    let e = findings.iter().find(|f| f.file == Path::new("hooks.json")).expect("a hooks.json finding");
    assert!(e.message.contains("{reason}") && e.line == Some(2), "{e}");
}

/// A stand-in for the `--llm` model: every other rewrite keeps the original's tokens (accepted), the rest are
/// empty (refused); `fail` makes it an unreachable endpoint.
struct ScriptedRewriter {
    calls: usize,
    fail: bool,
}

impl Rewriter for ScriptedRewriter {
    fn name(&self) -> String {
        "scripted".into()
    }
    fn rewrite(&mut self, what: &str, text: &str) -> Result<String, String> {
        if self.fail {
            return Err("connection refused".into());
        }
        self.calls += 1;
        Ok(if self.calls % 2 == 1 { format!("Put differently ({what}): {text}") } else { String::new() })
    }
}

#[test]
fn a_model_rewrites_descriptions_only_where_it_keeps_their_tokens() {
    let o = opts(5, &[Dimension::SkillId, Dimension::ToolDef], 1.0);
    let t = TempDir::new("perturb-llm");
    let out = t.path().join("v");
    let mut r = ScriptedRewriter { calls: 0, fail: false };
    let m = perturb_with(&live_tiny(), &out, &o, &specs(), Some(&mut r)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(m.rewriter.as_deref(), Some("scripted"));
    assert!(r.calls >= 2, "the rewriter was asked {} times", r.calls);
    let rewritten: Vec<&Change> = m.changes.iter().filter(|c| c.kind.starts_with("rewrite_") && c.after.starts_with("Put differently")).collect();
    let rejected = of(&m, "llm_rewrite_rejected");
    assert_eq!(rewritten.len() + rejected.len(), r.calls, "every model answer is used or recorded as refused");
    assert!(!rewritten.is_empty() && !rejected.is_empty());
    for c in &rejected {
        assert!(c.before.contains("(empty)") && !c.after.is_empty(), "{c:?}");
    }
    // Where a description was rewritten, its variant file holds the model's text (tools.json after renames).
    let tools_json = std::fs::read_to_string(out.join("tools.json")).unwrap_or_default();
    let skills: String = walk(&out).into_iter().filter(|p| p.ends_with("SKILL.md")).map(|p| std::fs::read_to_string(p).unwrap()).collect();
    assert!(tools_json.contains("Put differently") || skills.contains("Put differently"));
    // Template paraphrases are drawn the same way with or without a model: the rest of the variant is unchanged.
    let (_t2, plain) = make(&live_tiny(), &o);
    let kinds = |m: &Manifest| m.changes.iter().filter(|c| c.kind != "llm_rewrite_rejected").map(|c| (c.kind.clone(), c.target.clone())).collect::<Vec<_>>();
    assert_eq!(kinds(&m), kinds(&plain));

    let mut down = ScriptedRewriter { calls: 0, fail: true };
    let e = perturb_with(&live_tiny(), &t.path().join("w"), &o, &specs(), Some(&mut down)).unwrap_err();
    assert!(matches!(e, PerturbError::Rewriter { .. }), "{e}");
    assert!(e.to_string().contains("connection refused") && e.to_string().contains("scripted"), "{e}");
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() { out.extend(walk(&p)) } else { out.push(p) }
    }
    out
}
