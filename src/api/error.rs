//! Every refusal the API can give, and the one JSON shape each status has.
//!
//! * 422 (the body was understood but is wrong): FastAPI's validation shape, which TypeSafe uses
//!   and jevcompat checks (`errors.validation-shape`), plus imajev's top-level `error` code:
//!   `{"error": "invalid_request" | "bad_json" | "bad_image" | "bad_request",
//!     "detail": [{"loc": ["body", …], "msg": "…what to fix…", "type": "…"}]}`.
//! * everything else: TypeSafe's non-validation shape, again with the code on top:
//!   `{"error": CODE, "detail": {"error_type": CODE, "message": "…"}}`.
//!
//! A bad request never gets a 5xx: 500 `internal_error` means a bug (or a broken model folder).

use actix_web::http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::{json, Value};
use std::fmt;
use std::time::Duration;

/// One step of a `loc` path: an object key or an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocPart {
    Key(String),
    Index(usize),
}

impl From<&str> for LocPart {
    fn from(s: &str) -> Self {
        LocPart::Key(s.to_string())
    }
}
impl From<String> for LocPart {
    fn from(s: String) -> Self {
        LocPart::Key(s)
    }
}
impl From<&String> for LocPart {
    fn from(s: &String) -> Self {
        LocPart::Key(s.clone())
    }
}
impl From<usize> for LocPart {
    fn from(i: usize) -> Self {
        LocPart::Index(i)
    }
}

/// Where in the request body something is wrong; always starts at `"body"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loc(pub Vec<LocPart>);

impl Loc {
    pub fn body() -> Self {
        Loc(vec![LocPart::Key("body".into())])
    }
    /// This path extended by one key or index.
    pub fn at(&self, part: impl Into<LocPart>) -> Self {
        let mut v = self.0.clone();
        v.push(part.into());
        Loc(v)
    }
    fn to_json(&self) -> Value {
        Value::Array(
            self.0
                .iter()
                .map(|p| match p {
                    LocPart::Key(k) => json!(k),
                    LocPart::Index(i) => json!(i),
                })
                .collect(),
        )
    }
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            match p {
                LocPart::Key(k) if i == 0 => write!(f, "{k}")?,
                LocPart::Key(k) => write!(f, ".{k}")?,
                LocPart::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// One entry of a 422 `detail` list.
#[derive(Debug, Clone, PartialEq)]
pub struct Violation {
    pub loc: Loc,
    pub msg: String,
    /// A short machine-readable kind (`missing`, `type_error`, `value_error`, `too_long`, …).
    pub kind: &'static str,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Detail {
    /// 422: what is wrong, where.
    Validation(Vec<Violation>),
    /// Every other status.
    Message(String),
}

/// An HTTP refusal: status, imajev-style `error` code, and the detail.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub code: &'static str,
    pub detail: Detail,
    /// Sent as `Retry-After` (whole seconds, rounded up) and `retry-after-ms`.
    pub retry_after: Option<Duration>,
}

impl ApiError {
    fn validation(code: &'static str, loc: Loc, msg: impl Into<String>, kind: &'static str) -> Self {
        ApiError {
            status: 422,
            code,
            detail: Detail::Validation(vec![Violation { loc, msg: msg.into(), kind }]),
            retry_after: None,
        }
    }

    /// 422 `invalid_request`: the request breaks a rule of the contract.
    pub fn invalid(loc: Loc, msg: impl Into<String>, kind: &'static str) -> Self {
        Self::validation("invalid_request", loc, msg, kind)
    }

    /// 422 `bad_json`: the body (or the `request` part) is not JSON.
    pub fn bad_json(loc: Loc, msg: impl Into<String>) -> Self {
        Self::validation("bad_json", loc, msg, "json_invalid")
    }

    /// 422 `bad_image`: an image is missing, malformed or undecodable.
    pub fn bad_image(loc: Loc, msg: impl Into<String>) -> Self {
        Self::validation("bad_image", loc, msg, "image_invalid")
    }

    /// 422 `bad_request`: the body's framing is wrong (not an object, bad multipart, bad encoding).
    pub fn bad_request(loc: Loc, msg: impl Into<String>, kind: &'static str) -> Self {
        Self::validation("bad_request", loc, msg, kind)
    }

    /// Any non-422 refusal.
    pub fn message(status: u16, code: &'static str, msg: impl Into<String>) -> Self {
        ApiError { status, code, detail: Detail::Message(msg.into()), retry_after: None }
    }

    pub fn with_retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    pub fn not_found(msg: impl Into<String>) -> Self {
        Self::message(404, "not_found", msg)
    }

    pub fn internal(msg: impl Into<String>) -> Self {
        Self::message(500, "internal_error", msg)
    }

    /// 413 `request_too_large`.
    pub fn too_large(msg: impl Into<String>) -> Self {
        Self::message(413, "request_too_large", msg)
    }

    /// 415 `unsupported_media_type`.
    pub fn unsupported_media(msg: impl Into<String>) -> Self {
        Self::message(415, "unsupported_media_type", msg)
    }

    /// The first message, for logs and the CLI.
    pub fn summary(&self) -> String {
        match &self.detail {
            Detail::Message(m) => m.clone(),
            Detail::Validation(v) => {
                v.iter().map(|x| format!("{}: {}", x.loc, x.msg)).collect::<Vec<_>>().join("; ")
            }
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        match &self.detail {
            Detail::Validation(items) => json!({
                "error": self.code,
                "detail": items.iter().map(|v| json!({"loc": v.loc.to_json(), "msg": v.msg, "type": v.kind})).collect::<Vec<_>>(),
            }),
            Detail::Message(m) => json!({
                "error": self.code,
                "detail": {"error_type": self.code, "message": m},
            }),
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status, self.code, self.summary())
    }
}

impl std::error::Error for ApiError {}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn error_response(&self) -> HttpResponse {
        let mut b = HttpResponse::build(self.status_code());
        b.insert_header((CONTENT_TYPE, HeaderValue::from_static("application/json")));
        if let Some(d) = self.retry_after {
            let secs = d.as_millis().div_ceil(1000).max(1);
            b.insert_header((RETRY_AFTER, secs.to_string()));
            b.insert_header(("retry-after-ms", d.as_millis().max(1).to_string()));
        }
        if self.status == 401 {
            b.insert_header((WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")));
        }
        b.body(serde_json::to_vec(&self.body()).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let e = ApiError::invalid(Loc::body().at("questions").at("q").at(3usize), "fix it", "value_error");
        assert_eq!(
            e.body(),
            json!({"error": "invalid_request", "detail": [{"loc": ["body", "questions", "q", 3], "msg": "fix it", "type": "value_error"}]})
        );
        assert_eq!(e.summary(), "body.questions.q[3]: fix it");
        let e = ApiError::message(529, "overloaded", "busy");
        assert_eq!(
            e.body(),
            json!({"error": "overloaded", "detail": {"error_type": "overloaded", "message": "busy"}})
        );
    }
}
