//! Streamable HTTP on a loopback socket: rmcp's `StreamableHttpService` (a tower service) served
//! by hyper at `/mcp`.

use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rmcp::transport::streamable_http_server::{
    StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::server::CommerceServer;

/// The path the MCP endpoint is served on.
pub const MCP_PATH: &str = "/mcp";

/// A running HTTP server.
pub struct HttpServer {
    pub addr: SocketAddr,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl HttpServer {
    /// `http://ADDR/mcp`.
    pub fn url(&self) -> String {
        format!("http://{}{MCP_PATH}", self.addr)
    }

    /// Stop accepting connections and end every session.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }

    /// Wait until the server stops (it runs until [`HttpServer::shutdown`] or a fatal accept error).
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Bind `addr` (must be a loopback address; port 0 picks a free one) and serve `server` over
/// Streamable HTTP at `/mcp`. Each MCP session gets its own clone of the server.
pub async fn serve_http(server: CommerceServer, addr: SocketAddr) -> anyhow::Result<HttpServer> {
    anyhow::ensure!(
        addr.ip().is_loopback(),
        "--http only binds loopback addresses, not {}",
        addr.ip()
    );
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let cancel = CancellationToken::new();
    let config = StreamableHttpServerConfig::default()
        .with_cancellation_token(cancel.child_token())
        .with_allowed_hosts([
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
            "[::1]".to_owned(),
        ]);
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let stop = cancel.clone();
    let task = tokio::spawn(async move {
        loop {
            let (stream, _peer) = tokio::select! {
                _ = stop.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!("accept failed: {e}");
                        continue;
                    }
                },
            };
            let service = service.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let hyper_service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let mut service = service.clone();
                        async move {
                            if req.uri().path() != MCP_PATH {
                                let body = Full::new(Bytes::from_static(
                                    b"not found: the MCP endpoint is /mcp\n",
                                ))
                                .map_err(|never: Infallible| match never {})
                                .boxed();
                                let mut resp = hyper::Response::new(body);
                                *resp.status_mut() = hyper::StatusCode::NOT_FOUND;
                                return Ok::<_, Infallible>(resp);
                            }
                            use tower_service::Service;
                            service.call(req).await
                        }
                    },
                );
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), hyper_service);
                tokio::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => {}
                    _ = stop.cancelled() => conn.as_mut().graceful_shutdown(),
                }
            });
        }
    });
    Ok(HttpServer { addr, cancel, task })
}
