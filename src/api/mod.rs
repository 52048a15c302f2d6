//! The HTTP API: `POST /v1/systemone` (JSON, multipart, zstd/gzip bodies; imajev and TypeSafe
//! contracts), `GET /v1/models`, `/healthz`, `/metrics`, `/openapi.json`.
//!
//! * [`parse`] — the wire rules, pure: a body → a checked [`crate::decision::DecisionRequest`];
//! * [`body`] — media types, `Content-Encoding` with a decoded-size cap, multipart;
//! * [`error`] — every refusal and its JSON shape (422 `detail[]`, else `{error_type, message}`);
//! * [`schema`] — the wire types behind `schemas/*.json` and the OpenAPI document;
//! * [`server`] — actix-web routes, auth, request ids, metrics, readiness, graceful shutdown;
//! * [`playground`] — the page at `/` for trying questions in a browser (assets compiled in).
//!
//! The API knows nothing about tensors: it hands a [`crate::decision::Plan`] to the worker and
//! turns the logits it gets back into the response with the [`crate::decision::Decider`].

pub mod body;
pub mod error;
pub mod metrics;
pub mod parse;
pub mod playground;
pub mod schema;
pub mod server;

pub use error::{ApiError, Loc};
pub use parse::{parse_request_json, ParseContext};
pub use server::{build_app_state, plan_error, serve, AppState, ServerConfig};

use crate::decision::{Decider, Timings};
use crate::worker::{BatchLimits, DecisionEngine};

/// Answers one JSON request body without HTTP (the `decide` subcommand): the same rules, limits
/// and refusals as `POST /v1/systemone`, run on `engine` directly (no queue, no deadline).
pub fn decide_json(
    body: &[u8],
    decider: &Decider,
    engine: &dyn DecisionEngine,
    ctx: &ParseContext,
    limits: BatchLimits,
) -> Result<serde_json::Value, ApiError> {
    let started = std::time::Instant::now();
    let req = parse_request_json(body, ctx)?;
    let plan = decider.plan(&req).map_err(plan_error)?;
    let images: Vec<&crate::image::PatchedImage> = req.images.iter().map(|i| &i.patched).collect();
    let out = engine
        .run(&plan, &images, limits, &|| Ok(()))
        .map_err(|e| ApiError::internal(format!("the engine failed: {e:#}")))?;
    let t = Timings {
        vision_ms: out.vision_ms,
        prefill_ms: out.prefill_ms,
        questions_ms: out.questions_ms,
        total_ms: started.elapsed().as_secs_f64() * 1e3,
    };
    Ok(decider.respond(&req, &plan, &out.logits, t))
}

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
