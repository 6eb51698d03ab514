//! The MCP server: seven tools over a [`Catalog`], plus test-only fault injection.

use std::{collections::HashMap, sync::Arc, time::Duration};

use rmcp::{
    ErrorData, RoleServer, ServerHandler,
    handler::server::{router::tool::ToolRouter, tool::ToolCallContext, wrapper::Parameters},
    model::{CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock},
    service::RequestContext,
    tool, tool_handler, tool_router,
};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;

use crate::catalog::Catalog;

/// Test-only fault injection, off by default.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Tool name → delay before answering (honours the client's cancellation).
    pub slow: HashMap<String, Duration>,
    /// Calling one of these tools makes the whole process exit at once, without answering.
    pub crash_on: Vec<String>,
    /// These tools answer with an `isError: true` result (a tool-level failure, the connection stays up).
    pub error_on: Vec<String>,
    /// These tools answer with text content that is not valid JSON (a truncated object), and no structured
    /// content, as a buggy or cut-off server would.
    pub malformed_on: Vec<String>,
}

impl Faults {
    /// Parse a `--slow-tool NAME:MS` value.
    pub fn parse_slow(spec: &str) -> Result<(String, Duration), String> {
        let (name, ms) = spec
            .rsplit_once(':')
            .ok_or_else(|| format!("--slow-tool wants NAME:MS, got '{spec}'"))?;
        let ms: u64 = ms
            .trim()
            .parse()
            .map_err(|_| format!("--slow-tool: '{ms}' is not a number of milliseconds"))?;
        if name.trim().is_empty() {
            return Err(format!("--slow-tool wants NAME:MS, got '{spec}'"));
        }
        Ok((name.trim().to_owned(), Duration::from_millis(ms)))
    }

    pub fn is_empty(&self) -> bool {
        self.slow.is_empty()
            && self.crash_on.is_empty()
            && self.error_on.is_empty()
            && self.malformed_on.is_empty()
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct SearchProductsArgs {
    /// Words to look for in product names, categories, colours, materials and descriptions,
    /// e.g. "black jeans" or "merino". Every word must match.
    pub query: String,
    /// How many products to return (default 5, at most 20).
    #[serde(default)]
    pub max_results: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ProductIdArgs {
    /// The product id, e.g. "p007" (from search_products or room_status). An exact product name
    /// also works.
    pub product_id: String,
    /// Only these fields, separated by commas, e.g. "price" or "price,material" (also: colours, sizes,
    /// description, total_stock, promotion_codes, on_screen_now). Omit for every field.
    #[serde(default)]
    pub fields: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct AfterSalesArgs {
    /// Only these parts of the policy, separated by commas: return_window_days, no_reason_returns,
    /// exchange_window_days, exchanges, quality_issues, return_shipping, refunds, non_returnable, contact.
    /// Omit for the whole policy.
    #[serde(default)]
    pub fields: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct CheckStockArgs {
    /// The product id, e.g. "p007".
    pub product_id: String,
    /// Only this colour (case-insensitive), e.g. "Black". Omit for every colour.
    #[serde(default)]
    pub colour: Option<String>,
    /// Only this size (case-insensitive), e.g. "M" or "38". Omit for every size.
    #[serde(default)]
    pub size: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ListPromotionsArgs {
    /// Only promotions that apply to this product id. Omit for every promotion.
    #[serde(default)]
    pub product_id: Option<String>,
    /// Only this promotion code, e.g. "KNIT2", running or ended (its `running` says which).
    #[serde(default)]
    pub code: Option<String>,
    /// Only these fields of each promotion, separated by commas, e.g. "discount" or "valid_until" (also:
    /// title, description, min_spend, conditions, applies_to, storewide, live_room_now). Omit for every field.
    #[serde(default)]
    pub fields: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ShippingPolicyArgs {
    /// A destination such as "Mainland China", "Hong Kong", "Taiwan" or "International".
    /// Omit for the whole policy.
    #[serde(default)]
    pub region: Option<String>,
    /// With a region: only these of its terms, separated by commas: fee, free_over, delivery_days.
    #[serde(default)]
    pub fields: Option<String>,
}

/// The commerce MCP server. Cheap to clone (the catalog is shared).
#[derive(Clone)]
pub struct CommerceServer {
    catalog: Arc<Catalog>,
    faults: Arc<Faults>,
    tool_router: ToolRouter<Self>,
}

/// Turn a catalog answer into a tool result: JSON as text plus `structuredContent`, or an
/// `isError: true` result carrying the explanation.
fn result(answer: Result<Value, String>) -> CallToolResult {
    match answer {
        Ok(v) => CallToolResult::structured(v),
        Err(msg) => CallToolResult::error(vec![ContentBlock::text(msg)]),
    }
}

/// The real answer's text cut off mid-way (at most 40 characters, never valid JSON), with no structured content.
fn malform(response: &CallToolResponse) -> CallToolResult {
    let text = match response {
        CallToolResponse::Complete(r) => r
            .content
            .iter()
            .filter_map(|c| c.as_text())
            .map(|t| t.text.as_str())
            .collect::<String>(),
        _ => String::new(),
    };
    let cut: String = text
        .chars()
        .take((text.chars().count() / 2).clamp(1, 40))
        .collect();
    // A lone `{"` prefix keeps even an empty answer unparsable.
    CallToolResult::success(vec![ContentBlock::text(format!("{{\"{cut}"))])
}

#[tool_router(router = tool_router)]
impl CommerceServer {
    pub fn new(catalog: Catalog, faults: Faults) -> Self {
        Self {
            catalog: Arc::new(catalog),
            faults: Arc::new(faults),
            tool_router: Self::tool_router(),
        }
    }

    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    #[tool(
        description = "Search the product catalogue by keywords (name, category, colour, material, description). Returns matching products with id, name, price, colours, sizes and whether any stock is left. Use the id with the other tools."
    )]
    async fn search_products(
        &self,
        Parameters(a): Parameters<SearchProductsArgs>,
    ) -> CallToolResult {
        result(self.catalog.search_products(&a.query, a.max_results))
    }

    #[tool(
        description = "Full details of one product: name, category, price, colours, sizes, material, description, total stock, the promotion codes that apply, and whether it is on screen in the live room now."
    )]
    async fn get_product(&self, Parameters(a): Parameters<ProductIdArgs>) -> CallToolResult {
        result(self.catalog.get_product_fields(&a.product_id, a.fields.as_deref()))
    }

    #[tool(
        description = "Stock of a product by colour and size. Give a colour and/or size to narrow it down; each variant says 'in stock', 'low stock' (5 or fewer) or 'sold out'."
    )]
    async fn check_stock(&self, Parameters(a): Parameters<CheckStockArgs>) -> CallToolResult {
        result(
            self.catalog
                .check_stock(&a.product_id, a.colour.as_deref(), a.size.as_deref()),
        )
    }

    #[tool(
        description = "Coupons and promotions running now: code, description, discount (percent or amount), minimum spend, conditions and expiry. Give a product id to see only those that apply to it, a code for just that one (running or ended), fields for just those parts."
    )]
    async fn list_promotions(
        &self,
        Parameters(a): Parameters<ListPromotionsArgs>,
    ) -> CallToolResult {
        result(self.catalog.list_promotions_narrowed(
            a.product_id.as_deref(),
            a.code.as_deref(),
            a.fields.as_deref(),
        ))
    }

    #[tool(
        description = "Shipping policy: carrier, dispatch times, and per region the fee, free-shipping threshold and delivery days. Give a region for just its terms."
    )]
    async fn shipping_policy(
        &self,
        Parameters(a): Parameters<ShippingPolicyArgs>,
    ) -> CallToolResult {
        result(self.catalog.shipping_policy_fields(a.region.as_deref(), a.fields.as_deref()))
    }

    #[tool(
        description = "After-sales policy: no-reason return window, size/colour exchanges, quality issues, who pays return shipping, refund timing, non-returnable items and how to contact customer service."
    )]
    async fn after_sales_policy(&self, Parameters(a): Parameters<AfterSalesArgs>) -> CallToolResult {
        result(self.catalog.after_sales_policy_fields(a.fields.as_deref()))
    }

    #[tool(
        description = "Live-room status right now: room title, host, whether it is live, viewer and like counts, the product on screen, the ongoing promotion, and what is up next."
    )]
    async fn room_status(&self) -> CallToolResult {
        result(Ok(self.catalog.room_status()))
    }
}

#[tool_handler(
    router = self.tool_router,
    name = "nextn-commerce-mcp",
    instructions = "Commerce tools for a live-stream shopping room: look products up, check stock by colour and size, list coupons, and answer shipping, after-sales and live-room questions. Prices are in CNY."
)]
impl ServerHandler for CommerceServer {
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let name = request.name.to_string();
        if self.faults.crash_on.iter().any(|t| t == &name) {
            eprintln!(
                "nextn-commerce-mcp: --crash-on {name}: exiting abruptly (test fault injection)"
            );
            std::process::exit(70);
        }
        if let Some(delay) = self.faults.slow.get(&name) {
            tracing::info!(tool = %name, ?delay, "--slow-tool: delaying the answer (test fault injection)");
            tokio::select! {
                _ = tokio::time::sleep(*delay) => {}
                _ = context.ct.cancelled() => {
                    eprintln!("nextn-commerce-mcp: {name} cancelled by the client");
                    return Err(ErrorData::internal_error("request cancelled", None));
                }
            }
        }
        if self.faults.error_on.iter().any(|t| t == &name) {
            tracing::info!(tool = %name, "--error-on: failing the call (test fault injection)");
            return Ok(CallToolResponse::Complete(CallToolResult::error(vec![
                ContentBlock::text(format!(
                    "{name} failed: the commerce backend is unavailable (injected by --error-on {name})"
                )),
            ])));
        }
        let malformed = self.faults.malformed_on.iter().any(|t| t == &name);
        let tcc = ToolCallContext::new(self, request, context);
        let response = self.tool_router.call(tcc).await?;
        if malformed {
            tracing::info!(tool = %name, "--malformed-on: truncating the answer (test fault injection)");
            return Ok(CallToolResponse::Complete(malform(&response)));
        }
        Ok(response)
    }
}
