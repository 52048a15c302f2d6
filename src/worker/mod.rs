//! The one engine thread. HTTP handlers never touch the model: they plan a request, submit it
//! to a bounded queue and await a oneshot reply. A full queue is refused at once (529 with
//! Retry-After); a job whose caller went away or whose deadline passed is dropped before it costs
//! compute (and between batches while it runs); on shutdown every accepted job is finished.
//! Jobs run one at a time, so one caller can never change another's answers.

pub mod metrics;
pub mod runner;

pub use metrics::EngineMetrics;
pub use runner::{BatchLimits, DecisionEngine, EngineOutput, RunError, StopReason};

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
    #[error("the request's deadline of {0:?} passed before it finished")]
    Deadline(Duration),
    #[error("the caller disconnected")]
    Cancelled,
    #[error("the engine failed: {0:#}")]
    Engine(anyhow::Error),
    #[error("the model failed to load: {0}")]
    NotLoaded(String),
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

    /// The reply for a job stopped for `why` (nobody reads it when the caller is gone).
    fn stopped(&self, why: StopReason) -> JobError {
        match why {
            StopReason::Deadline => JobError::Deadline(self.timeout),
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
        // Count before sending so the worker's decrement can never run first.
        self.depth.fetch_add(1, Ordering::SeqCst);
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
    };
    let join = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let started = Instant::now();
            let engine = match load() {
                Ok(e) => {
                    let backend = e.backend_name();
                    let load_seconds = started.elapsed().as_secs_f64();
                    // Seconds to 0.01 in the log; the status keeps the exact value.
                    let seconds = (load_seconds * 100.0).round() / 100.0;
                    tracing::info!(%backend, load_seconds = seconds, "model loaded");
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
            run_jobs(engine, rx, &h, limits);
        })
        .expect("spawning the engine thread");
    (handle, join)
}

/// The engine thread's view of the shared counters (no sender, so it cannot keep the queue open).
struct Shared {
    depth: Arc<AtomicUsize>,
    avg_job_ms: Arc<AtomicU64>,
    status: Arc<Mutex<EngineStatus>>,
    metrics: Arc<EngineMetrics>,
}

impl Shared {
    fn status(&self) -> EngineStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or(EngineStatus::Failed("status lock poisoned".into()))
    }
}

/// The engine thread's loop: runs queued jobs one at a time, in arrival order, skipping those
/// nobody waits for any more and refusing those past their deadline.
fn run_jobs(engine: Option<Box<dyn DecisionEngine>>, rx: Receiver<Job>, h: &Shared, limits: BatchLimits) {
    // The loop ends when every WorkerHandle (sender) is gone and the queue is drained.
    while let Ok(job) = rx.recv() {
        let depth = h.depth.fetch_sub(1, Ordering::SeqCst).saturating_sub(1);
        h.metrics.queue_depth.set(depth as i64);
        let waited = job.enqueued.elapsed();
        h.metrics.queue_seconds.observe(waited.as_secs_f64());
        if let Some(why) = job.stop_reason() {
            h.metrics.dropped.with_label_values(&[why.metric_label()]).inc();
            match why {
                StopReason::CallerGone => {
                    tracing::info!(request_id = %job.id, "caller left while queued; skipped")
                }
                StopReason::Deadline => {
                    let error = job.stopped(why);
                    let _ = job.reply.send(Err(error));
                }
            }
            continue;
        }
        let Some(engine) = engine.as_ref() else {
            let status = h.status();
            let why = match status {
                EngineStatus::Failed(e) => e,
                _ => "not loaded".into(),
            };
            let _ = job.reply.send(Err(JobError::NotLoaded(why)));
            continue;
        };
        let started = Instant::now();
        let images: Vec<&PatchedImage> = job.images.iter().collect();
        let keep_going = || job.stop_reason().map_or(Ok(()), Err);
        let result = engine.run(&job.plan, &images, limits, &keep_going);
        let secs = started.elapsed().as_secs_f64();
        let prev = h.avg_job_ms.load(Ordering::Relaxed) as f64;
        h.avg_job_ms.store((0.8 * prev + 0.2 * secs * 1000.0) as u64, Ordering::Relaxed);
        let reply = match result {
            Ok(out) => {
                h.metrics.record(&out);
                Ok(out)
            }
            Err(RunError::Stopped(why)) => {
                h.metrics.dropped.with_label_values(&[why.metric_label()]).inc();
                Err(job.stopped(why))
            }
            Err(RunError::Engine(e)) => {
                tracing::error!(request_id = %job.id, "engine error: {e:#}");
                Err(JobError::Engine(e))
            }
        };
        let _ = job.reply.send(reply);
    }
    tracing::info!("engine thread: queue drained, stopping");
}
