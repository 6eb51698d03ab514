//! `nextn-commerce-mcp`: the commerce MCP server. stdio by default; `--http 127.0.0.1:PORT` for
//! Streamable HTTP at `/mcp` (loopback only; port 0 picks a free port, and the URL is printed on
//! stdout as `MCP endpoint: http://...`).

use std::{net::SocketAddr, path::PathBuf};

use clap::Parser;
use nextn_commerce_mcp::{Catalog, CommerceServer, Faults, default_data_path};

#[derive(Debug, Parser)]
#[command(
    name = "nextn-commerce-mcp",
    version,
    about = "Commerce MCP server: products, stock, promotions, shipping, after-sales, live-room status"
)]
struct Args {
    /// The catalogue fixture (JSON). Defaults to the bundled tools/commerce-mcp/data/catalog.json.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Serve Streamable HTTP at http://ADDR/mcp instead of stdio. Loopback addresses only.
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,
    /// TEST ONLY (fault injection): the tool NAME waits MS milliseconds before answering
    /// (a client cancellation ends the wait). Repeatable.
    #[arg(long, value_name = "NAME:MS", value_parser = Faults::parse_slow)]
    slow_tool: Vec<(String, std::time::Duration)>,
    /// TEST ONLY (fault injection): the process exits abruptly, without answering, when TOOL is
    /// called. Repeatable.
    #[arg(long, value_name = "TOOL")]
    crash_on: Vec<String>,
    /// TEST ONLY (fault injection): TOOL answers with an `isError: true` result. Repeatable.
    #[arg(long, value_name = "TOOL")]
    error_on: Vec<String>,
    /// TEST ONLY (fault injection): TOOL answers with text that is not valid JSON (a truncated object).
    /// Repeatable.
    #[arg(long, value_name = "TOOL")]
    malformed_on: Vec<String>,
    /// The current time for promotion expiry, RFC 3339 (e.g. 2026-12-01T10:00:00+08:00). Also read from
    /// COMMERCE_NOW; defaults to the system clock.
    #[arg(long, value_name = "RFC3339", env = "COMMERCE_NOW", value_parser = Catalog::parse_now)]
    now: Option<chrono::DateTime<chrono::FixedOffset>>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nextn-commerce-mcp: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    // stdout carries the protocol in stdio mode: logs go to stderr.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,nextn_commerce_mcp=info")
            }),
        )
        .init();
    let args = Args::parse();
    let path = args.data.unwrap_or_else(default_data_path);
    let mut catalog = Catalog::load(&path)?;
    if let Some(now) = args.now {
        tracing::info!(%now, "promotions expire against a pinned time");
        catalog = catalog.with_now(now);
    }
    let faults = Faults {
        slow: args.slow_tool.into_iter().collect(),
        crash_on: args.crash_on,
        error_on: args.error_on,
        malformed_on: args.malformed_on,
    };
    if !faults.is_empty() {
        tracing::warn!(?faults, "fault injection is on (test only)");
    }
    let server = CommerceServer::new(catalog, faults);
    match args.http {
        None => nextn_commerce_mcp::serve_stdio(server).await,
        Some(addr) => {
            let http = nextn_commerce_mcp::http::serve_http(server, addr).await?;
            println!("MCP endpoint: {}", http.url());
            use std::io::Write;
            std::io::stdout().flush()?;
            tokio::select! {
                _ = http.wait() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            Ok(())
        }
    }
}
