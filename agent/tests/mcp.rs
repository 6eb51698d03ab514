//! The MCP client against real servers: the commerce server binary (stdio child process and
//! Streamable HTTP), with its fault injection for timeouts and crashes, and the MCP project's
//! reference server from npm (`@modelcontextprotocol/server-everything`, skipped when node/npx
//! or the package are not available).
//!
//! The commerce server binary must be built: `cargo test --workspace` builds every member's
//! binaries first; with `cargo test -p nextn-agent --test mcp` alone, run
//! `cargo build -p nextn-commerce-mcp` before (or point `NEXTN_COMMERCE_MCP_BIN` at it).

mod common;
use common::commerce_bin;

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use nextn_agent::mcp::{DEFAULT_CALL_TIMEOUT, McpClient, McpError, McpPool};
use serde_json::json;
use tokio::io::AsyncBufReadExt;

const COMMERCE_TOOLS: [&str; 7] = [
    "search_products",
    "get_product",
    "check_stock",
    "list_promotions",
    "shipping_policy",
    "after_sales_policy",
    "room_status",
];

fn commerce_spec(flags: &str) -> String {
    format!("'{}' {flags}", commerce_bin().display())
}

async fn commerce(flags: &str) -> McpClient {
    McpClient::connect(&commerce_spec(flags), None)
        .await
        .expect("connect to the commerce server")
}

#[tokio::test]
async fn list_tools_finds_all_seven() {
    let client = commerce("").await;
    assert_eq!(
        client.server_name(),
        "nextn-commerce-mcp",
        "named after the server's own serverInfo"
    );
    let tools = client.list_tools().await.unwrap();
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    names.sort();
    let mut want = COMMERCE_TOOLS.to_vec();
    want.sort();
    assert_eq!(names, want);
    for t in &tools {
        assert_eq!(t.server, "nextn-commerce-mcp");
        assert!(!t.description.is_empty(), "{} has a description", t.name);
        assert_eq!(t.input_schema["type"], "object", "{}", t.name);
    }
    let stock = tools.iter().find(|t| t.name == "check_stock").unwrap();
    assert_eq!(stock.input_schema["required"], json!(["product_id"]));
    client.close().await;
}

#[tokio::test]
async fn call_returns_data() {
    let client = commerce("").await;
    let out = client
        .call_tool(
            "check_stock",
            json!({"product_id": "p007", "colour": "Black", "size": "M"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap();
    assert!(!out.is_error, "{}", out.text);
    let s = out.structured.expect("structured content");
    assert_eq!(s["product_id"], "p007");
    assert_eq!(s["variants"].as_array().unwrap().len(), 1);
    assert!(
        out.text.contains("\"variants\""),
        "the text carries the same JSON: {}",
        out.text
    );
    let out = client
        .call_tool("room_status", serde_json::Value::Null, DEFAULT_CALL_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(out.structured.unwrap()["current_product"]["id"], "p007");
    client.close().await;
}

#[tokio::test]
async fn is_error_result_is_an_answer_not_a_failure() {
    let client = commerce("").await;
    let out = client
        .call_tool(
            "get_product",
            json!({"product_id": "p999"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap();
    assert!(out.is_error);
    assert!(out.text.contains("Unknown product 'p999'"), "{}", out.text);
    assert!(out.structured.is_none());
    // A protocol-level error (no such tool on the server) is an Err.
    let err = client
        .call_tool("teleport", json!({}), DEFAULT_CALL_TIMEOUT)
        .await
        .unwrap_err();
    assert!(matches!(err, McpError::Protocol { .. }), "{err:?}");
    // Arguments must be an object.
    let err = client
        .call_tool("get_product", json!(["p001"]), DEFAULT_CALL_TIMEOUT)
        .await
        .unwrap_err();
    assert!(matches!(err, McpError::Protocol { .. }), "{err:?}");
    // Still fine.
    let out = client
        .call_tool(
            "get_product",
            json!({"product_id": "p001"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap();
    assert!(!out.is_error);
    client.close().await;
}

#[tokio::test]
async fn timeout_cancels_the_call_and_the_client_stays_usable() {
    let client = commerce("--slow-tool check_stock:8000").await;
    let started = Instant::now();
    let err = client
        .call_tool(
            "check_stock",
            json!({"product_id": "p001"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap_err();
    let took = started.elapsed();
    match &err {
        McpError::Timeout {
            server,
            tool,
            after_ms,
        } => {
            assert_eq!(
                (server.as_str(), tool.as_str(), *after_ms),
                ("nextn-commerce-mcp", "check_stock", 5000)
            );
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        took >= Duration::from_millis(4900) && took < Duration::from_millis(6500),
        "took {took:?}"
    );
    // Another tool answers at once on the same connection.
    let t = Instant::now();
    let out = client
        .call_tool("room_status", json!({}), DEFAULT_CALL_TIMEOUT)
        .await
        .unwrap();
    assert!(!out.is_error && t.elapsed() < Duration::from_secs(2));
    // The server got notifications/cancelled: it stops waiting and says so on stderr.
    let deadline = Instant::now() + Duration::from_secs(3);
    while !client
        .stderr_tail()
        .iter()
        .any(|l| l.contains("check_stock cancelled by the client"))
    {
        assert!(
            Instant::now() < deadline,
            "no cancellation seen by the server; stderr: {:?}",
            client.stderr_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(client.is_alive());
    client.close().await;
}

#[tokio::test]
async fn server_crash_mid_call_is_reported_not_fatal() {
    let client = commerce("--crash-on get_product").await;
    let started = Instant::now();
    let err = client
        .call_tool(
            "get_product",
            json!({"product_id": "p001"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap_err();
    match &err {
        McpError::ServerDied { server, reason } => {
            assert_eq!(server, "nextn-commerce-mcp");
            assert!(
                reason.contains("--crash-on get_product"),
                "the reason quotes the server's stderr: {reason}"
            );
        }
        other => panic!("expected ServerDied, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "noticed promptly, not by timeout"
    );
    assert!(!client.is_alive());
    // Later calls fail the same way, at once; this process carries on.
    let err = client
        .call_tool("room_status", json!({}), DEFAULT_CALL_TIMEOUT)
        .await
        .unwrap_err();
    assert!(matches!(err, McpError::ServerDied { .. }), "{err:?}");
    assert!(matches!(
        client.list_tools().await,
        Err(McpError::ServerDied { .. })
    ));
    client.close().await;
}

#[tokio::test]
async fn connect_failures_are_errors() {
    let err = McpClient::connect("/nonexistent/mcp-server --flag", None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, McpError::Connect { server, .. } if server == "mcp-server"),
        "{err:?}"
    );
    // A program that exits instead of speaking MCP.
    let err = McpClient::connect(
        &commerce_spec("--data /nonexistent.json"),
        Some("shop".into()),
    )
    .await
    .unwrap_err();
    match &err {
        McpError::Connect { server, reason } => {
            assert_eq!(server, "shop");
            assert!(
                reason.contains("nonexistent.json"),
                "the reason quotes stderr: {reason}"
            );
        }
        other => panic!("{other:?}"),
    }
    let err = McpClient::connect("http://127.0.0.1:9/mcp", None)
        .await
        .unwrap_err();
    assert!(matches!(err, McpError::Connect { .. }), "{err:?}");
}

#[tokio::test]
async fn pool_routes_calls_and_rejects_unknown_names() {
    let shop = format!("shop={}", commerce_spec(""));
    let slow = format!("fragile={}", commerce_spec("--crash-on room_status"));
    let pool = McpPool::connect_all([shop, slow]).await.unwrap();
    assert_eq!(pool.servers().collect::<Vec<_>>(), ["shop", "fragile"]);
    assert_eq!(pool.tools().len(), 14);
    let out = pool
        .call(
            "shop",
            "search_products",
            json!({"query": "scarf"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(out.structured.unwrap()["results"][0]["id"], "p011");
    let out = pool
        .call_tool(
            "shipping_policy",
            json!({"region": "Taiwan"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap();
    assert!(out.text.contains("Taiwan"));
    assert!(matches!(
        pool.call_tool("fly", json!({}), DEFAULT_CALL_TIMEOUT).await,
        Err(McpError::UnknownTool { name }) if name == "fly"
    ));
    assert!(matches!(
        pool.call("nowhere", "room_status", json!({}), DEFAULT_CALL_TIMEOUT)
            .await,
        Err(McpError::UnknownServer { .. })
    ));
    // One server dying leaves the other working.
    let err = pool
        .call("fragile", "room_status", json!({}), DEFAULT_CALL_TIMEOUT)
        .await
        .unwrap_err();
    assert!(matches!(err, McpError::ServerDied { .. }), "{err:?}");
    let out = pool
        .call("shop", "room_status", json!({}), DEFAULT_CALL_TIMEOUT)
        .await
        .unwrap();
    assert!(!out.is_error);
    pool.close().await;
}

#[tokio::test]
async fn http_transport_lists_and_calls() {
    let mut server = tokio::process::Command::new(commerce_bin())
        .args(["--http", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(server.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let url = line
        .strip_prefix("MCP endpoint: ")
        .expect("the server prints its URL")
        .to_owned();

    let client = McpClient::connect(&url, Some("shop-http".into()))
        .await
        .unwrap();
    assert_eq!(client.server_name(), "shop-http");
    let tools = client.list_tools().await.unwrap();
    assert_eq!(tools.len(), 7);
    let out = client
        .call_tool(
            "list_promotions",
            json!({"product_id": "p007"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap();
    assert!(!out.is_error && out.text.contains("LIVE20"));
    let out = client
        .call_tool(
            "check_stock",
            json!({"product_id": "zzz"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap();
    assert!(out.is_error);
    // The HTTP server goes away: reported, not fatal.
    server.kill().await.unwrap();
    let err = client
        .call_tool("room_status", json!({}), DEFAULT_CALL_TIMEOUT)
        .await
        .unwrap_err();
    assert!(matches!(err, McpError::ServerDied { .. }), "{err:?}");
    client.close().await;
}

/// The MCP project's reference server, which nobody here wrote. Skips (passes, with a message)
/// when node/npx are missing or the package cannot be fetched; the first run downloads it into
/// the npm cache.
#[tokio::test]
async fn reference_server_everything_from_npm() {
    let npx_ok = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new("npx")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status(),
    )
    .await
    .is_ok_and(|s| s.is_ok_and(|s| s.success()));
    if !npx_ok {
        eprintln!("SKIP reference_server_everything_from_npm: node/npx not available");
        return;
    }
    let spec = "npx -y @modelcontextprotocol/server-everything";
    let client = match McpClient::connect_with_timeout(
        spec,
        Some("everything".into()),
        Duration::from_secs(240),
    )
    .await
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "SKIP reference_server_everything_from_npm: cannot start `{spec}` (offline? npm registry unreachable?): {e}"
            );
            return;
        }
    };
    let tools = client.list_tools().await.unwrap();
    eprintln!(
        "server-everything tools: {:?}",
        tools.iter().map(|t| t.name.as_str()).collect::<Vec<_>>()
    );
    let echo = tools
        .iter()
        .find(|t| t.name == "echo")
        .expect("the reference server has an echo tool");
    assert!(
        echo.input_schema["properties"]["message"].is_object(),
        "echo takes a message: {}",
        echo.input_schema
    );
    let out = client
        .call_tool(
            "echo",
            json!({"message": "hello from nextn"}),
            DEFAULT_CALL_TIMEOUT,
        )
        .await
        .unwrap();
    assert!(!out.is_error, "{}", out.text);
    assert!(out.text.contains("hello from nextn"), "{}", out.text);
    // Its tool-level validation failures arrive as an answer or a protocol error, never a crash.
    match client
        .call_tool("echo", json!({"wrong": 1}), DEFAULT_CALL_TIMEOUT)
        .await
    {
        Ok(out) => assert!(out.is_error, "{}", out.text),
        Err(e) => assert!(matches!(e, McpError::Protocol { .. }), "{e:?}"),
    }
    assert!(client.is_alive());
    client.close().await;
}
