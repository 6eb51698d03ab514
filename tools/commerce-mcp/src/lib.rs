//! nextn-commerce-mcp: a commerce MCP server for the live-stream host agent.
//!
//! Tools: `search_products`, `get_product`, `check_stock`, `list_promotions`, `shipping_policy`,
//! `after_sales_policy`, `room_status`, over a JSON fixture (`data/catalog.json` by default).
//! Transports: stdio (default) and Streamable HTTP on a loopback address (`--http`).

pub mod catalog;
pub mod http;
pub mod server;

pub use catalog::{Catalog, default_data_path};
pub use server::{CommerceServer, Faults};

/// The names of the tools this server provides, in listing order.
pub const TOOL_NAMES: [&str; 7] = [
    "search_products",
    "get_product",
    "check_stock",
    "list_promotions",
    "shipping_policy",
    "after_sales_policy",
    "room_status",
];

/// Serve `server` over stdin/stdout until the client goes away.
pub async fn serve_stdio(server: CommerceServer) -> anyhow::Result<()> {
    use rmcp::ServiceExt;
    let running = server.serve(rmcp::transport::stdio()).await?;
    running.waiting().await?;
    Ok(())
}
