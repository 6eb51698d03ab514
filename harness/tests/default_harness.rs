//! The default harness: it loads and checks clean, the router picks the right skill, the prompt is built
//! stable-blocks-first with block hashes that move only with content, and FAQ retrieval ranks the right entry.

mod common;

use common::{default_copy, default_dir, fixture};
use nextn_harness::{BlockKind, Harness, RequestContext, RoomFile, SelectionSource, Severity, check};

fn harness() -> Harness {
    Harness::load(default_dir()).unwrap()
}

fn room_ctx(comment: &str) -> RequestContext {
    let room = RoomFile::load(&fixture("room.json")).unwrap();
    RequestContext { comment: comment.into(), history: Vec::new(), room: room.room, products: room.products }
}

#[test]
fn default_harness_loads_with_all_parts() {
    let h = harness();
    assert_eq!(h.version().len(), 16);
    assert!(h.skills().len() >= 6);
    assert!(h.rules().len() >= 5);
    assert!(h.faq().entries().len() >= 25);
    assert_eq!(h.constraints().max_loops, 4);
    assert_eq!(h.constraints().tool_timeout_ms, 5000);
    for name in
        ["input_sanity", "tool_args", "forbidden_claims", "invented_discount", "reply_length", "leaked_reasoning"]
    {
        assert!(h.hooks().get(name).is_some(), "built-in `{name}` is on");
    }
}

#[test]
fn default_harness_checks_without_errors() {
    let findings = check(default_dir());
    let errors: Vec<String> =
        findings.iter().filter(|f| f.severity == Severity::Error).map(ToString::to_string).collect();
    assert!(errors.is_empty(), "{errors:#?}");
    assert!(findings.is_empty(), "the default harness should not even warn: {findings:#?}");
}

#[test]
fn router_selects_the_skill_the_comment_is_about() {
    let h = harness();
    let cases = [
        ("I'm 170cm and 60kg, which size should I get?", "size-and-fit"),
        ("does it run small?", "size-and-fit"),
        ("how much is the linen shirt?", "price-and-promotions"),
        ("any coupon or discount today?", "price-and-promotions"),
        ("is the black one still in stock?", "stock-and-shipping"),
        ("when will it ship to Beijing?", "stock-and-shipping"),
        ("can I return it if I don't like it?", "after-sales"),
        ("mine arrived broken, I want a refund", "after-sales"),
        ("hello from Shanghai!", "greetings-and-chitchat"),
        ("are you a bot?", "greetings-and-chitchat"),
        ("this is a scam, total rip off", "negative-feedback"),
        ("what's the fabric, is it cotton?", "product-details"),
        ("身高165穿什么尺码", "size-and-fit"),
        ("多少钱？有优惠吗", "price-and-promotions"),
        ("什么时候发货", "stock-and-shipping"),
        ("可以退货吗", "after-sales"),
        ("骗子，假货", "negative-feedback"),
    ];
    for (comment, want) in cases {
        let sel = h.select_skills(&RequestContext::new(comment), None).unwrap();
        assert_eq!(sel.source, SelectionSource::Router);
        assert_eq!(sel.selected.first().map(String::as_str), Some(want), "{comment:?}: {:?}", sel.scores);
    }
}

#[test]
fn router_is_deterministic_and_respects_top_n_and_threshold() {
    let h = harness();
    let ctx = RequestContext::new("which size, and is it in stock, and any discount?");
    let first = h.select_skills(&ctx, None).unwrap();
    for _ in 0..5 {
        assert_eq!(h.select_skills(&ctx, None).unwrap(), first);
        assert_eq!(Harness::load(default_dir()).unwrap().select_skills(&ctx, None).unwrap(), first);
    }
    assert_eq!(first.selected.len(), h.config().router.top_n);
    assert!(h.select_skills(&RequestContext::new("qwertyuiop"), None).unwrap().selected.is_empty());
}

#[test]
fn router_uses_the_previous_viewer_turn_for_follow_ups() {
    let h = harness();
    let mut ctx = RequestContext::new("and for 180?");
    assert!(h.select_skills(&ctx, None).unwrap().selected.is_empty());
    ctx.history = vec![("user".into(), "which size for 170cm?".into()), ("assistant".into(), "M fits best.".into())];
    let sel = h.select_skills(&ctx, None).unwrap();
    assert!(sel.scores.iter().any(|s| s.name == "size-and-fit"), "{sel:?}");
}

#[test]
fn explicit_skill_list_overrides_the_router() {
    let h = harness();
    let ctx = RequestContext::new("which size?");
    let names = vec!["after-sales".to_string()];
    let sel = h.select_skills(&ctx, Some(&names)).unwrap();
    assert_eq!(sel.selected, names);
    assert_eq!(sel.source, SelectionSource::Explicit);
    let bad = vec!["no-such-skill".to_string()];
    let e = h.select_skills(&ctx, Some(&bad)).unwrap_err();
    assert!(e.to_string().contains("no-such-skill") && e.to_string().contains("size-and-fit"), "{e}");
}

#[test]
fn only_selected_skill_bodies_enter_the_prompt() {
    let h = harness();
    let p = h.build_prompt(&RequestContext::new("which size for 170cm?"), None).unwrap();
    assert!(p.system.contains("[SF1]"));
    assert!(!p.system.contains("[AS1]"), "after-sales body must not be in a size prompt");
    // The index lists every skill's description, bodies or not.
    assert!(p.system.contains("after-sales: Returns, refunds"));
}

#[test]
fn prompt_blocks_are_ordered_stable_first_and_recorded() {
    let h = harness();
    let p = h.build_prompt(&room_ctx("which size should I get at 170cm? and is there a coupon"), None).unwrap();
    let names: Vec<&str> = p.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["rules", "role", "constraints", "skill_index", "products", "room", "skills", "faq"]);
    // The records hash exactly the text of each block, in the order the blocks appear.
    let parts: Vec<String> = p
        .system
        .split("\n\n## ")
        .enumerate()
        .map(|(i, part)| if i == 0 { part.to_string() } else { format!("## {part}") })
        .collect();
    assert_eq!(parts.len(), p.blocks.len());
    for (part, rec) in parts.iter().zip(&p.blocks) {
        assert_eq!(nextn_harness::hash::hash_hex(part.as_bytes()), rec.hash, "{}", rec.name);
        assert_eq!(part.chars().count(), rec.chars, "{}", rec.name);
    }
    assert!(p.system.contains("Reply in at most 120 characters"));
    assert!(p.system.contains("[sku-linen-shirt] Linen shirt — 129 CNY"));
    assert!(p.system.contains("10 yuan off orders over 99"));
    assert_eq!(p.harness_version, h.version());
}

#[test]
fn empty_blocks_are_left_out() {
    let h = harness();
    let p = h.build_prompt(&RequestContext::new("qwertyuiop"), None).unwrap();
    let names: Vec<&str> = p.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["rules", "role", "constraints", "skill_index"]);
}

#[test]
fn block_hashes_change_only_when_their_content_changes() {
    let h = harness();
    let a = h.build_prompt(&room_ctx("which size at 170cm?"), None).unwrap();
    let b = h.build_prompt(&room_ctx("which size at 170cm?"), None).unwrap();
    assert_eq!(a.blocks, b.blocks, "same input → same records");

    // Another comment about another topic: stable blocks keep their hashes; per-request blocks move.
    let c = h.build_prompt(&room_ctx("can I return it?"), None).unwrap();
    let hash = |p: &nextn_harness::Prompt, n: &str| p.blocks.iter().find(|b| b.name == n).map(|b| b.hash.clone());
    for n in ["rules", "role", "constraints", "skill_index", "products", "room"] {
        assert_eq!(hash(&a, n), hash(&c, n), "{n}");
    }
    assert_ne!(hash(&a, "skills"), hash(&c, "skills"));

    // A live-room change moves only the room block.
    let mut ctx = room_ctx("which size at 170cm?");
    ctx.room.as_mut().unwrap().viewers = Some(2000);
    let d = h.build_prompt(&ctx, None).unwrap();
    for n in ["rules", "role", "constraints", "skill_index", "products", "skills", "faq"] {
        assert_eq!(hash(&a, n), hash(&d, n), "{n}");
    }
    assert_ne!(hash(&a, "room"), hash(&d, "room"));
    // The stable prefix of the text is byte-identical.
    let prefix = a.system.find("## Live room now").unwrap();
    assert_eq!(a.system[..prefix], d.system[..prefix]);
}

#[test]
fn block_order_follows_harness_json() {
    let t = default_copy("order");
    let text = t.read("harness.json").replace(
        r#""blocks": ["rules", "role", "constraints", "skill_index", "products", "room", "skills", "faq"]"#,
        r#""blocks": ["role", "rules", "skills"]"#,
    );
    t.write("harness.json", &text);
    let h = Harness::load(t.path()).unwrap();
    let p = h.build_prompt(&RequestContext::new("which size?"), None).unwrap();
    let names: Vec<&str> = p.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["role", "rules", "skills"]);
    assert_eq!(BlockKind::DEFAULT_ORDER.len(), 8);
}

#[test]
fn faq_retrieval_ranks_the_right_entry_first() {
    let h = harness();
    let cases = [
        ("how do I track my package", "How can I track my order?"),
        ("how long until my refund comes back", "How long does a refund take?"),
        ("can I use two coupons together", "Can I combine two coupons or use them together?"),
        ("my parcel arrived damaged", "What if my item arrives damaged?"),
        ("how do I wash this", "How should I wash it?"),
        ("can I change the address after I ordered", "Can I change my address after ordering?"),
    ];
    for (query, want) in cases {
        let hits = h.retrieve_faq(query);
        assert_eq!(hits.first().map(|x| x.q.as_str()), Some(want), "{query:?}: {hits:?}");
        assert!(hits.len() <= h.config().faq_top_k);
    }
    assert!(h.retrieve_faq("qwertyuiop").is_empty());
}

/// The tools the bundled commerce server (`tools/commerce-mcp`) offers.
const COMMERCE_TOOLS: [&str; 7] = [
    "search_products",
    "get_product",
    "check_stock",
    "list_promotions",
    "shipping_policy",
    "after_sales_policy",
    "room_status",
];

#[test]
fn default_harness_names_only_tools_the_commerce_server_offers() {
    let h = harness();
    let refs = h.tool_references();
    assert!(refs.iter().any(|r| r.tool == "list_promotions" && r.location.file.starts_with("skills")));
    assert!(refs.iter().any(|r| r.location.file.to_string_lossy() == "tools.json"));
    let offered: Vec<String> = COMMERCE_TOOLS.iter().map(|s| s.to_string()).collect();
    let warnings = nextn_harness::check_tool_references(&refs, &offered);
    assert!(warnings.is_empty(), "{warnings:#?}");
    let without_promotions: Vec<String> = offered.iter().filter(|t| *t != "list_promotions").cloned().collect();
    let warnings = nextn_harness::check_tool_references(&refs, &without_promotions);
    assert!(warnings.iter().any(|w| w.message.contains("`list_promotions`") && w.line.is_some()), "{warnings:#?}");
}

#[test]
fn default_harness_documents_the_action_markers() {
    let h = harness();
    assert!(h.rules_text().contains("[show_product:p007]") && h.rules_text().contains("[show_coupon:LIVE20]"));
}
