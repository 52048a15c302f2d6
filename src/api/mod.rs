//! The HTTP API: `POST /v1/systemone` (JSON, multipart, zstd/gzip bodies; imajev and TypeSafe
//! contracts), `GET /v1/models`, `/healthz`, `/metrics`, `/openapi.json`.
//!
//! * [`parse`] — the wire rules, pure: a body → a checked [`crate::decision::DecisionRequest`]
//!   and its images' pixels;
//! * [`pipeline`] — the one request pipeline, parse → plan → engine → response, with the engine
//!   call passed in (the worker's queue for HTTP, a loaded engine for `decide` and the tests);
//! * [`body`] — media types, `Content-Encoding` with a decoded-size cap, multipart;
//! * [`budget`] — the process-wide budget of request memory in flight (413 / 529);
//! * [`error`] — every refusal and its JSON shape (422 `detail[]`, else `{error_type, message}`);
//! * [`schema`] — the wire types behind `schemas/*.json` and the OpenAPI document;
//! * [`conn`] — the connection layer: connection cap, request-head checks, head and body timeouts;
//! * [`server`] — actix-web routes, auth, request ids, metrics, readiness, graceful shutdown;
//! * [`playground`] — the page at `/` for trying questions in a browser (assets compiled in).
//!
//! The API knows nothing about tensors: it hands a [`crate::decision::Plan`] and the pixels to
//! the engine call and turns the logits it gets back into the response with the
//! [`crate::decision::Decider`].

pub mod body;
pub mod budget;
pub mod conn;
pub mod error;
pub mod metrics;
pub mod parse;
pub mod pipeline;
pub mod playground;
pub mod schema;
pub mod server;

pub use error::{ApiError, Loc};
pub use parse::{parse_request, ParseContext, RequestBody};
pub use pipeline::{decide, decide_direct, plan_error, run_engine, Decided, EngineCall};
pub use server::{build_app_state, run_http_server, AppState, ServerConfig};
