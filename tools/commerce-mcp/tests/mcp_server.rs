//! Every tool through a real MCP client connection: the server binary as a stdio child process
//! (rmcp's `TokioChildProcess`), and once over Streamable HTTP on an ephemeral loopback port.

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use nextn_commerce_mcp::TOOL_NAMES;
use rmcp::{
    RoleClient, ServiceExt,
    model::{CallToolRequestParams, CallToolResult},
    service::{RunningService, ServiceError},
    transport::{StreamableHttpClientTransport, TokioChildProcess},
};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;

const BIN: &str = env!("CARGO_BIN_EXE_nextn-commerce-mcp");

type Client = RunningService<RoleClient, ()>;

fn command(args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.args(args).env("RUST_LOG", "warn");
    cmd
}

async fn connect(args: &[&str]) -> Client {
    let (transport, _stderr) = TokioChildProcess::builder(command(args))
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the server binary");
    tokio::time::timeout(Duration::from_secs(20), ().serve(transport))
        .await
        .expect("handshake in time")
        .expect("handshake")
}

async fn call(client: &Client, tool: &str, args: Value) -> Result<CallToolResult, ServiceError> {
    let mut params = CallToolRequestParams::new(tool.to_owned());
    if let Value::Object(map) = args {
        params = params.with_arguments(map);
    }
    client.peer().call_tool(params).await
}

fn text(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text())
        .map(|t| t.text.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

/// A successful result: not an error, with structured content that its text mirrors.
fn ok(r: CallToolResult) -> Value {
    assert_ne!(
        r.is_error,
        Some(true),
        "unexpected tool error: {}",
        text(&r)
    );
    let v = r.structured_content.clone().expect("structured content");
    let from_text: Value = serde_json::from_str(&text(&r)).expect("text content is the JSON");
    assert_eq!(v, from_text);
    v
}

/// A tool-level error (`isError: true`) whose message mentions `needle`.
fn tool_error(r: CallToolResult, needle: &str) -> String {
    assert_eq!(r.is_error, Some(true), "expected isError, got {}", text(&r));
    let t = text(&r);
    assert!(
        t.contains(needle),
        "error message {t:?} should mention {needle:?}"
    );
    t
}

#[tokio::test]
async fn stdio_lists_seven_tools_with_schemas() {
    let client = connect(&[]).await;
    let info = client.peer().peer_info().expect("server info");
    assert_eq!(
        info.server_info.as_ref().map(|i| i.name.as_str()),
        Some("nextn-commerce-mcp")
    );
    let tools = client.peer().list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(names.len(), 7, "{names:?}");
    for n in TOOL_NAMES {
        assert!(names.contains(&n), "missing {n} in {names:?}");
    }
    let schema = |name: &str| -> Value {
        let t = tools.iter().find(|t| t.name == name).unwrap();
        assert!(
            t.description.as_deref().is_some_and(|d| d.len() > 40),
            "{name} needs a description"
        );
        Value::Object((*t.input_schema).clone())
    };
    let s = schema("search_products");
    assert_eq!(s["type"], "object");
    assert_eq!(s["required"], json!(["query"]));
    assert!(s["properties"]["max_results"].is_object());
    assert!(
        s["properties"]["query"]["description"]
            .as_str()
            .unwrap()
            .contains("black jeans")
    );
    let s = schema("check_stock");
    assert_eq!(s["required"], json!(["product_id"]));
    assert!(s["properties"]["colour"].is_object() && s["properties"]["size"].is_object());
    assert_eq!(schema("get_product")["required"], json!(["product_id"]));
    assert!(schema("list_promotions")["properties"]["product_id"].is_object());
    assert!(schema("shipping_policy")["properties"]["region"].is_object());
    for name in ["after_sales_policy", "room_status"] {
        let s = schema(name);
        assert_eq!(s["type"], "object");
        assert!(
            s.get("required")
                .is_none_or(|r| r.as_array().unwrap().is_empty())
        );
    }
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn stdio_every_tool_happy_and_error_paths() {
    // Pinned to the room's start, when all five promotions are still running.
    let c = connect(&["--now", "2026-11-29T20:00:00+08:00"]).await;

    // search_products
    let v = ok(
        call(&c, "search_products", json!({"query": "puffer jacket"}))
            .await
            .unwrap(),
    );
    assert_eq!(v["results"][0]["id"], "p007");
    let v = ok(call(
        &c,
        "search_products",
        json!({"query": "black", "max_results": 3}),
    )
    .await
    .unwrap());
    assert_eq!(v["results"].as_array().unwrap().len(), 3);
    let v = ok(call(&c, "search_products", json!({"query": "spacesuit"}))
        .await
        .unwrap());
    assert_eq!(v["total_matches"], 0);
    tool_error(
        call(&c, "search_products", json!({"query": "  "}))
            .await
            .unwrap(),
        "empty",
    );

    // get_product
    let v = ok(call(&c, "get_product", json!({"product_id": "p006"}))
        .await
        .unwrap());
    assert_eq!(v["name"], "Merino Crewneck Sweater");
    assert_eq!(v["currency"], "CNY");
    assert!(v["material"].as_str().unwrap().contains("merino"));
    assert!(
        v["promotion_codes"]
            .as_array()
            .unwrap()
            .contains(&json!("KNIT2"))
    );
    let e = tool_error(
        call(&c, "get_product", json!({"product_id": "p999"}))
            .await
            .unwrap(),
        "Unknown product 'p999'",
    );
    assert!(
        e.contains("search_products"),
        "the message points at search_products: {e}"
    );

    // check_stock
    let v = ok(call(
        &c,
        "check_stock",
        json!({"product_id": "p007", "colour": "Dusty Pink", "size": "M"}),
    )
    .await
    .unwrap());
    assert_eq!(v["available"], false);
    assert_eq!(v["variants"][0]["status"], "sold out");
    let v = ok(call(
        &c,
        "check_stock",
        json!({"product_id": "p007", "size": "L"}),
    )
    .await
    .unwrap());
    assert_eq!(v["variants"].as_array().unwrap().len(), 3);
    assert!(v["total_quantity"].as_u64().unwrap() > 0);
    tool_error(
        call(
            &c,
            "check_stock",
            json!({"product_id": "p007", "colour": "Purple"}),
        )
        .await
        .unwrap(),
        "Available colours",
    );
    tool_error(
        call(&c, "check_stock", json!({"product_id": "nope"}))
            .await
            .unwrap(),
        "Unknown product",
    );

    // list_promotions
    let v = ok(call(&c, "list_promotions", json!({})).await.unwrap());
    assert_eq!(v["promotions"].as_array().unwrap().len(), 5);
    let v = ok(call(&c, "list_promotions", json!({"product_id": "p007"}))
        .await
        .unwrap());
    let live = v["promotions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["code"] == "LIVE20")
        .expect("LIVE20");
    assert_eq!(live["discount"], json!({"type": "percent", "value": 20.0}));
    assert_eq!(live["live_room_now"], true);
    assert!(
        live["valid_until"]
            .as_str()
            .unwrap()
            .starts_with("2026-12-31")
    );
    tool_error(
        call(&c, "list_promotions", json!({"product_id": "p000"}))
            .await
            .unwrap(),
        "Unknown product",
    );
    let v = ok(call(&c, "list_promotions", json!({"code": "WELCOME30", "fields": "min_spend"}))
        .await
        .unwrap());
    assert_eq!(v["promotions"], json!([{"code": "WELCOME30", "min_spend": 199.0, "running": true}]));
    tool_error(
        call(&c, "list_promotions", json!({"code": "FREE99"})).await.unwrap(),
        "no promotion code 'FREE99'",
    );

    // shipping_policy
    let v = ok(call(&c, "shipping_policy", json!({})).await.unwrap());
    assert!(v["policy"]["regions"].as_array().unwrap().len() >= 4);
    let v = ok(call(&c, "shipping_policy", json!({"region": "Hong Kong"}))
        .await
        .unwrap());
    assert_eq!(v["region"]["fee"], 25.0);
    tool_error(
        call(&c, "shipping_policy", json!({"region": "Mars"}))
            .await
            .unwrap(),
        "Known regions",
    );

    // after_sales_policy (no arguments; no error path)
    let v = ok(call(&c, "after_sales_policy", json!({})).await.unwrap());
    assert_eq!(v["return_window_days"], 7);
    assert!(v["non_returnable"].as_array().unwrap().len() >= 2);

    // `fields` narrows get_product, shipping_policy and after_sales_policy; an unknown field names the known ones.
    let v = ok(call(&c, "get_product", json!({"product_id": "p006", "fields": "price"})).await.unwrap());
    assert_eq!(v, json!({"id": "p006", "name": v["name"], "price": v["price"]}));
    assert!(v["price"].is_number() && v["name"].is_string());
    let v = ok(call(&c, "shipping_policy", json!({"region": "Hong Kong", "fields": "fee"})).await.unwrap());
    assert_eq!(v["region"], json!({"region": "Hong Kong & Macau", "fee": 25.0}));
    let v = ok(call(&c, "after_sales_policy", json!({"fields": "exchange_window_days,contact"})).await.unwrap());
    assert_eq!(v.as_object().unwrap().len(), 2);
    tool_error(
        call(&c, "get_product", json!({"product_id": "p006", "fields": "cost"})).await.unwrap(),
        "no field 'cost'",
    );

    // room_status (no arguments; no error path)
    let v = ok(call(&c, "room_status", json!({})).await.unwrap());
    assert_eq!(v["live"], true);
    assert_eq!(v["current_product"]["id"], "p007");
    assert_eq!(v["ongoing_promotion"]["code"], "LIVE20");

    // An unknown tool is a protocol error; a missing required argument an error the model can read.
    assert!(matches!(
        call(&c, "teleport", json!({})).await,
        Err(ServiceError::McpError(_))
    ));
    tool_error(
        call(&c, "get_product", json!({})).await.unwrap(),
        "missing field `product_id`",
    );
    // ...and the connection is still fine afterwards.
    ok(call(&c, "room_status", json!({})).await.unwrap());
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn custom_data_file_and_bad_data_file() {
    let dir = std::env::temp_dir().join(format!("nextn-commerce-mcp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut catalog: Value = serde_json::from_str(
        &std::fs::read_to_string(nextn_commerce_mcp::default_data_path()).unwrap(),
    )
    .unwrap();
    catalog["room"]["title"] = json!("Test room");
    catalog["room"]["viewers"] = json!(7);
    let good = dir.join("catalog.json");
    std::fs::write(&good, catalog.to_string()).unwrap();
    let c = connect(&["--data", good.to_str().unwrap()]).await;
    let v = ok(call(&c, "room_status", json!({})).await.unwrap());
    assert_eq!(
        (v["title"].as_str(), v["viewers"].as_u64()),
        (Some("Test room"), Some(7))
    );
    c.cancel().await.unwrap();

    catalog["room"]["current_product_id"] = json!("p404");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, catalog.to_string()).unwrap();
    let out = command(&["--data", bad.to_str().unwrap()])
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("p404"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn fault_injection_slow_tool_honours_cancellation_and_crash_on_exits() {
    let c = connect(&[
        "--slow-tool",
        "check_stock:5000",
        "--slow-tool",
        "room_status:300",
        "--crash-on",
        "get_product",
    ])
    .await;
    let t = Instant::now();
    ok(call(&c, "room_status", json!({})).await.unwrap());
    assert!(t.elapsed() >= Duration::from_millis(300));
    // A caller that gives up drops the request future: rmcp sends notifications/cancelled.
    let t = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_millis(200),
        call(&c, "check_stock", json!({"product_id": "p001"})),
    )
    .await;
    assert!(r.is_err() && t.elapsed() < Duration::from_secs(2));
    // Other tools still answer at once.
    let t = Instant::now();
    ok(call(&c, "after_sales_policy", json!({})).await.unwrap());
    assert!(t.elapsed() < Duration::from_secs(2));
    // --crash-on: the process dies without answering; the client sees the transport close.
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        call(&c, "get_product", json!({"product_id": "p001"})),
    )
    .await
    .expect("the crash is noticed, not waited out");
    assert!(
        matches!(
            r,
            Err(ServiceError::TransportClosed | ServiceError::TransportSend(_))
        ),
        "{r:?}"
    );
    let _ = c.cancel().await;
}

fn promotion_codes(v: &Value) -> Vec<String> {
    v["promotions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["code"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn expired_promotions_are_not_listed_with_now_from_flag_or_env() {
    // FLASH100 ended 2026-11-30T23:59:59+08:00.
    let c = connect(&["--now", "2026-12-01T10:00:00+08:00"]).await;
    let v = ok(call(&c, "list_promotions", json!({})).await.unwrap());
    let codes = promotion_codes(&v);
    assert!(
        !codes.contains(&"FLASH100".to_owned()) && codes.contains(&"LIVE20".to_owned()),
        "{codes:?}"
    );
    let p = ok(call(&c, "get_product", json!({"product_id": "p007"}))
        .await
        .unwrap());
    assert!(
        !p["promotion_codes"]
            .as_array()
            .unwrap()
            .contains(&json!("FLASH100"))
    );
    assert_eq!(p["link_id"], "lk-p007");
    let _ = c.cancel().await;

    let mut cmd = command(&[]);
    cmd.env("COMMERCE_NOW", "2027-01-01T00:00:00+08:00");
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let c = ().serve(transport).await.expect("handshake");
    let room = ok(call(&c, "room_status", json!({})).await.unwrap());
    assert!(
        room["ongoing_promotion"].is_null(),
        "LIVE20 ended 2026-12-31: {room}"
    );
    let v = ok(call(&c, "list_promotions", json!({})).await.unwrap());
    assert_eq!(promotion_codes(&v), vec!["WELCOME30".to_owned()]);
    let _ = c.cancel().await;

    let out = command(&["--now", "tomorrow"])
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("RFC 3339"));
}

#[tokio::test]
async fn fault_injection_error_on_returns_is_error_and_the_server_stays_up() {
    let c = connect(&["--error-on", "check_stock"]).await;
    let e = tool_error(
        call(&c, "check_stock", json!({"product_id": "p001"}))
            .await
            .unwrap(),
        "check_stock failed",
    );
    assert!(e.contains("--error-on"), "{e}");
    ok(call(&c, "room_status", json!({})).await.unwrap());
    tool_error(
        call(&c, "check_stock", json!({"product_id": "p001"}))
            .await
            .unwrap(),
        "unavailable",
    );
    let _ = c.cancel().await;
}

#[tokio::test]
async fn fault_injection_malformed_on_returns_text_that_is_not_json() {
    let c = connect(&[
        "--malformed-on",
        "get_product",
        "--malformed-on",
        "after_sales_policy",
    ])
    .await;
    for (tool, args) in [
        ("get_product", json!({"product_id": "p007"})),
        ("after_sales_policy", json!({})),
    ] {
        let r = call(&c, tool, args).await.unwrap();
        assert_ne!(
            r.is_error,
            Some(true),
            "a malformed answer is not flagged as an error"
        );
        assert!(r.structured_content.is_none());
        let t = text(&r);
        assert!(
            !t.is_empty() && serde_json::from_str::<Value>(&t).is_err(),
            "{tool}: {t:?} parsed as JSON"
        );
    }
    ok(call(&c, "room_status", json!({})).await.unwrap());
    let _ = c.cancel().await;
}

#[tokio::test]
async fn flags_are_validated() {
    let out = command(&["--http", "0.0.0.0:0"])
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"));
    let out = command(&["--slow-tool", "check_stock"])
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("NAME:MS"));
}

/// Starts `--http 127.0.0.1:0` and reads the URL it prints.
async fn http_server(args: &[&str]) -> (tokio::process::Child, String) {
    let mut all = vec!["--http", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let mut child = command(&all)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("the server prints its URL")
        .unwrap()
        .expect("a line");
    let url = line
        .strip_prefix("MCP endpoint: ")
        .expect("URL line")
        .trim()
        .to_owned();
    assert!(
        url.starts_with("http://127.0.0.1:") && url.ends_with("/mcp"),
        "{url}"
    );
    (child, url)
}

#[tokio::test]
async fn http_transport_lists_and_calls() {
    let (mut child, url) = http_server(&[]).await;
    let transport = StreamableHttpClientTransport::from_uri(url.clone());
    let c = tokio::time::timeout(Duration::from_secs(20), ().serve(transport))
        .await
        .unwrap()
        .unwrap();
    let tools = c.peer().list_all_tools().await.unwrap();
    assert_eq!(tools.len(), 7);
    let v = ok(call(
        &c,
        "check_stock",
        json!({"product_id": "p009", "colour": "white", "size": "38"}),
    )
    .await
    .unwrap());
    assert_eq!(v["variants"][0]["status"], "sold out");
    let v = ok(call(&c, "search_products", json!({"query": "scarf"}))
        .await
        .unwrap());
    assert_eq!(v["results"][0]["id"], "p011");
    tool_error(
        call(&c, "get_product", json!({"product_id": "p999"}))
            .await
            .unwrap(),
        "Unknown product",
    );
    c.cancel().await.unwrap();

    // Anything but /mcp is a 404.
    let other = url.replace("/mcp", "/other");
    let status = raw_http_get_status(&other).await;
    assert_eq!(status, 404);
    child.kill().await.unwrap();
}

/// A bare HTTP/1.1 GET, to avoid a dev-dependency on an HTTP client.
async fn raw_http_get_status(url: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").unwrap();
    let (authority, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = tokio::net::TcpStream::connect(authority).await.unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf);
    head.split_whitespace().nth(1).unwrap().parse().unwrap()
}
