//! The one request pipeline: a body → parse → plan → engine → the response. The HTTP handler,
//! the `decide` command and the tests all answer through [`decide`]; only the engine call
//! differs: the HTTP handler submits a job to the worker's queue and awaits its reply, the others
//! run a loaded engine on their own thread ([`decide_direct`], [`run_engine`]).
//!
//! Knows nothing about HTTP: every failure is an [`ApiError`], which the caller turns into a
//! response or a message.

use super::error::{ApiError, Loc};
use super::parse::{parse_request, ParseContext, ParsedRequest, RequestBody};
use crate::decision::answer::{tallies, Tally};
use crate::decision::{Decider, DecisionRequest, Plan, PlanError, Timings};
use crate::image::PatchedImage;
use crate::worker::{BatchLimits, DecisionEngine, EngineOutput};
use serde_json::Value;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

/// Where parsing and planning (JSON, image decoding, tokenisation: milliseconds of CPU) run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseOn {
    /// The calling thread: for callers without an async runtime to keep free.
    ThisThread,
    /// The async runtime's blocking pool, so that no HTTP thread waits on it.
    BlockingPool,
}

/// What the engine runs for one request.
pub struct EngineCall {
    pub plan: Arc<Plan>,
    /// The images' pixels in prompt order, moved out of the parsed request (the answers need
    /// only what [`crate::decision::RequestImage`] keeps).
    pub images: Vec<PatchedImage>,
}

/// An answered request.
pub struct Decided {
    /// The response body.
    pub response: Value,
    pub request: DecisionRequest,
    pub plan: Arc<Plan>,
    pub output: EngineOutput,
    pub timings: Timings,
    /// What each question's answer counts for in the metrics, in request order.
    pub tallies: Vec<Tally>,
}

/// Answers one request: parses `body` under `ctx`'s rules, plans it, hands the plan and the
/// pixels to `run` and builds the response from the logits it returns. `started` is when the
/// request arrived (`usage.total_ms` counts from it).
pub async fn decide<Run, Running>(
    body: RequestBody,
    ctx: ParseContext,
    decider: Arc<Decider>,
    started: Instant,
    parse_on: ParseOn,
    run: Run,
) -> Result<Decided, ApiError>
where
    Run: FnOnce(EngineCall) -> Running,
    Running: Future<Output = Result<EngineOutput, ApiError>>,
{
    let planner = decider.clone();
    let prepare = move || -> Result<(ParsedRequest, Plan), ApiError> {
        let parsed = parse_request(body, &ctx)?;
        let plan = planner.plan(&parsed.request).map_err(plan_error)?;
        Ok((parsed, plan))
    };
    let (ParsedRequest { request, pixels }, plan) = match parse_on {
        ParseOn::ThisThread => prepare()?,
        ParseOn::BlockingPool => on_blocking_pool(prepare).await?,
    };
    tracing::debug!(
        questions = request.questions.len(),
        images = request.images.len(),
        passes = plan.pass_count(),
        tokens = plan.processed_tokens,
        "planned"
    );
    let plan = Arc::new(plan);
    let output = run(EngineCall { plan: plan.clone(), images: pixels }).await?;
    tracing::debug!(
        packed_with = output.packed_with,
        vision_ms = output.vision_ms,
        prefill_ms = output.prefill_ms,
        questions_ms = output.questions_ms,
        tokens = output.tokens,
        "engine"
    );
    let timings = Timings {
        vision_ms: output.vision_ms,
        prefill_ms: output.prefill_ms,
        questions_ms: output.questions_ms,
        total_ms: started.elapsed().as_secs_f64() * 1e3,
    };
    let outcomes = decider.outcomes(&request, &plan, &output.logits);
    let response = decider.respond_with(&request, &plan, &outcomes, timings);
    let tallies = tallies(&request, &outcomes);
    Ok(Decided { response, request, plan, output, timings, tallies })
}

/// [`decide`] for callers without an async runtime (the `decide` command, tests): everything
/// runs on this thread, `run` included, and `usage.total_ms` counts from this call. Must not be
/// called from inside an async runtime.
pub fn decide_direct(
    body: RequestBody,
    ctx: ParseContext,
    decider: Arc<Decider>,
    run: impl FnOnce(EngineCall) -> Result<EngineOutput, ApiError>,
) -> Result<Decided, ApiError> {
    // A runtime without I/O or timers drives the future; nothing in it waits.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| ApiError::internal(format!("starting an async runtime: {e}")))?;
    let started = Instant::now();
    runtime.block_on(decide(body, ctx, decider, started, ParseOn::ThisThread, |call| {
        std::future::ready(run(call))
    }))
}

/// The direct engine call: `call` on a loaded engine, on this thread (no queue, no deadline).
pub fn run_engine(
    engine: &dyn DecisionEngine,
    call: EngineCall,
    limits: BatchLimits,
) -> Result<EngineOutput, ApiError> {
    let images: Vec<&PatchedImage> = call.images.iter().collect();
    engine
        .run(&call.plan, &images, limits, &|| Ok(()))
        .map_err(|e| ApiError::internal(format!("the engine failed: {e:#}")))
}

/// How a planning refusal is answered: over the processed-token limit → 413
/// `request_too_large` (as `tools/reference_decide.py` does); too many options for the readout
/// → 422 `invalid_request`; anything else is our bug → 500.
pub fn plan_error(e: PlanError) -> ApiError {
    match e {
        // Following tools/reference_decide.py: well-formed but too large to process.
        e @ (PlanError::TooManyTokens { .. } | PlanError::TooManyTokensAtLeast { .. }) => {
            ApiError::too_large(e.to_string())
        }
        PlanError::Invalid(m) => ApiError::invalid(Loc::body().at("questions"), m, "value_error"),
        PlanError::Internal(e) => ApiError::internal(format!("planning failed: {e:#}")),
    }
}

/// Runs `f` on the async runtime's blocking pool, inside the current tracing span.
pub(super) async fn on_blocking_pool<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || {
        let _g = span.enter();
        f()
    })
    .await
    .map_err(|e| ApiError::internal(format!("a blocking task failed: {e}")))?
}
