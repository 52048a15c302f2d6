//! The HTTP server: routes, auth, request ids, metrics, liveness (`/livez`) apart from readiness
//! (`/healthz`), and graceful shutdown bounded by `--shutdown-grace`. Connections go through
//! [`super::conn`] (connection cap, head checks, head and body timeouts) into actix-http's HTTP/1
//! dispatcher, which runs the actix-web app below.
//!
//! `POST /v1/systemone` runs the request pipeline ([`super::pipeline`]) and never blocks an
//! async thread: body decoding, JSON parsing, image decoding and planning run on the blocking
//! pool; the engine call puts the plan on the engine thread's bounded queue and awaits the reply.
//! A full queue is 529 at once; a caller whose connection is reset drops its reply channel, and
//! the engine skips its job (a half-closed connection still gets its answer).

use super::body::{self, BodyKind};
use super::conn::{ConnCounter, ConnLimits, ConnShared, Guarded, DISCONNECT_TIMEOUT, REFUSAL_HEADER};
use super::error::{ApiError, Loc};
use super::metrics::{route_label, HttpMetrics};
use super::parse::{ParseContext, RequestBody, DEFAULT_MAX_QUESTIONS};
use super::pipeline::{self, on_blocking_pool, EngineCall, ParseOn};
use super::schema;
use crate::decision::Decider;
use crate::image::ImageProcessorConfig;
use crate::worker::{EngineOutput, EngineStatus, Job, JobError, Stage, SubmitError, WorkerHandle};
use actix_web::dev::{Service, ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::{web, App, HttpMessage, HttpRequest, HttpResponse, ResponseError};
use anyhow::Context;
use prometheus::{Encoder, Registry, TextEncoder};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;
use tracing::Instrument;

/// HTTP settings. What changes answers (contract mode, model name, rotations, calibration)
/// lives in [`crate::decision::DecisionSettings`]; the queue depth is the worker's
/// ([`crate::worker::spawn`]).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// HTTP worker threads (each runs its own async runtime; heavy work goes to blocking pools).
    pub workers: usize,
    /// Largest request body, before and after `Content-Encoding` decoding (128 MiB).
    pub max_body_bytes: usize,
    /// Most questions per request (64).
    pub max_questions: usize,
    /// Accepted `Authorization: Bearer` keys; empty = no auth (any Authorization header is accepted).
    pub api_keys: Vec<String>,
    /// A request's deadline, from arrival; past it the engine drops the job and the caller gets 504.
    pub request_timeout: Duration,
    /// `GET /v1/models` → `models[].description` (default: the built-in release manifest's).
    pub model_description: String,
    /// `GET /v1/models` → `models[].release_date` (YYYY-MM-DD; default: the manifest's).
    pub release_date: String,
    /// `GET /v1/models` → `adapter` (e.g. the adapter folder).
    pub adapter_label: Option<String>,
    /// Serve the playground page at `/` ([`super::playground`]); `--no-playground` turns it off.
    pub playground: bool,
    /// Connection cap, head and body timeouts ([`super::conn`]).
    pub conn: ConnLimits,
    /// On SIGTERM, how long accepted requests may still take before the server stops anyway.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8765,
            workers: std::thread::available_parallelism().map(|n| n.get().min(4)).unwrap_or(2),
            max_body_bytes: 128 << 20,
            max_questions: DEFAULT_MAX_QUESTIONS,
            api_keys: Vec::new(),
            request_timeout: Duration::from_secs(60),
            model_description: crate::release::Manifest::builtin().release.description.clone(),
            release_date: crate::release::Manifest::builtin().release.release_date.clone(),
            adapter_label: None,
            playground: true,
            conn: ConnLimits::default(),
            shutdown_grace: Duration::from_secs(25),
        }
    }
}

/// What every handler reads, behind the one `Arc` of [`AppState`].
struct SharedState {
    cfg: ServerConfig,
    decider: RwLock<Option<Arc<Decider>>>,
    worker: WorkerHandle,
    image_config: ImageProcessorConfig,
    registry: Registry,
    http: HttpMetrics,
    /// SHA-256 of each API key (compared in constant time, without leaking lengths).
    keys: Vec<[u8; 32]>,
    openapi: Vec<u8>,
}

/// Everything the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    shared: Arc<SharedState>,
}

/// The shared state of the server: `worker` runs the engine (its metrics must be registered in
/// `registry`, where the HTTP metrics are added); the decider is set with
/// [`AppState::set_decider`] (until then, and until the worker reports the model loaded, the
/// API answers 503).
pub fn build_app_state(
    cfg: &ServerConfig,
    worker: WorkerHandle,
    registry: Registry,
    image_config: ImageProcessorConfig,
) -> anyhow::Result<AppState> {
    let http = HttpMetrics::new(&registry).context("registering the HTTP metrics")?;
    let keys = cfg.api_keys.iter().map(|k| Sha256::digest(k.as_bytes()).into()).collect();
    let openapi = serde_json::to_vec_pretty(&schema::openapi())?;
    Ok(AppState {
        shared: Arc::new(SharedState {
            cfg: cfg.clone(),
            decider: RwLock::new(None),
            worker,
            image_config,
            registry,
            http,
            keys,
            openapi,
        }),
    })
}

/// Why the API cannot answer yet.
enum NotReady {
    Loading,
    Failed(String),
}

impl AppState {
    /// Makes the decision layer available (answers start once the worker has loaded the model).
    pub fn set_decider(&self, decider: Arc<Decider>) {
        *self.shared.decider.write().unwrap_or_else(|e| e.into_inner()) = Some(decider);
    }

    pub fn decider(&self) -> Option<Arc<Decider>> {
        self.shared.decider.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn registry(&self) -> &Registry {
        &self.shared.registry
    }

    pub fn worker(&self) -> &WorkerHandle {
        &self.shared.worker
    }

    pub fn config(&self) -> &ServerConfig {
        &self.shared.cfg
    }

    fn ready(&self) -> Result<(Arc<Decider>, String, f64), NotReady> {
        match self.shared.worker.status() {
            EngineStatus::Failed(e) => Err(NotReady::Failed(e)),
            EngineStatus::Loading => Err(NotReady::Loading),
            EngineStatus::Ready { backend, load_seconds } => match self.decider() {
                Some(d) => Ok((d, backend, load_seconds)),
                None => Err(NotReady::Loading),
            },
        }
    }

    fn ready_or_503(&self) -> Result<(Arc<Decider>, String, f64), ApiError> {
        self.ready().map_err(|n| match n {
            NotReady::Loading => {
                ApiError::message(503, "loading", "the model is still loading; retry shortly")
                    .with_retry_after(Duration::from_secs(5))
            }
            NotReady::Failed(e) => {
                ApiError::message(503, "unavailable", format!("the model failed to load: {e}"))
            }
        })
    }

    fn authorize(&self, req: &HttpRequest) -> Result<(), ApiError> {
        if self.shared.keys.is_empty() {
            return Ok(());
        }
        let fail = |m: &str| ApiError::message(401, "authentication_error", m);
        let Some(h) = req.headers().get(header::AUTHORIZATION) else {
            return Err(fail("missing API key: send Authorization: Bearer <key>"));
        };
        let token = h.to_str().ok().and_then(|s| {
            let (scheme, rest) = s.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        });
        let Some(token) = token else {
            return Err(fail("the Authorization header must be 'Bearer <key>'"));
        };
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut ok = subtle::Choice::from(0u8);
        for k in &self.shared.keys {
            ok |= k.ct_eq(&digest);
        }
        if bool::from(ok) {
            Ok(())
        } else {
            Err(fail("invalid API key"))
        }
    }
}

/// The request id of the current request (set by the middleware).
#[derive(Clone)]
struct RequestId(String);

/// Resolves when the caller's connection was reset (checked every 50 ms); never, without one.
/// A read-side EOF is not a disconnect ([`ConnShared::peer_reset`]).
async fn peer_gone(conn: Option<Arc<ConnShared>>) {
    let Some(conn) = conn else { return std::future::pending().await };
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if conn.peer_reset() {
            return;
        }
    }
}

fn sane_request_id(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?;
    let ok = !s.is_empty()
        && s.len() <= 128
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    ok.then(|| s.to_string())
}

fn new_request_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static SEED: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
    let seed = SEED.get_or_init(std::collections::hash_map::RandomState::new);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let mut a = seed.build_hasher();
    a.write_u64(n);
    a.write_u128(t);
    let mut b = seed.build_hasher();
    b.write_u64(!n);
    b.write_u64(a.finish());
    format!("{:016x}{:016x}", a.finish(), b.finish())
}

fn json_response(status: u16, v: &serde_json::Value) -> HttpResponse {
    HttpResponse::build(
        actix_web::http::StatusCode::from_u16(status).unwrap_or(actix_web::http::StatusCode::OK),
    )
    .content_type("application/json")
    .body(serde_json::to_vec(v).unwrap_or_default())
}

fn header_str(req: &HttpRequest, name: HeaderName) -> Result<Option<String>, ApiError> {
    match req.headers().get(&name) {
        None => Ok(None),
        Some(v) => v.to_str().map(|s| Some(s.to_string())).map_err(|_| {
            ApiError::bad_request(
                Loc::body(),
                format!("the {name} header is not valid ASCII"),
                "header_invalid",
            )
        }),
    }
}

/// `POST /v1/systemone`: the request pipeline with the worker's queue as the engine call.
async fn systemone(
    req: HttpRequest,
    payload: web::Payload,
    st: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let started = Instant::now();
    let id = req.extensions().get::<RequestId>().map(|r| r.0.clone()).unwrap_or_else(new_request_id);
    st.authorize(&req)?;
    let (decider, _, _) = st.ready_or_503()?;
    let cfg = &st.shared.cfg;
    let conn = req.conn_data::<Arc<ConnShared>>().cloned();
    let body = match read_body(&req, payload, cfg.max_body_bytes).await {
        Err(_) if conn.as_ref().is_some_and(|c| c.body_timed_out()) => {
            return Err(super::conn::request_timeout(format!(
                "the request body did not arrive in time: {} s plus 1 s per {} bytes sent (--body-timeout, --min-body-rate)",
                cfg.conn.body_timeout.as_secs_f64(),
                cfg.conn.min_body_rate
            )))
        }
        r => r?,
    };
    let ctx = ParseContext::for_decider(&decider, cfg.max_questions, st.shared.image_config.clone());
    let peer = conn;
    let queued = |call| run_queued(&st, call, id, started, peer);
    let decided = pipeline::decide(body, ctx, decider, started, ParseOn::BlockingPool, queued).await?;
    st.shared.http.record_decision(
        decided.plan.processed_tokens,
        started.elapsed().as_secs_f64(),
        &decided.tallies,
    );
    Ok(json_response(200, &decided.response))
}

/// The body of a `POST /v1/systemone`, checked against its headers and decoded: at most `cap`
/// bytes before and after `Content-Encoding`, JSON or multipart.
async fn read_body(req: &HttpRequest, payload: web::Payload, cap: usize) -> Result<RequestBody, ApiError> {
    let kind = body::body_kind(header_str(req, header::CONTENT_TYPE)?.as_deref())?;
    let codings = body::codings(header_str(req, header::CONTENT_ENCODING)?.as_deref())?;
    if let Some(len) = header_str(req, header::CONTENT_LENGTH)?.and_then(|s| s.trim().parse::<u64>().ok()) {
        if len > cap as u64 {
            return Err(ApiError::too_large(format!(
                "the request body is {len} bytes; the limit is {cap} bytes"
            )));
        }
    }
    let budget = super::budget::global();
    let (raw, held) = body::read_payload_within(payload, cap, Some(budget)).await?;
    let (decoded, held) = if codings.is_empty() {
        (raw, held)
    } else {
        on_blocking_pool(move || body::decode_within(raw, held, &codings, cap)).await?
    };
    Ok(match kind {
        BodyKind::Json => RequestBody::json(decoded).holding(held),
        BodyKind::Multipart => {
            let (json, files, held) = body::split_multipart(req.headers(), decoded, held)?;
            RequestBody::multipart(json, files).holding(held)
        }
    })
}

/// The HTTP engine call: a job on the worker's queue, awaited until the engine answers, the
/// request's deadline (from `started`) passes or the caller goes away (which drops the reply
/// channel: the engine then skips the job).
async fn run_queued(
    st: &AppState,
    call: EngineCall,
    id: String,
    started: Instant,
    peer: Option<Arc<ConnShared>>,
) -> Result<EngineOutput, ApiError> {
    let cfg = &st.shared.cfg;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let now = Instant::now();
    let timeout = cfg.request_timeout.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
    let job = Job {
        id,
        plan: call.plan,
        images: call.images,
        deadline: now + timeout,
        timeout: cfg.request_timeout,
        enqueued: now,
        reply: tx,
    };
    match st.shared.worker.submit(job) {
        Ok(()) => {}
        Err(SubmitError::Full { capacity, retry_after_s }) => {
            return Err(ApiError::message(
                529,
                "overloaded",
                format!(
                    "the server is busy ({capacity} requests are waiting); retry after {retry_after_s} s"
                ),
            )
            .with_retry_after(Duration::from_secs(retry_after_s)));
        }
        Err(SubmitError::Stopped) => {
            return Err(ApiError::message(503, "unavailable", "the engine has stopped"))
        }
    }
    let reply = tokio::select! {
        r = tokio::time::timeout(timeout + Duration::from_secs(2), rx) => r,
        _ = peer_gone(peer) => {
            // Dropping the reply channel (with this future) tells the engine to skip the job.
            tracing::info!("the caller reset its connection while waiting for the engine");
            return Err(ApiError::message(499, "client_closed_request", "the client reset the connection"));
        }
    };
    match reply {
        Err(_) => Err(timeout_error(cfg.request_timeout)),
        Ok(Err(_)) => Err(ApiError::internal("the engine stopped without answering")),
        Ok(Ok(Err(e))) => Err(match e {
            JobError::Deadline { stage, .. } => abandoned_error(cfg.request_timeout, stage),
            JobError::NotLoaded(m) => {
                ApiError::message(503, "unavailable", format!("the model is not loaded: {m}"))
            }
            JobError::Engine(e) => ApiError::internal(format!("the engine failed: {e:#}")),
            JobError::Cancelled => ApiError::internal("the request was cancelled"),
            JobError::OverBudget { estimate_s, whole: true, .. } => ApiError::too_large(format!(
                "the engine would need about {estimate_s:.0} s for this request (its images: their patches, \
                 quadratically per image), more than --request-timeout ({:.0} s): send smaller images",
                cfg.request_timeout.as_secs_f64()
            )),
            JobError::OverBudget { estimate_s, left_s, whole: false } => ApiError::message(
                504,
                "timeout",
                format!(
                    "abandoned before the engine started: it would need about {estimate_s:.1} s and \
                     {left_s:.1} s of the request's deadline were left; retry later or send less"
                ),
            ),
        }),
        Ok(Ok(Ok(out))) => Ok(out),
    }
}

/// 504 for a request whose deadline passed in the engine: what of its work was abandoned.
fn abandoned_error(t: Duration, stage: Stage) -> ApiError {
    ApiError::message(
        504,
        "timeout",
        format!(
            "the request did not finish within {:.1} s: its work was abandoned {stage}; retry later or send less",
            t.as_secs_f64()
        ),
    )
}

fn timeout_error(t: Duration) -> ApiError {
    ApiError::message(
        504,
        "timeout",
        format!("the request did not finish within {:.1} s; retry later or send less", t.as_secs_f64()),
    )
}

/// `GET /v1/models`.
async fn models(st: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let (d, backend, load_seconds) = st.ready_or_503()?;
    let cfg = &st.shared.cfg;
    let name = d.settings.model_name.clone();
    let body = json!({
        "models": [{"name": name, "description": cfg.model_description, "release_date": cfg.release_date}],
        "model": name,
        "adapter": cfg.adapter_label,
        "backend": backend,
        "loaded": true,
        "load_seconds": (load_seconds * 1000.0).round() / 1000.0,
        "readout_codes": d.codebook.len(),
        "prompt_layout": "standard",
        "max_options": d.max_options(),
    });
    Ok(json_response(200, &body))
}

/// `GET /livez`: 200 while the process can serve or is loading the model (restarting it would
/// not help), 503 once the model failed to load (the process is stopping).
async fn livez(st: web::Data<AppState>) -> HttpResponse {
    let (code, body) = match st.shared.worker.status() {
        EngineStatus::Failed(e) => {
            (503, schema::Liveness { status: "failed".into(), model: None, error: Some(e) })
        }
        EngineStatus::Loading => {
            (200, schema::Liveness { status: "alive".into(), model: Some("loading".into()), error: None })
        }
        EngineStatus::Ready { .. } => {
            (200, schema::Liveness { status: "alive".into(), model: Some("ready".into()), error: None })
        }
    };
    json_response(code, &serde_json::to_value(body).unwrap_or_default())
}

/// `GET /healthz`: readiness, 200 once the model is loaded.
async fn healthz(st: web::Data<AppState>) -> HttpResponse {
    let w = &st.shared.worker;
    let (depth, capacity) = (w.queue_depth(), w.capacity());
    match st.ready() {
        Ok((d, backend, _)) => json_response(
            200,
            &json!({"status": "ok", "model": d.settings.model_name, "backend": backend, "queue_depth": depth, "queue_capacity": capacity}),
        ),
        Err(NotReady::Loading) => json_response(
            503,
            &json!({"status": "loading", "queue_depth": depth, "queue_capacity": capacity}),
        ),
        Err(NotReady::Failed(e)) => json_response(
            503,
            &json!({"status": "failed", "error": e, "queue_depth": depth, "queue_capacity": capacity}),
        ),
    }
}

/// `GET /metrics`.
async fn metrics(st: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    st.shared.worker.metrics.refresh();
    let mut out = Vec::new();
    let enc = TextEncoder::new();
    enc.encode(&st.shared.registry.gather(), &mut out)
        .map_err(|e| ApiError::internal(format!("encoding metrics: {e}")))?;
    Ok(HttpResponse::Ok().content_type(enc.format_type()).body(out))
}

/// `GET /openapi.json`.
async fn openapi(st: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().content_type("application/json").body(st.shared.openapi.clone())
}

async fn not_found(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::not_found(format!(
        "no route {} {}: the API is POST /v1/systemone, GET /v1/models, /healthz, /livez, /metrics, /openapi.json",
        req.method(),
        req.path()
    )))
}

async fn method_not_allowed(req: HttpRequest) -> HttpResponse {
    let allow = if req.path() == "/v1/systemone" { "POST" } else { "GET" };
    let e = ApiError::message(
        405,
        "method_not_allowed",
        format!("{} {} is not allowed; use {allow}", req.method(), req.path()),
    );
    let mut r = actix_web::ResponseError::error_response(&e);
    r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// Per-request bookkeeping of the middleware: request id in and out (`x-request-id`,
/// `x-typesafe-request-id`), request metrics, a tracing span, one log line at the end.
struct Observed {
    id: String,
    route: String,
    span: tracing::Span,
    started: Instant,
    /// Where the response is recorded (one Arc clone per request).
    state: AppState,
    /// None for a scrape of `/metrics`, which does not count itself.
    _in_flight: Option<InFlight>,
}

struct InFlight(prometheus::IntGauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Observed {
    fn start(req: &ServiceRequest, st: &AppState) -> Self {
        let id = req.headers().get("x-request-id").and_then(sane_request_id).unwrap_or_else(new_request_id);
        req.extensions_mut().insert(RequestId(id.clone()));
        let route = route_label(req.match_pattern());
        let span =
            tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.path());
        let in_flight = (route != "/metrics").then(|| {
            let gauge = st.shared.http.in_flight.clone();
            gauge.inc();
            InFlight(gauge)
        });
        Observed { id, route, span, started: Instant::now(), state: st.clone(), _in_flight: in_flight }
    }

    fn finish<B>(self, mut res: ServiceResponse<B>) -> ServiceResponse<B> {
        let status = res.status().as_u16();
        let value = HeaderValue::from_str(&self.id).unwrap_or_else(|_| HeaderValue::from_static("invalid"));
        res.headers_mut().insert(HeaderName::from_static("x-request-id"), value.clone());
        res.headers_mut().insert(HeaderName::from_static("x-typesafe-request-id"), value);
        let seconds = self.started.elapsed().as_secs_f64();
        self.state.shared.http.record_response(&self.route, status, seconds);
        // Milliseconds to 0.1 (the log shows 173.7, not 173.72162699999998).
        let ms = (seconds * 1e4).round() / 10.0;
        self.span.in_scope(|| {
            if status >= 500 {
                tracing::warn!(status, ms, "request failed");
            } else {
                tracing::info!(status, ms, "request");
            }
        });
        res
    }
}

/// The refusal a stand-in request of [`super::conn`] carries, if this is one.
fn connection_refusal(req: &ServiceRequest) -> Option<ApiError> {
    if !req.headers().contains_key(REFUSAL_HEADER) {
        return None;
    }
    req.conn_data::<Arc<ConnShared>>()?.take_refusal()
}

/// Serves HTTP on `listener` until `shutdown` resolves, then stops accepting, closes idle
/// connections, lets accepted requests finish for up to `--shutdown-grace` (each connection
/// closes after its answer) and returns (requests still running then are dropped: their callers'
/// connections close, and the engine skips or stops their jobs).
pub async fn run_http_server(
    listener: std::net::TcpListener,
    cfg: ServerConfig,
    app: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use actix_service::{fn_service, map_config, IntoServiceFactory, ServiceFactoryExt};
    let grace = cfg.shutdown_grace;
    let limits = cfg.conn;
    let playground = cfg.playground;
    let state = app.clone();
    let addr = listener.local_addr()?;
    let counter = Arc::new(ConnCounter::new());
    let make_app = move || {
        let st = state.clone();
        App::new()
            .app_data(web::Data::new(state.clone()))
            .wrap_fn(move |req, srv| {
                let obs = Observed::start(&req, &st);
                let fut = match connection_refusal(&req) {
                    Some(e) => futures_util::future::Either::Left(std::future::ready(Ok(
                        req.into_response(e.error_response())
                    ))),
                    None => futures_util::future::Either::Right(srv.call(req)),
                };
                let fut = fut.instrument(obs.span.clone());
                async move { Ok(obs.finish(fut.await?)) }
            })
            .service(
                web::resource("/v1/systemone")
                    .route(web::post().to(systemone))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/v1/models")
                    .route(web::get().to(models))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/healthz")
                    .route(web::get().to(healthz))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/livez")
                    .route(web::get().to(livez))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/metrics")
                    .route(web::get().to(metrics))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/openapi.json")
                    .route(web::get().to(openapi))
                    .default_service(web::to(method_not_allowed)),
            )
            .configure(|c| {
                if playground {
                    super::playground::register(c)
                }
            })
            .default_service(web::to(not_found))
    };
    // What actix_web::HttpServer::listen builds, with the connection layer's I/O in between
    // (see super::conn for why).
    let builder = actix_web::dev::Server::build();
    // Tells every connection's dispatcher that shutdown began (as HttpServer does): an idle
    // keep-alive connection closes at once, one with a request in flight after its answer
    // (`Connection: close`). Without it the workers waited for idle connections, whose clients
    // may keep them open for the whole grace.
    let draining = builder.graceful_shutdown_signal();
    let server = builder
        .workers(cfg.workers.max(1))
        .shutdown_timeout(grace.as_secs().max(1))
        .shutdown_signal(shutdown)
        .listen("imajev-http", listener, move || {
            let counter = counter.clone();
            let draining = draining.clone();
            let accept = fn_service(move |io: actix_web::rt::net::TcpStream| {
                let peer = io.peer_addr().ok();
                let conn = Guarded::new(io, limits, &counter);
                std::future::ready(Ok::<_, actix_http::error::DispatchError>((conn, peer)))
            });
            let app = make_app().into_factory().map_err(|e| e.error_response());
            let http = actix_http::HttpService::build()
                .graceful_shutdown_signal(move || {
                    let draining = draining.clone();
                    async move { draining.notified().await }
                })
                .keep_alive(actix_http::KeepAlive::Timeout(Duration::from_secs(5)))
                // The connection layer times heads itself (answering 408 with a body).
                .client_request_timeout(Duration::ZERO)
                .client_disconnect_timeout(DISCONNECT_TIMEOUT)
                .h1_allow_half_closed(true)
                .local_addr(addr)
                .on_connect_ext(|io: &Guarded, ext: &mut actix_http::Extensions| {
                    ext.insert(io.shared());
                })
                .h1(map_config(app, |_| actix_web::dev::AppConfig::default()));
            accept.and_then(http)
        })
        .with_context(|| format!("listening on {addr}"))?
        .run();
    tracing::info!(%addr, "serving POST /v1/systemone");
    drop(app);
    server.await.context("the HTTP server failed")?;
    tracing::info!("HTTP server stopped");
    Ok(())
}
