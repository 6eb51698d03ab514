//! MCP client on the official Rust SDK (rmcp): stdio child processes and Streamable HTTP.
//!
//! * [`McpClient`]: one connected server. `tools/list` ([`McpClient::list_tools`]) and
//!   `tools/call` ([`McpClient::call_tool`]) with a per-call timeout; a call that runs out of time
//!   is abandoned, which makes rmcp send `notifications/cancelled` for it, and is reported as
//!   [`McpError::Timeout`]; the connection stays usable.
//! * Tool results with `isError: true` come back as `Ok(ToolOutput { is_error: true, .. })`: they
//!   are answers for the model to read, not failures of the agent.
//! * A server that dies (mid-call or between calls) is reported as [`McpError::ServerDied`], with
//!   the last lines it wrote on stderr; it never takes the agent process down.
//! * [`McpPool`]: several servers, their tools gathered, calls routed by server or by tool name.
//!
//! A server spec is either a command line for a stdio server (`"nextn-commerce-mcp --data x.json"`;
//! single/double quotes and backslashes group words as in a shell, no other shell syntax) or a
//! Streamable HTTP endpoint (`"http://127.0.0.1:8931/mcp"`). [`McpPool::connect_all`] also takes
//! `"name=spec"` to name a server.

use std::{
    collections::VecDeque,
    path::Path,
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use rmcp::{
    RoleClient, ServiceExt,
    model::{
        CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, ContentBlock,
        Implementation, ResourceContents,
    },
    service::{RunningService, ServiceError},
    transport::{StreamableHttpClientTransport, TokioChildProcess},
};
use serde::Serialize;
use serde_json::Value;
use tokio::io::AsyncBufReadExt;

/// The per-call timeout the issue asks for.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long [`McpClient::connect`] waits for the process to start and the handshake to finish.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `tools/list` may take.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(10);
/// How many of a stdio server's last stderr lines are kept for error reports.
const STDERR_TAIL_LINES: usize = 20;

/// One tool offered by one server.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolSpec {
    /// The name of the server offering it (see [`McpClient::server_name`]).
    pub server: String,
    pub name: String,
    pub description: String,
    /// The tool's JSON Schema for its arguments (an object schema).
    pub input_schema: Value,
}

/// What a tool call returned.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolOutput {
    /// The text content blocks, joined by newlines (non-text blocks appear as short `[...]`
    /// placeholders; a result with only structured content shows it as JSON).
    pub text: String,
    /// The server's `isError`: the tool ran and failed (unknown product, bad argument...). The
    /// text says why; show it to the model.
    pub is_error: bool,
    /// `structuredContent`, when the server sent it.
    pub structured: Option<Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error("cannot connect to MCP server '{server}': {reason}")]
    Connect { server: String, reason: String },
    #[error(
        "MCP server '{server}': tool '{tool}' did not answer within {after_ms} ms (call cancelled)"
    )]
    Timeout {
        server: String,
        tool: String,
        after_ms: u64,
    },
    #[error("MCP server '{server}' is gone: {reason}")]
    ServerDied { server: String, reason: String },
    #[error("MCP server '{server}': protocol error: {reason}")]
    Protocol { server: String, reason: String },
    #[error("unknown tool '{name}'")]
    UnknownTool { name: String },
    #[error("unknown MCP server '{name}'")]
    UnknownServer { name: String },
}

/// The last lines a stdio server wrote on stderr, kept for error reports.
#[derive(Default)]
struct StderrTail {
    lines: Mutex<VecDeque<String>>,
    closed: tokio::sync::watch::Sender<bool>,
}

impl StderrTail {
    fn push(&self, line: String) {
        // Keep messages, not backtrace frames ("  12: symbol", "      at file:line").
        let t = line.trim_start();
        let frame = t.starts_with("at ")
            || t.split_once(':')
                .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        if frame {
            return;
        }
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if lines.len() == STDERR_TAIL_LINES {
            lines.pop_front();
        }
        lines.push_back(line);
    }

    fn snapshot(&self) -> Vec<String> {
        self.lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Wait (briefly) for the stream to end, so a dying server's last words are in.
    async fn settle(&self, wait: Duration) {
        let mut rx = self.closed.subscribe();
        let _ = tokio::time::timeout(wait, rx.wait_for(|closed| *closed)).await;
    }
}

enum Kind {
    Stdio { stderr: Arc<StderrTail> },
    Http,
}

/// One connected MCP server.
pub struct McpClient {
    name: String,
    spec: String,
    kind: Kind,
    service: RunningService<RoleClient, ClientConfig>,
    /// Set once the server has been seen gone.
    dead: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for McpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpClient")
            .field("name", &self.name)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

fn client_config() -> ClientConfig {
    ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("nextn-agent", env!("CARGO_PKG_VERSION")),
    )
}

/// True when `spec` names a Streamable HTTP endpoint rather than a command.
pub fn is_http_spec(spec: &str) -> bool {
    let s = spec.trim_start();
    s.starts_with("http://") || s.starts_with("https://")
}

/// Split a command line into words: whitespace separates, single quotes keep everything,
/// double quotes keep everything but `\"` and `\\`, a backslash outside quotes escapes the next
/// character.
pub fn split_command(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => cur.push(c),
                        None => return Err(format!("unclosed single quote in `{line}`")),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\')) => cur.push(c),
                            Some(c) => {
                                cur.push('\\');
                                cur.push(c);
                            }
                            None => return Err(format!("unclosed double quote in `{line}`")),
                        },
                        Some(c) => cur.push(c),
                        None => return Err(format!("unclosed double quote in `{line}`")),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(c) => cur.push(c),
                    None => return Err(format!("trailing backslash in `{line}`")),
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

fn program_label(program: &str) -> String {
    Path::new(program)
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| program.to_owned())
}

/// The text the model should see for a result's content blocks.
fn content_text(result: &CallToolResult) -> String {
    let parts: Vec<String> = result
        .content
        .iter()
        .map(|block| match block {
            ContentBlock::Text(t) => t.text.clone(),
            ContentBlock::Image(i) => format!("[{} image]", i.mime_type),
            ContentBlock::Audio(a) => format!("[{} audio]", a.mime_type),
            ContentBlock::Resource(r) => match &r.resource {
                ResourceContents::TextResourceContents { text, .. } => text.clone(),
                ResourceContents::BlobResourceContents { uri, .. } => {
                    format!("[binary resource {uri}]")
                }
                #[allow(unreachable_patterns)]
                _ => "[resource]".to_owned(),
            },
            ContentBlock::ResourceLink(l) => format!("[resource link: {} ({})]", l.name, l.uri),
            #[allow(unreachable_patterns)]
            _ => "[unsupported content]".to_owned(),
        })
        .collect();
    if parts.is_empty()
        && let Some(v) = &result.structured_content
    {
        return v.to_string();
    }
    parts.join("\n")
}

impl McpClient {
    /// Connect to a server: a command line (stdio child process) or an `http(s)://` Streamable
    /// HTTP endpoint. `name` defaults to the name the server reports, else the program / URL.
    /// Waits at most [`DEFAULT_CONNECT_TIMEOUT`] for the handshake.
    pub async fn connect(spec: &str, name: Option<String>) -> Result<Self, McpError> {
        Self::connect_with_timeout(spec, name, DEFAULT_CONNECT_TIMEOUT).await
    }

    /// [`McpClient::connect`] with an explicit handshake deadline (e.g. generous for `npx`, which
    /// may download its package first).
    pub async fn connect_with_timeout(
        spec: &str,
        name: Option<String>,
        timeout: Duration,
    ) -> Result<Self, McpError> {
        let spec = spec.trim();
        if is_http_spec(spec) {
            let label = name.clone().unwrap_or_else(|| spec.to_owned());
            let transport = StreamableHttpClientTransport::from_uri(spec.to_owned());
            let service =
                match tokio::time::timeout(timeout, client_config().serve(transport)).await {
                    Ok(Ok(service)) => service,
                    Ok(Err(e)) => {
                        return Err(McpError::Connect {
                            server: label,
                            reason: e.to_string(),
                        });
                    }
                    Err(_) => {
                        return Err(McpError::Connect {
                            server: label,
                            reason: format!("no MCP handshake within {} ms", timeout.as_millis()),
                        });
                    }
                };
            return Ok(Self::finish(service, spec, name, label, Kind::Http));
        }

        let words = split_command(spec).map_err(|reason| McpError::Connect {
            server: name.clone().unwrap_or_else(|| spec.to_owned()),
            reason,
        })?;
        let Some((program, args)) = words.split_first() else {
            return Err(McpError::Connect {
                server: name.unwrap_or_default(),
                reason: "empty server command".into(),
            });
        };
        let label = name.clone().unwrap_or_else(|| program_label(program));
        let mut command = tokio::process::Command::new(program);
        command.args(args);
        let (transport, stderr) = TokioChildProcess::builder(command)
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| McpError::Connect {
                server: label.clone(),
                reason: format!("cannot start `{program}`: {e}"),
            })?;
        let tail = Arc::new(StderrTail::default());
        if let Some(stderr) = stderr {
            let tail = tail.clone();
            let who = label.clone();
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::debug!(target: "nextn_agent::mcp::stderr", server = %who, "{line}");
                    tail.push(line);
                }
                tail.closed.send_replace(true);
            });
        } else {
            tail.closed.send_replace(true);
        }
        let handshake = tokio::time::timeout(timeout, client_config().serve(transport)).await;
        let service = match handshake {
            Ok(Ok(service)) => service,
            Ok(Err(e)) => {
                tail.settle(Duration::from_millis(300)).await;
                return Err(McpError::Connect {
                    server: label,
                    reason: with_stderr(format!("MCP handshake failed: {e}"), &tail.snapshot()),
                });
            }
            Err(_) => {
                return Err(McpError::Connect {
                    server: label,
                    reason: with_stderr(
                        format!("no MCP handshake within {} ms", timeout.as_millis()),
                        &tail.snapshot(),
                    ),
                });
            }
        };
        Ok(Self::finish(
            service,
            spec,
            name,
            label,
            Kind::Stdio { stderr: tail },
        ))
    }

    fn finish(
        service: RunningService<RoleClient, ClientConfig>,
        spec: &str,
        name: Option<String>,
        label: String,
        kind: Kind,
    ) -> Self {
        let reported = service
            .peer()
            .peer_info()
            .and_then(|i| i.server_info.as_ref().map(|s| s.name.clone()));
        let name = name
            .or(reported.filter(|n| !n.trim().is_empty()))
            .unwrap_or(label);
        tracing::info!(server = %name, spec, "MCP server connected");
        Self {
            name,
            spec: spec.to_owned(),
            kind,
            service,
            dead: Default::default(),
        }
    }

    /// The name this client goes by in [`ToolSpec::server`] and errors.
    pub fn server_name(&self) -> &str {
        &self.name
    }

    /// The spec it was connected with.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// False once the connection has ended (the server exited, or the HTTP session broke).
    pub fn is_alive(&self) -> bool {
        !(self.dead.load(std::sync::atomic::Ordering::Relaxed)
            || self.service.is_closed()
            || self.service.peer().is_transport_closed())
    }

    /// The last lines a stdio server wrote on stderr (empty for HTTP servers).
    pub fn stderr_tail(&self) -> Vec<String> {
        match &self.kind {
            Kind::Stdio { stderr } => stderr.snapshot(),
            Kind::Http => Vec::new(),
        }
    }

    async fn died(&self, what: String) -> McpError {
        let reason = match &self.kind {
            Kind::Stdio { stderr } => {
                stderr.settle(Duration::from_millis(500)).await;
                with_stderr(what, &stderr.snapshot())
            }
            Kind::Http => what,
        };
        tracing::warn!(server = %self.name, %reason, "MCP server died");
        McpError::ServerDied {
            server: self.name.clone(),
            reason,
        }
    }

    async fn map_error(&self, e: ServiceError, tool: Option<&str>) -> McpError {
        match e {
            ServiceError::McpError(data) => McpError::Protocol {
                server: self.name.clone(),
                reason: format!("{} (code {})", data.message, data.code.0),
            },
            ServiceError::Timeout { timeout } => McpError::Timeout {
                server: self.name.clone(),
                tool: tool.unwrap_or("tools/list").to_owned(),
                after_ms: timeout.as_millis() as u64,
            },
            ServiceError::TransportClosed => {
                self.dead.store(true, std::sync::atomic::Ordering::Relaxed);
                self.died("the connection closed (the server exited?)".into())
                    .await
            }
            ServiceError::TransportSend(e) => {
                self.died(format!("cannot reach the server: {e}")).await
            }
            ServiceError::Cancelled { reason } => {
                self.dead.store(true, std::sync::atomic::Ordering::Relaxed);
                self.died(format!(
                    "the connection was cancelled: {}",
                    reason.unwrap_or_default()
                ))
                .await
            }
            other => McpError::Protocol {
                server: self.name.clone(),
                reason: other.to_string(),
            },
        }
    }

    /// `tools/list`, all pages.
    pub async fn list_tools(&self) -> Result<Vec<ToolSpec>, McpError> {
        if !self.is_alive() {
            return Err(self.died("the connection is closed".into()).await);
        }
        let tools =
            match tokio::time::timeout(LIST_TIMEOUT, self.service.peer().list_all_tools()).await {
                Err(_) => {
                    return Err(McpError::Timeout {
                        server: self.name.clone(),
                        tool: "tools/list".into(),
                        after_ms: LIST_TIMEOUT.as_millis() as u64,
                    });
                }
                Ok(Err(e)) => return Err(self.map_error(e, None).await),
                Ok(Ok(tools)) => tools,
            };
        Ok(tools
            .into_iter()
            .map(|t| ToolSpec {
                server: self.name.clone(),
                name: t.name.to_string(),
                description: t.description.map(|d| d.to_string()).unwrap_or_default(),
                input_schema: Value::Object((*t.input_schema).clone()),
            })
            .collect())
    }

    /// `tools/call`. `arguments` must be a JSON object (or null for none). After `timeout` the
    /// request is abandoned (rmcp sends `notifications/cancelled`) and [`McpError::Timeout`]
    /// returned; the client stays usable. A tool-level failure is `Ok` with `is_error: true`.
    pub async fn call_tool(
        &self,
        name: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<ToolOutput, McpError> {
        let mut params = CallToolRequestParams::new(name.to_owned());
        match arguments {
            Value::Object(map) => params = params.with_arguments(map),
            Value::Null => {}
            other => {
                return Err(McpError::Protocol {
                    server: self.name.clone(),
                    reason: format!("arguments for '{name}' must be a JSON object, not {other}"),
                });
            }
        }
        if !self.is_alive() {
            return Err(self.died("the connection is closed".into()).await);
        }
        let started = std::time::Instant::now();
        match tokio::time::timeout(timeout, self.service.peer().call_tool(params)).await {
            Err(_) => {
                tracing::warn!(server = %self.name, tool = name, ?timeout, "MCP call timed out; cancelled");
                Err(McpError::Timeout {
                    server: self.name.clone(),
                    tool: name.to_owned(),
                    after_ms: timeout.as_millis() as u64,
                })
            }
            Ok(Err(e)) => Err(self.map_error(e, Some(name)).await),
            Ok(Ok(result)) => {
                tracing::debug!(server = %self.name, tool = name, elapsed = ?started.elapsed(), is_error = ?result.is_error, "MCP call done");
                Ok(ToolOutput {
                    text: content_text(&result),
                    is_error: result.is_error.unwrap_or(false),
                    structured: result.structured_content,
                })
            }
        }
    }

    /// End the session: a stdio server gets its stdin closed (then SIGTERM, then kill, if it
    /// lingers); an HTTP session is deleted. Dropping a client without closing it also stops a
    /// stdio server (it is killed).
    pub async fn close(self) {
        let name = self.name.clone();
        if tokio::time::timeout(Duration::from_secs(10), self.service.cancel())
            .await
            .is_err()
        {
            tracing::warn!(server = %name, "MCP server did not shut down in time");
        }
    }
}

fn with_stderr(what: String, lines: &[String]) -> String {
    let lines: Vec<&str> = lines
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty())
        .collect();
    if lines.is_empty() {
        return what;
    }
    let tail = &lines[lines.len().saturating_sub(5)..];
    format!("{what}; its last stderr lines: {}", tail.join(" | "))
}

/// A server [`McpPool::connect_each`] could not add.
#[derive(Debug)]
pub struct ConnectFailure {
    pub spec: String,
    pub error: McpError,
}

/// Several connected servers.
#[derive(Debug, Default)]
pub struct McpPool {
    clients: Vec<McpClient>,
    tools: Vec<ToolSpec>,
}

/// Split `"name=spec"` into its parts; a spec without a leading `name=` (name: letters, digits,
/// `-`, `_`, `.`) is returned whole.
pub fn parse_named_spec(spec: &str) -> (Option<String>, &str) {
    let s = spec.trim();
    if let Some((name, rest)) = s.split_once('=')
        && !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !rest.trim().is_empty()
    {
        return (Some(name.to_owned()), rest.trim());
    }
    (None, s)
}

impl McpPool {
    pub fn new() -> Self {
        Self::default()
    }

    /// Connect every spec (`"spec"` or `"name=spec"`, see the module docs) and list their tools.
    /// Fails on the first server that cannot be reached (the others are shut down).
    pub async fn connect_all<I, S>(specs: I) -> Result<Self, McpError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut pool = Self::new();
        for spec in specs {
            let (name, target) = parse_named_spec(spec.as_ref());
            let client = match McpClient::connect(target, name).await {
                Ok(c) => c,
                Err(e) => {
                    pool.close().await;
                    return Err(e);
                }
            };
            if let Err(e) = pool.add(client).await {
                pool.close().await;
                return Err(e);
            }
        }
        Ok(pool)
    }

    /// Connect every spec, each within `per_server` and all by `deadline`; a server that does not start,
    /// does not finish its handshake or cannot list its tools is reported in the second list and left out
    /// (the agent runs without its tools) instead of failing the whole pool.
    pub async fn connect_each<I, S>(specs: I, per_server: Duration, deadline: std::time::Instant) -> (Self, Vec<ConnectFailure>)
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut pool = Self::new();
        let mut failures = Vec::new();
        for spec in specs {
            let spec = spec.as_ref();
            let (name, target) = parse_named_spec(spec);
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let timeout = per_server.min(left);
            if timeout.is_zero() {
                let server = name.clone().unwrap_or_else(|| target.to_string());
                failures.push(ConnectFailure {
                    spec: spec.to_string(),
                    error: McpError::Connect { server, reason: "no time left in the request budget".into() },
                });
                continue;
            }
            let result = match McpClient::connect_with_timeout(target, name, timeout).await {
                Ok(client) => {
                    let server = client.name.clone();
                    match tokio::time::timeout(timeout, pool.add(client)).await {
                        Ok(r) => r,
                        Err(_) => Err(McpError::Connect { server, reason: format!("tools/list did not answer within {} ms", timeout.as_millis()) }),
                    }
                }
                Err(e) => Err(e),
            };
            if let Err(error) = result {
                failures.push(ConnectFailure { spec: spec.to_string(), error });
            }
        }
        (pool, failures)
    }

    /// Add a connected client (renamed `name-2`, `name-3`... if its name is taken) and list its
    /// tools.
    pub async fn add(&mut self, mut client: McpClient) -> Result<(), McpError> {
        if self.client(&client.name).is_some() {
            let base = client.name.clone();
            let mut n = 2;
            while self.client(&format!("{base}-{n}")).is_some() {
                n += 1;
            }
            client.name = format!("{base}-{n}");
        }
        let tools = client.list_tools().await?;
        self.tools.extend(tools);
        self.clients.push(client);
        Ok(())
    }

    /// Every tool of every server, in connection order.
    pub fn tools(&self) -> &[ToolSpec] {
        &self.tools
    }

    /// Every tool as the harness types it (what `nextn_harness::perturb` renames and redescribes).
    pub fn harness_tool_specs(&self) -> Vec<nextn_harness::ToolSpec> {
        self.tools
            .iter()
            .map(|t| nextn_harness::ToolSpec {
                server: t.server.clone(),
                name: t.name.clone(),
                description: t.description.clone(),
                input_schema: t.input_schema.clone(),
            })
            .collect()
    }

    pub fn servers(&self) -> impl Iterator<Item = &str> {
        self.clients.iter().map(|c| c.server_name())
    }

    pub fn client(&self, server: &str) -> Option<&McpClient> {
        self.clients.iter().find(|c| c.name == server)
    }

    /// The first server's tool of that name.
    pub fn find_tool(&self, tool: &str) -> Option<&ToolSpec> {
        self.tools.iter().find(|t| t.name == tool)
    }

    /// Call `tool` on `server`.
    pub async fn call(
        &self,
        server: &str,
        tool: &str,
        args: Value,
        timeout: Duration,
    ) -> Result<ToolOutput, McpError> {
        let client = self.client(server).ok_or_else(|| McpError::UnknownServer {
            name: server.to_owned(),
        })?;
        if !self
            .tools
            .iter()
            .any(|t| t.server == server && t.name == tool)
        {
            return Err(McpError::UnknownTool {
                name: tool.to_owned(),
            });
        }
        client.call_tool(tool, args, timeout).await
    }

    /// Call `tool` on whichever server offers it (the first, if several do).
    pub async fn call_tool(
        &self,
        tool: &str,
        args: Value,
        timeout: Duration,
    ) -> Result<ToolOutput, McpError> {
        let spec = self.find_tool(tool).ok_or_else(|| McpError::UnknownTool {
            name: tool.to_owned(),
        })?;
        let server = spec.server.clone();
        self.call(&server, tool, args, timeout).await
    }

    /// Close every server.
    pub async fn close(self) {
        for client in self.clients {
            client.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_split_like_a_shell() {
        assert_eq!(split_command("a b  c").unwrap(), ["a", "b", "c"]);
        assert_eq!(
            split_command(r#"srv --data "my file.json" 'x y' z\ w"#).unwrap(),
            ["srv", "--data", "my file.json", "x y", "z w"]
        );
        assert_eq!(split_command(r#""a\"b" ''"#).unwrap(), [r#"a"b"#, ""]);
        assert!(split_command("'open").is_err());
        assert!(split_command("").unwrap().is_empty());
    }

    #[test]
    fn named_specs() {
        assert_eq!(
            parse_named_spec("shop=srv --x"),
            (Some("shop".into()), "srv --x")
        );
        assert_eq!(parse_named_spec("srv --opt=1"), (None, "srv --opt=1"));
        assert_eq!(
            parse_named_spec("http://h/mcp?a=b"),
            (None, "http://h/mcp?a=b")
        );
        assert_eq!(
            parse_named_spec("web=http://127.0.0.1:1/mcp"),
            (Some("web".into()), "http://127.0.0.1:1/mcp")
        );
        assert!(is_http_spec(" https://x/mcp") && !is_http_spec("httpd --serve"));
    }
}
