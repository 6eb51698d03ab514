//! OpenAI-style error replies: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to the client. `param` names the request field at fault (OpenAI's `param`).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `rate_limit_error`, `server_error`.
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, sent as `Retry-After` (429 only).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400: the request is wrong; `param` names the field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: Some("invalid_value"),
            retry_after: None,
        }
    }

    /// 400 about the body as a whole (not JSON, not an object).
    pub fn bad_body(message: impl Into<String>) -> Self {
        ApiError { param: None, code: Some("invalid_json"), ..Self::invalid("", message) }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 404 for a `model` this server does not serve.
    pub fn unknown_model(given: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
            ..Self::invalid("model", format!("the model `{given}` does not exist; this server serves `{served}`"))
        }
    }

    /// 401: missing or wrong `Authorization: Bearer KEY`.
    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or incorrect API key: send `Authorization: Bearer KEY` with the key the server was \
                      started with (--api-key)"
                .into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// 429: running + waiting requests are at `--max-running + --max-queue`.
    pub fn overloaded(limit: usize) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!("the server is at its limit of {limit} requests (running + queued); retry later"),
            kind: "rate_limit_error",
            param: None,
            code: Some("rate_limit_exceeded"),
            retry_after: Some(1),
        }
    }

    /// 500 / 503: the engine failed or stopped.
    pub fn server(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind: "server_error", param: None, code: None, retry_after: None }
    }

    /// The `{"error": {...}}` object (also sent inside a stream when a request fails after it started).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after
            && let Ok(v) = HeaderValue::from_str(&s.to_string())
        {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
        resp
    }
}
