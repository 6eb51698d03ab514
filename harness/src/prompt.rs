//! The prompt pipeline: named, ordered blocks rendered from the harness state and one request's context.
//!
//! Default order, stable first so that a prefix cache reuses as much as possible across comments:
//! `rules` (boundary rules), `role` (role and reply style), `constraints` (numeric limits), `skill_index` (every
//! skill's name and description) — fixed per harness version; `products` — fixed per room session; `room` —
//! live status; `skills` (bodies of the selected skills) and `faq` (retrieved entries) — per comment. Empty
//! blocks are left out. Each rendered block is recorded as `BlockRecord { name, hash, chars }` for the trace.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::HarnessError;
use crate::faq::FaqHit;
use crate::harness::Harness;
use crate::hash::hash_hex;
use crate::skill::SkillSelection;

/// How often a block's content changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stability {
    /// Fixed for a harness version.
    Harness,
    /// Fixed for a live-room session.
    Session,
    /// Changes during the stream.
    Live,
    /// Changes with every comment.
    Request,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockKind {
    Rules,
    Role,
    Constraints,
    SkillIndex,
    Products,
    Room,
    Skills,
    Faq,
}

impl BlockKind {
    pub const DEFAULT_ORDER: [BlockKind; 8] = [
        BlockKind::Rules,
        BlockKind::Role,
        BlockKind::Constraints,
        BlockKind::SkillIndex,
        BlockKind::Products,
        BlockKind::Room,
        BlockKind::Skills,
        BlockKind::Faq,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BlockKind::Rules => "rules",
            BlockKind::Role => "role",
            BlockKind::Constraints => "constraints",
            BlockKind::SkillIndex => "skill_index",
            BlockKind::Products => "products",
            BlockKind::Room => "room",
            BlockKind::Skills => "skills",
            BlockKind::Faq => "faq",
        }
    }

    pub fn stability(self) -> Stability {
        match self {
            BlockKind::Rules | BlockKind::Role | BlockKind::Constraints | BlockKind::SkillIndex => Stability::Harness,
            BlockKind::Products => Stability::Session,
            BlockKind::Room => Stability::Live,
            BlockKind::Skills | BlockKind::Faq => Stability::Request,
        }
    }

    fn title(self) -> &'static str {
        match self {
            BlockKind::Rules => "Boundary rules (always apply)",
            BlockKind::Role => "Role and reply style",
            BlockKind::Constraints => "Limits",
            BlockKind::SkillIndex => "Skills",
            BlockKind::Products => "Products in this room",
            BlockKind::Room => "Live room now",
            BlockKind::Skills => "Active skills",
            BlockKind::Faq => "Relevant FAQ",
        }
    }
}

/// Live-room status (from a room file or the `room_status` tool). Unknown fields are kept and rendered.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoomStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub viewers: Option<u64>,
    /// The product being presented now (id or name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_stage: Option<String>,
    /// Promotions running now, as text (the only discounts the host may mention besides tool results).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub promotions: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notes: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A product's specs (from a room file or `get_product`). Unknown fields are kept and rendered.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Product {
    pub id: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub specs: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A room file: `{"room": {...}, "products": [...]}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RoomFile {
    pub room: Option<RoomStatus>,
    pub products: Vec<Product>,
}

impl RoomFile {
    pub fn load(path: &std::path::Path) -> Result<Self, HarnessError> {
        let text = std::fs::read_to_string(path).map_err(|e| HarnessError::io(path, e))?;
        Self::parse(path, &text)
    }

    /// `text` as a room file; errors name `source` (the file, or the flag the JSON came in).
    pub fn parse(source: &std::path::Path, text: &str) -> Result<Self, HarnessError> {
        serde_json::from_str(text).map_err(|e| crate::error::json_error(source, &e))
    }
}

/// One request: the viewer comment and what is known around it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RequestContext {
    pub comment: String,
    /// Earlier turns, oldest first, as `(role, text)`; role `user` (or `viewer`) for viewers.
    pub history: Vec<(String, String)>,
    pub room: Option<RoomStatus>,
    pub products: Vec<Product>,
}

impl RequestContext {
    pub fn new(comment: impl Into<String>) -> Self {
        RequestContext { comment: comment.into(), ..Default::default() }
    }

    /// The most recent viewer turn in `history`.
    pub fn previous_viewer_turn(&self) -> Option<&str> {
        self.history.iter().rev().find(|(role, _)| role == "user" || role == "viewer").map(|(_, t)| t.as_str())
    }
}

/// The texts a reply may draw facts from, for the `before_reply` payload's `evidence`: the room status and
/// products (as JSON), the retrieved FAQ answers and every tool result of the request. Skill bodies and rules are
/// deliberately not evidence: their examples must not whitelist a discount.
pub fn reply_evidence(ctx: &RequestContext, faq: &[FaqHit], tool_results: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(room) = &ctx.room {
        out.push(serde_json::to_string(room).unwrap_or_default());
    }
    out.extend(ctx.products.iter().map(|p| serde_json::to_string(p).unwrap_or_default()));
    out.extend(faq.iter().map(|h| h.a.clone()));
    out.extend(tool_results.iter().map(|r| match r {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }));
    out
}

/// What the trace records of a rendered block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRecord {
    pub name: String,
    /// FNV-1a of the block text, 16 hex digits.
    pub hash: String,
    /// Length of the block text in characters.
    pub chars: usize,
}

/// The system prompt for one request and how it was made.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prompt {
    pub system: String,
    /// The system prompt without its Limits block: the text a reply's figures may come from. The limits are the
    /// harness's own numbers (reply characters, rounds, tool timeout), never a fact about the shop, so "120 yuan"
    /// is not grounded by "Reply in at most 120 characters".
    pub evidence: String,
    pub blocks: Vec<BlockRecord>,
    pub skills: SkillSelection,
    pub faq: Vec<FaqHit>,
    /// The harness version the prompt was built from.
    pub harness_version: String,
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(items) => items.iter().map(scalar_text).collect::<Vec<_>>().join(", "),
        other => other.to_string(),
    }
}

fn fmt_number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 { format!("{}", x as i64) } else { format!("{x:.2}") }
}

/// Push Markdown headings `levels` deeper so that a skill body nests under the block heading.
fn demote_headings(body: &str, levels: usize) -> String {
    let extra = "#".repeat(levels);
    body.lines()
        .map(|l| if l.starts_with('#') { format!("{extra}{l}") } else { l.to_string() })
        .collect::<Vec<_>>()
        .join("\n")
}

fn render_product(p: &Product) -> String {
    let mut line = format!("- [{}] {}", p.id, p.name);
    if let Some(price) = p.price {
        line.push_str(format!(" — {} {}", fmt_number(price), p.currency.as_deref().unwrap_or("")).trim_end());
    }
    let mut details: Vec<String> = p.specs.iter().map(|(k, v)| format!("{k}: {}", scalar_text(v))).collect();
    details.extend(p.extra.iter().map(|(k, v)| format!("{k}: {}", scalar_text(v))));
    if !details.is_empty() {
        line.push_str(&format!("\n  {}", details.join("; ")));
    }
    if let Some(d) = p.description.as_deref().filter(|d| !d.trim().is_empty()) {
        line.push_str(&format!("\n  {}", d.trim()));
    }
    line
}

fn render_room(r: &RoomStatus) -> String {
    let mut lines = Vec::new();
    if let Some(t) = &r.title {
        lines.push(format!("- Stream: {t}"));
    }
    if let Some(h) = &r.host {
        lines.push(format!("- Host: {h}"));
    }
    if let Some(v) = r.viewers {
        lines.push(format!("- Viewers: {v}"));
    }
    if let Some(s) = &r.on_stage {
        lines.push(format!("- On stage now: {s}"));
    }
    if !r.promotions.is_empty() {
        lines.push(format!("- Promotions running now: {}", r.promotions.join("; ")));
    }
    for (k, v) in &r.extra {
        lines.push(format!("- {k}: {}", scalar_text(v)));
    }
    if let Some(n) = &r.notes {
        lines.push(format!("- Notes: {n}"));
    }
    lines.join("\n")
}

impl Harness {
    /// The skills for a request: the router's choice, or `explicit` names (the model's own choice).
    pub fn select_skills(
        &self,
        ctx: &RequestContext,
        explicit: Option<&[String]>,
    ) -> Result<SkillSelection, HarnessError> {
        self.router().select(&ctx.comment, ctx.previous_viewer_turn(), explicit)
    }

    /// FAQ entries retrieved for a comment.
    pub fn retrieve_faq(&self, comment: &str) -> Vec<FaqHit> {
        self.faq().search(comment, self.config().faq_top_k, self.config().faq_min_score)
    }

    /// Render the system prompt for `ctx`. `explicit_skills` overrides the router (unknown names are an error).
    pub fn build_prompt(
        &self,
        ctx: &RequestContext,
        explicit_skills: Option<&[String]>,
    ) -> Result<Prompt, HarnessError> {
        let skills = self.select_skills(ctx, explicit_skills)?;
        let faq = self.retrieve_faq(&ctx.comment);
        let mut blocks = Vec::new();
        let mut texts = Vec::new();
        let mut evidence = Vec::new();
        for &kind in &self.config().blocks {
            let content = self.render_block(kind, ctx, &skills, &faq);
            let content = content.trim();
            if content.is_empty() {
                continue;
            }
            let text = format!("## {}\n{}", kind.title(), content);
            blocks.push(BlockRecord {
                name: kind.name().to_string(),
                hash: hash_hex(text.as_bytes()),
                chars: text.chars().count(),
            });
            if kind != BlockKind::Constraints {
                evidence.push(text.clone());
            }
            texts.push(text);
        }
        Ok(Prompt {
            system: texts.join("\n\n"),
            evidence: evidence.join("\n\n"),
            blocks,
            skills,
            faq,
            harness_version: self.version().to_string(),
        })
    }

    /// The content of one block (without its heading); empty when there is nothing to say.
    pub fn render_block(
        &self,
        kind: BlockKind,
        ctx: &RequestContext,
        skills: &SkillSelection,
        faq: &[FaqHit],
    ) -> String {
        let config = self.config();
        match kind {
            BlockKind::Rules => self.rules_text().trim().to_string(),
            BlockKind::Role => [config.role.trim(), config.style.trim()]
                .iter()
                .filter(|s| !s.is_empty())
                .copied()
                .collect::<Vec<_>>()
                .join("\n\n"),
            BlockKind::Constraints => config.constraints.render(),
            BlockKind::SkillIndex if config.skill_index => {
                self.skills().iter().map(|s| format!("- {}: {}", s.name, s.description)).collect::<Vec<_>>().join("\n")
            }
            BlockKind::SkillIndex => String::new(),
            BlockKind::Products => ctx.products.iter().map(render_product).collect::<Vec<_>>().join("\n"),
            BlockKind::Room => ctx.room.as_ref().map(render_room).unwrap_or_default(),
            BlockKind::Skills => skills
                .selected
                .iter()
                .filter_map(|name| self.skill(name))
                .map(|s| format!("### Skill: {} (v{})\n{}", s.name, s.version, demote_headings(&s.body, 3)))
                .collect::<Vec<_>>()
                .join("\n\n"),
            BlockKind::Faq => faq.iter().map(|h| format!("Q: {}\nA: {}", h.q, h.a)).collect::<Vec<_>>().join("\n\n"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_block_order_is_stable_first() {
        let order = BlockKind::DEFAULT_ORDER;
        assert!(order.windows(2).all(|w| w[0].stability() <= w[1].stability()), "{order:?}");
    }

    #[test]
    fn skill_headings_nest_under_the_block_heading() {
        assert_eq!(demote_headings("# A\ntext #x\n## B", 3), "#### A\ntext #x\n##### B");
    }

    #[test]
    fn product_renders_price_specs_and_extra_fields() {
        let p: Product = serde_json::from_value(serde_json::json!({
            "id": "sku-1", "name": "Linen shirt", "price": 129.0, "currency": "CNY",
            "specs": {"material": "100% linen", "sizes": ["S", "M", "L"]}, "stock": 12
        }))
        .unwrap();
        assert_eq!(
            render_product(&p),
            "- [sku-1] Linen shirt — 129 CNY\n  material: 100% linen; sizes: S, M, L; stock: 12"
        );
    }
}
