//! nextn-harness: the agent's harness state `h = (skills, tools, prompt pipeline, hooks)`, loaded from a
//! directory and versioned by a content hash. The agent loop (in `nextn-agent`) drives it; nothing here does I/O
//! beyond reading the directory and spawning external hook commands.
//!
//! # Harness directory
//! ```text
//! harness.json          role, style, max_reply_chars, max_loops (4, ≤ 8), tool_timeout_ms (5000, ≤ 15000),
//!                       request_budget_ms (15000, ≤ 60000, ≥ tool_timeout_ms), max_input_chars,
//!                       router {top_n, min_score, always, history_weight}, faq_top_k, faq_min_score,
//!                       skill_index, blocks (prompt block order)                        [required]
//! rules.md              global boundary rules, `- [B1] ...` lines with stable ids
//! skills/<name>/SKILL.md  front matter (name, description, version, optional triggers / metadata) + body:
//!                       reply rules `- [R1] ...`, tool-choice guidance, examples
//! faq.jsonl             {"q": ..., "a": ...} per line
//! hooks.json            built-in hooks on/off + parameters + retry budgets; external command hooks
//! tools.json            tool renames, aliases, description / schema overrides, hidden tools
//! ```
//! `harness/default/` is the full reference harness for a live-stream commerce host; `harness/live-tiny/` is the
//! compact profile the bundled tiny model was trained on (declared in `models/nextn-live-tiny/nextn.json`).
//!
//! # Use
//! ```no_run
//! use nextn_harness::{Harness, RequestContext, HookPayload, Decision, ToolSpec};
//! let h = Harness::load("harness/default")?;
//! println!("harness {}", h.version());                         // content hash, for every trace
//! let ctx = RequestContext::new("What size should I get? I'm 170cm");
//! let prompt = h.build_prompt(&ctx, None)?;                     // None: the router picks skills
//! // prompt.system: the system prompt; prompt.blocks: [BlockRecord {name, hash, chars}], stable blocks first;
//! // prompt.skills: the selection with router scores; prompt.faq: retrieved entries.
//! let tools = h.tool_registry(vec![/* ToolSpec from MCP tools/list */])?;
//! let _for_template = tools.openai_tools();                     // [{"type":"function","function":{...}}]
//! let mut budget = h.hooks().new_budget();                      // per request
//! let run = h.hooks().run(HookPayload::Input { comment: ctx.comment.clone() }, Some(&tools), &mut budget);
//! // Before replying: evidence = room + products + FAQ answers + tool results (`reply_evidence`).
//! let evidence = nextn_harness::reply_evidence(&ctx, &prompt.faq, &[]);
//! let _ = h.hooks().run(HookPayload::BeforeReply { reply: "M fits best!".into(), evidence }, None, &mut budget);
//! match run.decision {
//!     Decision::Allow | Decision::Correct { .. } => { /* go on with run.payload */ }
//!     Decision::Retry { reason } => { /* re-ask the model with `reason`; costs one loop */ }
//!     Decision::Block { reason } => { /* stop */ }
//! }
//! let findings = nextn_harness::check("harness/default");        // `nextn harness check DIR`
//! # Ok::<(), nextn_harness::HarnessError>(())
//! ```
//!
//! # Modules
//! - [`harness`]: [`Harness::load`], accessors, [`content_hash`].
//! - [`skill`]: SKILL.md parsing ([`parse_skill`]), rules, the deterministic [`SkillRouter`].
//! - [`prompt`]: [`RequestContext`], [`Harness::build_prompt`], [`BlockKind`], [`BlockRecord`], [`Prompt`].
//! - [`faq`]: `faq.jsonl` and BM25 retrieval. [`text`]: tokenizer + BM25.
//! - [`hooks`]: points, payloads, decisions, built-ins, external command hooks, retry budgets.
//! - [`schema`]: the JSON Schema subset validator and coercion used for tool arguments.
//! - [`tools`]: [`ToolSpec`], `tools.json`, [`ToolRegistry`].
//! - [`check`]: [`check()`] → [`Finding`]s; [`Harness::load`] refuses exactly what it reports as errors.
//! - [`perturb`]: Harness-State Augmentation: task-preserving variants along five dimensions, with a manifest.
//! - [`limits`]: the ceilings on `max_loops`, `tool_timeout_ms`, `request_budget_ms`.
//! - [`grounding`]: the figures a reply states and which of them the evidence does not show.
//! - [`actions`]: `[show_product:ID]` / `[show_coupon:CODE]` markers → [`Action`]s; sentences for TTS.
//! - [`profile`]: which harness a run uses: `--harness`, else the profile the model directory declares in
//!   `nextn.json` ([`profile_of_model`]), else `harness/default` ([`choose_harness`]).
//! - [`references`]: the tools a harness names ([`Harness::tool_references`]) vs. the tools offered.

pub mod actions;
pub mod check;
pub mod config;
pub mod error;
pub mod faq;
pub mod frontmatter;
pub mod grounding;
pub mod harness;
pub mod hash;
pub mod hooks;
pub mod limits;
pub mod perturb;
pub mod profile;
pub mod prompt;
pub mod references;
pub mod schema;
pub mod skill;
pub mod text;
pub mod tools;

pub use actions::{
    Action, ActionKind, ActionMark, DroppedAction, KnownIds, parse_actions, resolve_actions, split_sentences,
    strip_markers,
};
pub use check::{Finding, Severity, check, has_errors};
pub use config::{Constraints, HarnessConfig};
pub use error::{HarnessError, Location};
pub use faq::{Faq, FaqEntry, FaqHit};
pub use grounding::{Figure, FigureKind, figures, unsupported_figures};
pub use harness::{Harness, content_hash};
pub use hooks::{
    Builtin, Decision, ExternalHook, Hook, HookError, HookKind, HookPayload, HookPoint, HookRecord, HookRun, Hooks,
    FeedbackConfig, HooksConfig, LengthAction, OnError, RetryBudget, SkippedHook,
};
pub use prompt::{
    BlockKind, BlockRecord, Product, Prompt, RequestContext, RoomFile, RoomStatus, Stability, reply_evidence,
};
pub use perturb::{Change, Dimension, MANIFEST, Manifest, PerturbError, PerturbOptions, Rewriter, perturb, perturb_with};
pub use profile::{NEXTN_JSON, choose_harness, profile_of_model};
pub use references::{ToolReference, check_tool_references};
pub use schema::SchemaError;
pub use skill::{RouterConfig, Rule, SelectionSource, Skill, SkillRouter, SkillScore, SkillSelection, parse_skill};
pub use tools::{RegisteredTool, ToolOverride, ToolRegistry, ToolSpec, ToolsConfig};
