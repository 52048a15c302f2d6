//! The one engine thread. HTTP handlers never touch the model: they plan a request, submit it
//! to a bounded queue and await a oneshot reply. A full queue is refused at once (529 with
//! Retry-After); a job whose caller went away or whose deadline passed is dropped before it costs
//! compute (and between steps while it runs); on shutdown every accepted job is finished.
//!
//! Each round the thread takes the oldest waiting job and, behind it in arrival order, every
//! waiting job whose tree still fits the forward's budget (`--batch-tokens`, `--batch-sequences`),
//! and runs them as ONE packed forward; the first job that does not fit waits and opens the next
//! round (first in, first out: nothing overtakes it, so nothing starves; a job too large for one
//! forward runs alone). It stays one thread on one stream. A request's tree is built from its
//! plan alone and the backends' ops are batch-invariant, so no caller can change another's
//! answers.

pub mod limits;
pub mod metrics;
pub mod round;
pub mod runner;

pub use limits::{BatchLimits, QuestionTree, TreeSize};
pub use metrics::EngineMetrics;
pub use round::{Round, RoundResults};
pub use runner::{
    DecisionEngine, EngineOutput, ForwardShape, PackedJob, RunError, Stage, StopReason, WorkEstimate,
    DROP_REASONS,
};

use crate::decision::Plan;
use crate::image::PatchedImage;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Why a job did not produce logits.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The deadline (from the request timeout) passed; the work from `stage` on was abandoned.
    #[error(
        "the request's deadline of {timeout:?} passed before it finished; its work was abandoned {stage}"
    )]
    Deadline { timeout: Duration, stage: Stage },
    #[error("the caller disconnected")]
    Cancelled,
    #[error("the engine failed: {0:#}")]
    Engine(anyhow::Error),
    #[error("the model failed to load: {0}")]
    NotLoaded(String),
    /// Refused before it started: its estimated engine time does not fit what is left of its
    /// deadline (`whole`: nor would it fit the whole request timeout, so a retry cannot help).
    #[error(
        "the request would take the engine about {estimate_s:.1} s; {left_s:.1} s of its deadline are left"
    )]
    OverBudget { estimate_s: f64, left_s: f64, whole: bool },
}

/// One accepted request for the engine thread.
pub struct Job {
    /// The request id, for logs.
    pub id: String,
    /// Shared with the caller, who builds the answers from it.
    pub plan: Arc<Plan>,
    /// The images' pixels in prompt order (owned: only the engine reads them).
    pub images: Vec<PatchedImage>,
    /// Past it the job is dropped, before or between its steps.
    pub deadline: Instant,
    /// The request timeout the deadline came from (for the 504 message).
    pub timeout: Duration,
    pub enqueued: Instant,
    pub reply: oneshot::Sender<Result<EngineOutput, JobError>>,
}

impl Job {
    /// Why to stop working on this job now, if anything.
    fn stop_reason(&self) -> Option<StopReason> {
        if self.reply.is_closed() {
            Some(StopReason::CallerGone)
        } else if Instant::now() >= self.deadline {
            Some(StopReason::Deadline)
        } else {
            None
        }
    }

    /// The reply for a job stopped for `why` at `stage` (nobody reads it when the caller is gone).
    fn stopped(&self, why: StopReason, stage: Stage) -> JobError {
        match why {
            StopReason::Deadline => JobError::Deadline { timeout: self.timeout, stage },
            StopReason::CallerGone => JobError::Cancelled,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the queue is full ({capacity} requests waiting)")]
    Full { capacity: usize, retry_after_s: u64 },
    #[error("the worker has stopped")]
    Stopped,
}

/// Where the model is in its life.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineStatus {
    Loading,
    Ready { backend: String, load_seconds: f64 },
    Failed(String),
}

/// The submitting side, shared by all HTTP handlers.
#[derive(Clone)]
pub struct WorkerHandle {
    tx: SyncSender<Job>,
    depth: Arc<AtomicUsize>,
    capacity: usize,
    /// Exponential moving average of job seconds ×1000, for Retry-After.
    avg_job_ms: Arc<AtomicU64>,
    pub status: Arc<Mutex<EngineStatus>>,
    pub metrics: Arc<EngineMetrics>,
}

impl WorkerHandle {
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        // Count before sending so the worker's decrement can never run first. The count, not
        // only the channel, enforces the capacity: the engine thread may hold one job it took
        // off the channel for the next round.
        if self.depth.fetch_add(1, Ordering::SeqCst) >= self.capacity {
            self.depth.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Full { capacity: self.capacity, retry_after_s: self.retry_after_s() });
        }
        match self.tx.try_send(job) {
            Ok(()) => {
                self.metrics.queue_depth.set(self.depth.load(Ordering::SeqCst) as i64);
                Ok(())
            }
            Err(TrySendError::Full(_)) => {
                self.depth.fetch_sub(1, Ordering::SeqCst);
                Err(SubmitError::Full { capacity: self.capacity, retry_after_s: self.retry_after_s() })
            }
            Err(TrySendError::Disconnected(_)) => {
                self.depth.fetch_sub(1, Ordering::SeqCst);
                Err(SubmitError::Stopped)
            }
        }
    }

    /// Seconds until the queue has probably drained (1..=60).
    pub fn retry_after_s(&self) -> u64 {
        let per_job = self.avg_job_ms.load(Ordering::Relaxed).max(100) as f64 / 1000.0;
        ((self.depth.load(Ordering::SeqCst) as f64 * per_job).ceil() as u64).clamp(1, 60)
    }

    pub fn queue_depth(&self) -> usize {
        self.depth.load(Ordering::SeqCst)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn status(&self) -> EngineStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or(EngineStatus::Failed("status lock poisoned".into()))
    }
}

/// Starts the engine thread: it loads the model with `load`, then runs jobs ([`run_jobs`]) until
/// every handle is dropped and the queue is empty.
pub fn spawn<F>(
    load: F,
    capacity: usize,
    limits: BatchLimits,
    metrics: Arc<EngineMetrics>,
) -> (WorkerHandle, JoinHandle<()>)
where
    F: FnOnce() -> anyhow::Result<Box<dyn DecisionEngine>> + Send + 'static,
{
    let (tx, rx) = sync_channel::<Job>(capacity.max(1));
    metrics.queue_capacity.set(capacity.max(1) as i64);
    let handle = WorkerHandle {
        tx,
        depth: Arc::new(AtomicUsize::new(0)),
        capacity: capacity.max(1),
        avg_job_ms: Arc::new(AtomicU64::new(500)),
        status: Arc::new(Mutex::new(EngineStatus::Loading)),
        metrics,
    };
    // The thread keeps everything but the sender: once the last WorkerHandle is dropped, the
    // channel closes and the loop ends after draining the queue.
    let h = Shared {
        depth: handle.depth.clone(),
        avg_job_ms: handle.avg_job_ms.clone(),
        status: handle.status.clone(),
        metrics: handle.metrics.clone(),
        rates: Mutex::new(Rates::default()),
    };
    let join = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            // The engine's own rayon pool, as many threads as the global one: the request side
            // (image decoding and resizing, tokenizing) runs its parallel work on the global
            // pool, and a job queued there behind a long one (inflating a 20-million-pixel PNG
            // takes seconds) would hold every forward that waits for its turn — one client's
            // big images stalling every other client's answers. Two pools share the cores
            // through the OS scheduler instead.
            let threads = rayon::current_num_threads();
            match rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("engine-{i}"))
                .build()
            {
                Ok(pool) => pool.install(move || engine_main(load, rx, &h, limits)),
                Err(e) => {
                    tracing::warn!("no engine thread pool ({e}): the engine shares the global one");
                    engine_main(load, rx, &h, limits)
                }
            }
        })
        .expect("spawning the engine thread");
    (handle, join)
}

/// The engine thread's work: load the model, then run jobs until the queue closes.
fn engine_main<F>(load: F, rx: Receiver<Job>, h: &Shared, limits: BatchLimits)
where
    F: FnOnce() -> anyhow::Result<Box<dyn DecisionEngine>>,
{
    let started = Instant::now();
    let engine = match load() {
        Ok(e) => {
            let backend = e.backend_name();
            let load_seconds = started.elapsed().as_secs_f64();
            // Seconds to 0.01 in the log; the status keeps the exact value.
            let seconds = (load_seconds * 100.0).round() / 100.0;
            tracing::info!(%backend, load_seconds = seconds, "model loaded");
            h.metrics.load_seconds.set(load_seconds);
            if let Some(bytes) = e.weight_bytes() {
                h.metrics.weight_bytes.set(bytes as i64);
            }
            if let Some(probe) = e.memory_probe() {
                h.metrics.set_memory_probe(probe);
            }
            if let Some(v) = e.calibrate_vision() {
                tracing::info!(ns_per_kmac = v * 1e12, "vision tower timed for admission by cost");
                h.rates.lock().unwrap_or_else(|p| p.into_inner()).vision = Some(v);
            }
            h.metrics.loaded.set(1);
            *h.status.lock().unwrap() = EngineStatus::Ready { backend, load_seconds };
            Some(e)
        }
        Err(e) => {
            tracing::error!("model load failed: {e:#}");
            *h.status.lock().unwrap() = EngineStatus::Failed(format!("{e:#}"));
            None
        }
    };
    run_jobs(engine, rx, h, limits);
}

/// Seconds per multiply-accumulate of each stage, as measured (None until measured).
#[derive(Debug, Default, Clone, Copy)]
struct Rates {
    vision: Option<f64>,
    decoder: Option<f64>,
}

impl Rates {
    /// The engine seconds `w` should take, counting only the stages already measured.
    fn seconds(&self, w: WorkEstimate) -> f64 {
        self.vision.map_or(0.0, |r| r * w.vision_macs) + self.decoder.map_or(0.0, |r| r * w.decoder_macs)
    }

    /// Folds in a run that took `seconds` for `macs` (short runs time overheads, not work).
    fn learn(rate: &mut Option<f64>, seconds: f64, macs: f64) {
        if seconds < 0.02 || macs <= 0.0 {
            return;
        }
        let r = seconds / macs;
        *rate = Some(rate.map_or(r, |old| 0.7 * old + 0.3 * r));
    }
}

/// The engine thread's view of the shared counters (no sender, so it cannot keep the queue open).
struct Shared {
    depth: Arc<AtomicUsize>,
    avg_job_ms: Arc<AtomicU64>,
    status: Arc<Mutex<EngineStatus>>,
    metrics: Arc<EngineMetrics>,
    rates: Mutex<Rates>,
}

impl Shared {
    fn status(&self) -> EngineStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or(EngineStatus::Failed("status lock poisoned".into()))
    }

    /// A job leaves the queue for good: it is no longer counted as waiting, its wait is recorded,
    /// and it is returned unless it is to be stopped (then it is answered or skipped here).
    fn admit(&self, job: Job) -> Option<Job> {
        let depth = self.depth.fetch_sub(1, Ordering::SeqCst).saturating_sub(1);
        self.metrics.queue_depth.set(depth as i64);
        self.metrics.queue_seconds.observe(job.enqueued.elapsed().as_secs_f64());
        let Some(why) = job.stop_reason() else { return Some(job) };
        self.metrics.dropped.with_label_values(&[why.metric_label()]).inc();
        match why {
            StopReason::CallerGone => {
                tracing::info!(request_id = %job.id, "caller left while queued; skipped")
            }
            StopReason::Deadline => {
                let stage = Stage::Queued;
                tracing::warn!(request_id = %job.id, reason = %why, %stage, "work abandoned");
                let error = job.stopped(why, stage);
                let _ = job.reply.send(Err(error));
            }
        }
        None
    }

    /// Admission by cost: the job, unless its estimated engine time ([`WorkEstimate`] at the
    /// measured [`Rates`]) does not fit what is left of its deadline — then it is refused here,
    /// before it holds the engine (and every request queued behind it).
    fn afford(&self, engine: &dyn DecisionEngine, job: Job) -> Option<(Job, WorkEstimate)> {
        let images: Vec<&PatchedImage> = job.images.iter().collect();
        let work = engine.estimate(&job.plan, &images);
        let estimate_s = self.rates.lock().unwrap_or_else(|p| p.into_inner()).seconds(work);
        let left_s = job.deadline.saturating_duration_since(Instant::now()).as_secs_f64();
        if estimate_s <= left_s {
            return Some((job, work));
        }
        let whole = estimate_s > job.timeout.as_secs_f64();
        self.metrics.dropped.with_label_values(&["over_budget"]).inc();
        tracing::warn!(
            request_id = %job.id,
            estimate_s = (estimate_s * 10.0).round() / 10.0,
            left_s = (left_s * 10.0).round() / 10.0,
            images = images.len(),
            reason = "over_budget",
            "work abandoned before it started: it would not finish before its deadline"
        );
        let _ = job.reply.send(Err(JobError::OverBudget { estimate_s, left_s, whole }));
        None
    }

    /// Answers a job with the engine's result.
    fn answer(&self, job: Job, work: WorkEstimate, result: Result<EngineOutput, RunError>) {
        let reply = match result {
            Ok(out) => {
                self.metrics.record(&out);
                let mut rates = self.rates.lock().unwrap_or_else(|p| p.into_inner());
                Rates::learn(&mut rates.vision, out.vision_ms / 1e3, work.vision_macs);
                if out.packed_with <= 1 {
                    Rates::learn(
                        &mut rates.decoder,
                        (out.prefill_ms + out.questions_ms) / 1e3,
                        work.decoder_macs,
                    );
                }
                Ok(out)
            }
            Err(RunError::Stopped(why, stage)) => {
                self.metrics.dropped.with_label_values(&[why.metric_label()]).inc();
                tracing::warn!(request_id = %job.id, reason = %why, %stage, "work abandoned");
                Err(job.stopped(why, stage))
            }
            Err(RunError::Engine(e)) => {
                tracing::error!(request_id = %job.id, "engine error: {e:#}");
                Err(JobError::Engine(e))
            }
        };
        let _ = job.reply.send(reply);
    }
}

/// The engine thread's loop: each round, the oldest waiting job and every job behind it that
/// still fits one packed forward with it ([`BatchLimits::one_forward`], [`BatchLimits::admits`]),
/// in arrival order, skipping those nobody waits for any more and refusing those past their
/// deadline. A job that does not fit waits for the next round, which it opens.
///
/// With [`BatchLimits::overlap_rounds`] on an engine that launches ahead (the GPU), the next
/// round is gathered and queued while the device still runs the current one — once that one is
/// halfway through its layers ([`runner::nearly_done_layer`]), so that the callers answered by
/// the round before have had time to send their next requests — and the current one is then
/// finished and answered: the device goes from one round to the next without waiting for the
/// host to read out, answer, gather and lay out. Only packed rounds without images are queued
/// ahead (vision and a request that runs alone wait for the device as they go: the round in
/// flight is finished before them, so its answers are not held back). Answers are the same bits
/// either way: rounds share nothing but the stream.
fn run_jobs(engine: Option<Box<dyn DecisionEngine>>, rx: Receiver<Job>, h: &Shared, limits: BatchLimits) {
    let mut next: Option<Job> = None;
    let mut flight = Flight::default();
    // The loop ends when every WorkerHandle (sender) is gone, the queue is drained and no round
    // is in flight.
    loop {
        if let (Some(engine), Some(r)) = (engine.as_ref(), flight.round.as_ref()) {
            engine.wait_nearly_done(&r.round);
        }
        // With a round in flight, an empty queue means: finish it (then wait for work).
        let first = match next.take() {
            Some(job) => Some(job),
            None if flight.round.is_some() => rx.try_recv().ok(),
            None => rx.recv().ok(),
        };
        let Some(first) = first else {
            match (engine.as_ref(), flight.round.take()) {
                (Some(engine), Some(r)) => flight.finish(engine.as_ref(), r, h),
                _ => break,
            }
            continue;
        };
        let Some(first) = h.admit(first) else { continue };
        let Some(engine) = engine.as_ref() else {
            let why = match h.status() {
                EngineStatus::Failed(e) => e,
                _ => "not loaded".into(),
            };
            let _ = first.reply.send(Err(JobError::NotLoaded(why)));
            continue;
        };
        let Some(first) = h.afford(engine.as_ref(), first) else { continue };
        // The first job's tree fits one forward: the round packs (else that job runs alone).
        let packed = limits.one_forward(&first.0.plan);
        let mut batch = vec![first];
        if let Some(mut used) = packed {
            // Everything already waiting that fits, in order; the first that does not fit
            // opens the next round.
            while let Ok(job) = rx.try_recv() {
                if job.stop_reason().is_some() {
                    h.admit(job);
                    continue;
                }
                match limits.one_forward(&job.plan) {
                    Some(size) if limits.admits(used, size) => {
                        used = used + size;
                        batch.extend(h.admit(job).and_then(|j| h.afford(engine.as_ref(), j)));
                    }
                    _ => {
                        next = Some(job);
                        break;
                    }
                }
            }
        }
        let ahead = limits.overlap_rounds
            && engine.launches_ahead()
            && packed.is_some()
            && batch.iter().all(|(j, _)| j.images.is_empty());
        if !ahead {
            if let Some(r) = flight.round.take() {
                flight.finish(engine.as_ref(), r, h);
            }
        }
        let launched = flight.launch(engine.as_ref(), batch, h, limits);
        if let Some(r) = flight.round.take() {
            flight.finish(engine.as_ref(), r, h);
        }
        if ahead {
            flight.round = Some(launched);
        } else {
            flight.finish(engine.as_ref(), launched, h);
        }
    }
    tracing::info!("engine thread: queue drained, stopping");
}

/// A launched round's jobs, what they were estimated to cost, and when it was launched.
struct LaunchedBatch {
    jobs: Vec<Job>,
    work: Vec<WorkEstimate>,
    round: Round,
    launched: Instant,
}

/// The rounds launched and not yet answered (at most one kept in flight) and the device's
/// bookkeeping across them.
#[derive(Default)]
struct Flight {
    round: Option<LaunchedBatch>,
    /// Jobs launched and not yet answered.
    running: usize,
    /// When the last finished round's results came in: a round launched before it began its
    /// device work then, not at its launch.
    last_finish: Option<Instant>,
}

impl Flight {
    /// Launches one round's jobs (one packed forward, or a job alone).
    fn launch(
        &mut self,
        engine: &dyn DecisionEngine,
        batch: Vec<(Job, WorkEstimate)>,
        h: &Shared,
        limits: BatchLimits,
    ) -> LaunchedBatch {
        let (jobs, work): (Vec<Job>, Vec<WorkEstimate>) = batch.into_iter().unzip();
        let launched = Instant::now();
        self.running += jobs.len();
        h.metrics.requests_running.set(self.running as i64);
        let images: Vec<Vec<&PatchedImage>> = jobs.iter().map(|j| j.images.iter().collect()).collect();
        let checks: Vec<_> = jobs.iter().map(|j| move || j.stop_reason().map_or(Ok(()), Err)).collect();
        let packed: Vec<PackedJob<'_>> = jobs
            .iter()
            .zip(&images)
            .zip(&checks)
            .map(|((j, imgs), check)| PackedJob { plan: &j.plan, images: imgs, keep_going: check })
            .collect();
        let round = engine.launch_round(&packed, limits);
        drop(packed);
        drop(checks);
        drop(images);
        LaunchedBatch { jobs, work, round, launched }
    }

    /// Waits for a launched round's results and answers each job.
    fn finish(&mut self, engine: &dyn DecisionEngine, launched: LaunchedBatch, h: &Shared) {
        let LaunchedBatch { jobs, work, round, launched } = launched;
        let mut results = engine.finish_round(round);
        let finished = Instant::now();
        // A round queued behind another began its device work when that one's results came in.
        let began = match self.last_finish {
            Some(t) if t > launched => t,
            _ => launched,
        };
        self.last_finish = Some(finished);
        let waited_ms = (began - launched).as_secs_f64() * 1e3;
        if waited_ms > 0.0 {
            for out in results.iter_mut().flatten() {
                out.questions_ms = (out.questions_ms - waited_ms).max(0.0);
            }
        }
        let secs = (finished - began).as_secs_f64();
        h.metrics.busy_seconds.inc_by(secs);
        h.metrics.batch_requests.observe(jobs.len() as f64);
        if jobs.len() > 1 {
            tracing::debug!(requests = jobs.len(), ms = secs * 1e3, "packed forward");
        }
        // Retry-After estimates from the time per request.
        let per_job_ms = secs * 1000.0 / jobs.len() as f64;
        let prev = h.avg_job_ms.load(Ordering::Relaxed) as f64;
        h.avg_job_ms.store((0.8 * prev + 0.2 * per_job_ms) as u64, Ordering::Relaxed);
        // Said before the answers go out, so that a scrape a client makes after its answer never
        // still counts it as running.
        self.running -= jobs.len();
        h.metrics.requests_running.set(self.running as i64);
        for ((job, work), result) in jobs.into_iter().zip(work).zip(results) {
            h.answer(job, work, result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::prompt::{PassPlan, ScoredKind, ScoredPlan, ScoredQuestion};
    use std::sync::mpsc::{channel, Receiver as StdReceiver};

    /// A plan tagged `tag` (its first prefix token) whose one-level tree is `tokens` tokens in
    /// `1 + passes` sequences.
    fn plan(tag: u32, tokens: usize, passes: usize) -> Plan {
        let suffix = 2;
        let prefix_tokens = tokens - passes * suffix;
        let question =
            ScoredQuestion { kind: ScoredKind::Boolean, text: "q".into(), candidates: vec![], owner: 0 };
        Plan {
            prefix: std::iter::once(tag).chain(std::iter::repeat_n(0, prefix_tokens - 1)).collect(),
            scored: vec![ScoredPlan {
                question,
                common: vec![],
                passes: (0..passes).map(|p| PassPlan { offset: p, suffix: vec![1; suffix] }).collect(),
                code_tokens: vec![],
            }],
            prefix_tokens,
            max_pass_tokens: prefix_tokens + suffix,
            processed_tokens: tokens,
        }
    }

    /// Records the tags of each call's jobs; each of the first `held` calls waits until it is
    /// released. Each job's one logit is its tag, so every reply can be matched to its job.
    struct Recorder {
        calls: Arc<Mutex<Vec<Vec<u32>>>>,
        release: Mutex<StdReceiver<()>>,
        held: usize,
    }

    impl Recorder {
        fn output(plan: &Plan, packed_with: usize) -> EngineOutput {
            EngineOutput {
                logits: vec![vec![vec![plan.prefix[0] as f32]]],
                packed_with,
                ..Default::default()
            }
        }
        fn record(&self, tags: Vec<u32>) {
            let hold = {
                let mut calls = self.calls.lock().unwrap();
                calls.push(tags);
                calls.len() <= self.held
            };
            if hold {
                self.release.lock().unwrap().recv().unwrap();
            }
        }
    }

    impl DecisionEngine for Recorder {
        fn run(
            &self,
            plan: &Plan,
            _: &[&PatchedImage],
            _: BatchLimits,
            _: &dyn Fn() -> Result<(), StopReason>,
        ) -> Result<EngineOutput, RunError> {
            self.record(vec![plan.prefix[0]]);
            Ok(Recorder::output(plan, 1))
        }
        fn run_packed(&self, jobs: &[PackedJob<'_>], _: BatchLimits) -> Vec<Result<EngineOutput, RunError>> {
            self.record(jobs.iter().map(|j| j.plan.prefix[0]).collect());
            jobs.iter().map(|j| Ok(Recorder::output(j.plan, jobs.len()))).collect()
        }
        fn backend_name(&self) -> String {
            "recorder".into()
        }
        fn readout_rows(&self) -> Option<usize> {
            None
        }
    }

    type Reply = oneshot::Receiver<Result<EngineOutput, JobError>>;

    fn submit(w: &WorkerHandle, plan: Plan, deadline_in: Duration) -> Reply {
        let (tx, rx) = oneshot::channel();
        let now = Instant::now();
        let job = Job {
            id: format!("job {}", plan.prefix[0]),
            plan: Arc::new(plan),
            images: vec![],
            deadline: now + deadline_in,
            timeout: deadline_in,
            enqueued: now,
            reply: tx,
        };
        w.submit(job).unwrap();
        rx
    }

    struct Fixture {
        calls: Arc<Mutex<Vec<Vec<u32>>>>,
        release: std::sync::mpsc::Sender<()>,
        metrics: Arc<EngineMetrics>,
        w: WorkerHandle,
        join: JoinHandle<()>,
    }

    /// A worker over a [`Recorder`] holding its first `held` calls, with a 100-token,
    /// 10-sequence budget.
    fn fixture(capacity: usize, held: usize) -> Fixture {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let (release, gate) = channel();
        let engine = Recorder { calls: calls.clone(), release: Mutex::new(gate), held };
        let registry = prometheus::Registry::new();
        let metrics = Arc::new(EngineMetrics::new(&registry).unwrap());
        let limits = BatchLimits { max_tokens: 100, max_sequences: 10, ..Default::default() };
        let (w, join) =
            spawn(move || Ok(Box::new(engine) as Box<dyn DecisionEngine>), capacity, limits, metrics.clone());
        Fixture { calls, release, metrics, w, join }
    }

    /// Waits until the engine has been called `n` times.
    fn wait_calls(calls: &Mutex<Vec<Vec<u32>>>, n: usize) {
        let t = Instant::now();
        while calls.lock().unwrap().len() < n {
            assert!(t.elapsed() < Duration::from_secs(10), "the engine never got call {n}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn waiting_jobs_are_packed_in_arrival_order_within_the_budget() {
        let Fixture { calls, release, metrics, w, join } = fixture(16, 1);
        let long = Duration::from_secs(60);
        let first = submit(&w, plan(1, 10, 2), long);
        // The engine holds the first job until released; everything below waits behind it.
        wait_calls(&calls, 1);
        assert_eq!((metrics.requests_running.get(), metrics.queue_capacity.get()), (1, 16));
        let mut replies = vec![(1, first)];
        replies.push((2, submit(&w, plan(2, 30, 2), long)));
        let gone = submit(&w, plan(99, 10, 1), long); // its caller leaves: skipped, never run
        drop(gone);
        replies.push((3, submit(&w, plan(3, 30, 3), long)));
        let late = submit(&w, plan(98, 10, 1), Duration::ZERO); // past its deadline: 504, never run
        replies.push((4, submit(&w, plan(4, 30, 3), long)));
        // 2 + 3 + 4 = 90 tokens in 3 + 4 + 4 = 11 sequences: 4 does not fit behind 2 and 3 (10
        // sequences at most) and opens the next round; 5 fits behind it; 6 alone is over the
        // budget and runs by itself; 7 after it.
        replies.push((5, submit(&w, plan(5, 60, 1), long)));
        replies.push((6, submit(&w, plan(6, 101, 1), long)));
        replies.push((7, submit(&w, plan(7, 5, 1), long)));
        assert_eq!(w.queue_depth(), 8);
        release.send(()).unwrap();
        for (tag, rx) in replies {
            let out = rx.blocking_recv().unwrap().unwrap();
            assert_eq!(out.logits, vec![vec![vec![tag as f32]]], "job {tag} got another job's answer");
        }
        assert!(matches!(
            late.blocking_recv().unwrap(),
            Err(JobError::Deadline { stage: Stage::Queued, .. })
        ));
        assert_eq!(*calls.lock().unwrap(), vec![vec![1], vec![2, 3], vec![4, 5], vec![6], vec![7]]);
        assert_eq!(w.queue_depth(), 0);
        assert_eq!(metrics.batch_requests.get_sample_count(), 5);
        assert_eq!(metrics.batch_requests.get_sample_sum(), 7.0);
        assert_eq!(metrics.dropped.with_label_values(&["disconnected"]).get(), 1);
        assert_eq!(metrics.dropped.with_label_values(&["deadline"]).get(), 1);
        drop(w);
        join.join().unwrap();
        assert_eq!(metrics.requests_running.get(), 0);
    }

    #[test]
    fn a_job_held_for_the_next_round_counts_against_the_queue() {
        let Fixture { calls, release, w, join, .. } = fixture(2, 2);
        let long = Duration::from_secs(60);
        let mut replies = vec![(1, submit(&w, plan(1, 10, 1), long))];
        wait_calls(&calls, 1);
        replies.push((2, submit(&w, plan(2, 60, 1), long)));
        replies.push((3, submit(&w, plan(3, 60, 1), long)));
        release.send(()).unwrap();
        // 2 runs; 3 does not fit behind it and is held for the next round, still waiting.
        wait_calls(&calls, 2);
        assert_eq!(w.queue_depth(), 1);
        replies.push((4, submit(&w, plan(4, 10, 1), long)));
        let (tx, _rx) = oneshot::channel();
        let now = Instant::now();
        let fifth = Job {
            id: "job 5".into(),
            plan: Arc::new(plan(5, 10, 1)),
            images: vec![],
            deadline: now + long,
            timeout: long,
            enqueued: now,
            reply: tx,
        };
        assert!(
            matches!(w.submit(fifth), Err(SubmitError::Full { capacity: 2, .. })),
            "3 and 4 fill the queue"
        );
        release.send(()).unwrap();
        for (tag, rx) in replies {
            assert_eq!(rx.blocking_recv().unwrap().unwrap().logits, vec![vec![vec![tag as f32]]]);
        }
        assert_eq!(*calls.lock().unwrap(), vec![vec![1], vec![2], vec![3, 4]]);
        drop(w);
        join.join().unwrap();
    }

    /// What a [`Launcher`] was asked, in order: launch, wait until nearly done, finish (each with
    /// the round's tags).
    #[derive(Debug, Clone, PartialEq)]
    enum Step {
        Launch(Vec<u32>),
        Nearly(Vec<u32>),
        Finish(Vec<u32>),
    }

    /// An engine that launches ahead, as the GPU does: a round's results come only when it is
    /// finished. Its first launch waits until released, so that the test can queue jobs behind it.
    struct Launcher {
        steps: Arc<Mutex<Vec<Step>>>,
        release: Mutex<StdReceiver<()>>,
    }

    impl DecisionEngine for Launcher {
        fn run(
            &self,
            _: &Plan,
            _: &[&PatchedImage],
            _: BatchLimits,
            _: &dyn Fn() -> Result<(), StopReason>,
        ) -> Result<EngineOutput, RunError> {
            unreachable!("the worker launches rounds")
        }
        fn launches_ahead(&self) -> bool {
            true
        }
        fn launch_round(&self, jobs: &[PackedJob<'_>], _: BatchLimits) -> Round {
            let tags: Vec<u32> = jobs.iter().map(|j| j.plan.prefix[0]).collect();
            let first = {
                let mut steps = self.steps.lock().unwrap();
                steps.push(Step::Launch(tags.clone()));
                steps.len() == 1
            };
            if first {
                self.release.lock().unwrap().recv().unwrap();
            }
            Round::launched(jobs.iter().map(|_| None).collect(), Some(Box::new(tags)))
        }
        fn wait_nearly_done(&self, round: &Round) {
            let tags = round.pending().and_then(|p| p.downcast_ref::<Vec<u32>>()).unwrap().clone();
            self.steps.lock().unwrap().push(Step::Nearly(tags));
        }
        fn finish_round(&self, round: Round) -> RoundResults {
            round.finish(|pending, results| {
                let tags = *pending.downcast::<Vec<u32>>().unwrap();
                for (slot, &tag) in results.iter_mut().zip(&tags) {
                    let out = EngineOutput {
                        logits: vec![vec![vec![tag as f32]]],
                        packed_with: tags.len(),
                        ..Default::default()
                    };
                    *slot = Some(Ok(out));
                }
                self.steps.lock().unwrap().push(Step::Finish(tags));
            })
        }
        fn backend_name(&self) -> String {
            "launcher".into()
        }
        fn readout_rows(&self) -> Option<usize> {
            None
        }
    }

    /// The steps a [`Launcher`] is asked for: job 1 launched (held), then 2 and 3 (one round),
    /// 4 with 5 (which has an image), 6 (alone, over the budget) and 7 queued behind it.
    fn launcher_steps(overlap_rounds: bool) -> Vec<Step> {
        let steps = Arc::new(Mutex::new(Vec::new()));
        let (release, gate) = channel();
        let engine = Launcher { steps: steps.clone(), release: Mutex::new(gate) };
        let registry = prometheus::Registry::new();
        let metrics = Arc::new(EngineMetrics::new(&registry).unwrap());
        let limits = BatchLimits { max_tokens: 100, max_sequences: 10, overlap_rounds, ..Default::default() };
        let (w, join) =
            spawn(move || Ok(Box::new(engine) as Box<dyn DecisionEngine>), 16, limits, metrics.clone());
        let long = Duration::from_secs(60);
        let mut replies = vec![(1, submit(&w, plan(1, 10, 1), long))];
        let t = Instant::now();
        while steps.lock().unwrap().is_empty() {
            assert!(t.elapsed() < Duration::from_secs(10), "the first round was never launched");
            std::thread::sleep(Duration::from_millis(5));
        }
        for (tag, tokens, passes) in [(2, 30, 2), (3, 30, 2), (4, 60, 1), (5, 10, 1), (6, 101, 1), (7, 10, 1)]
        {
            let p = plan(tag, tokens, passes);
            let (tx, rx) = oneshot::channel();
            let now = Instant::now();
            let images = if tag == 5 {
                vec![PatchedImage {
                    rgb: vec![0; 2 * 2 * 3],
                    lut: [[0.0; 256]; 3],
                    grid_thw: [1, 2, 2],
                    resized_hw: (2, 2),
                    patch_dim: 12,
                    patch_size: 1,
                    temporal_patch_size: 1,
                    merge_size: 1,
                }]
            } else {
                vec![]
            };
            let job = Job {
                id: format!("job {tag}"),
                plan: Arc::new(p),
                images,
                deadline: now + long,
                timeout: long,
                enqueued: now,
                reply: tx,
            };
            w.submit(job).unwrap();
            replies.push((tag, rx));
        }
        release.send(()).unwrap();
        for (tag, rx) in replies {
            let out = rx.blocking_recv().unwrap().unwrap();
            assert_eq!(out.logits, vec![vec![vec![tag as f32]]], "job {tag} got another job's answer");
        }
        drop(w);
        join.join().unwrap();
        assert_eq!(metrics.requests_running.get(), 0);
        assert_eq!(metrics.batch_requests.get_sample_count(), 5);
        let steps = steps.lock().unwrap().clone();
        steps
    }

    #[test]
    fn the_next_round_is_launched_before_the_one_in_flight_is_finished() {
        use Step::*;
        assert_eq!(
            launcher_steps(true),
            vec![
                Launch(vec![1]),
                Nearly(vec![1]),
                // 2 and 3 queued while 1 ran: launched behind it, then 1 read out and answered.
                Launch(vec![2, 3]),
                Finish(vec![1]),
                Nearly(vec![2, 3]),
                // 5 has an image: its vision would wait for the device, so 2 and 3 are answered
                // first; 6 runs alone (after 4 and 5 are answered); 7 is launched, and with
                // nothing queued behind it, finished.
                Finish(vec![2, 3]),
                Launch(vec![4, 5]),
                Finish(vec![4, 5]),
                Launch(vec![6]),
                Finish(vec![6]),
                Launch(vec![7]),
                Nearly(vec![7]),
                Finish(vec![7]),
            ]
        );
    }

    #[test]
    fn without_overlap_each_round_is_finished_before_the_next_is_launched() {
        use Step::*;
        let steps = launcher_steps(false);
        let expected: Vec<Step> = [vec![1], vec![2, 3], vec![4, 5], vec![6], vec![7]]
            .into_iter()
            .flat_map(|tags| [Launch(tags.clone()), Finish(tags)])
            .collect();
        assert_eq!(steps, expected);
    }
}
