//! The HTTP API: `POST /v1/systemone` (JSON, multipart, zstd/gzip bodies; imajev and TypeSafe
//! contracts), `GET /v1/models`, `/healthz`, `/metrics`, `/openapi.json`.
//!
//! * [`parse`] — the wire rules, pure: a body → a checked [`crate::decision::DecisionRequest`]
//!   and its images' pixels;
//! * [`pipeline`] — the one request pipeline, parse → plan → engine → response, with the engine
//!   call passed in (the worker's queue for HTTP, a loaded engine for `decide` and the tests);
//! * [`body`] — media types, `Content-Encoding` with a decoded-size cap, multipart;
//! * [`error`] — every refusal and its JSON shape (422 `detail[]`, else `{error_type, message}`);
//! * [`schema`] — the wire types behind `schemas/*.json` and the OpenAPI document;
//! * [`server`] — actix-web routes, auth, request ids, metrics, readiness, graceful shutdown.
//!
//! The API knows nothing about tensors: it hands a [`crate::decision::Plan`] and the pixels to
//! the engine call and turns the logits it gets back into the response with the
//! [`crate::decision::Decider`].

pub mod body;
pub mod error;
pub mod metrics;
pub mod parse;
pub mod pipeline;
pub mod schema;
pub mod server;

pub use error::{ApiError, Loc};
pub use parse::{parse_request, ParseContext, RequestBody};
pub use pipeline::{decide, decide_direct, plan_error, run_engine, Decided, EngineCall};
pub use server::{build_app_state, serve, AppState, ServerConfig};

/// Resolves on SIGINT or SIGTERM (what [`run`] stops on).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!("cannot listen for SIGTERM/SIGINT ({e}); stop the server with SIGKILL");
            return std::future::pending().await;
        }
    };
    let which = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!("{which}: stopping; accepted requests finish first");
}

/// Binds `cfg.host:cfg.port` and serves until SIGINT/SIGTERM; returns once accepted requests
/// have finished. Must run inside an actix system (see [`run_blocking`]). Afterwards drop every
/// other clone of the worker handle and join the engine thread.
pub async fn run(cfg: ServerConfig, app: AppState) -> anyhow::Result<()> {
    use anyhow::Context;
    let listener = std::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .with_context(|| format!("binding {}:{}", cfg.host, cfg.port))?;
    serve(listener, cfg, app, shutdown_signal()).await
}

/// [`run`] on a new actix system, blocking the calling thread.
pub fn run_blocking(cfg: ServerConfig, app: AppState) -> anyhow::Result<()> {
    actix_web::rt::System::new().block_on(run(cfg, app))
}
