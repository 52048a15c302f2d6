//! Runs decision [`Plan`]s on a model. A request whose tree fits one packed forward — vision once
//! per image, then the shared prefix and every (question, rotation) pass continuing it, with
//! [`QuestionTree::TwoLevel`] also each question's tokens shared by its rotations as a level
//! between them — is a segment tree of ONE forward, and the trees of several requests are packed
//! into one forward ([`DecisionEngine::run_packed`]). A request too large for that runs alone: the
//! shared prefix prefilled once, each question's common tokens once, then every pass as forks
//! extended in packed batches. Only the readout logits leave the engine.
//!
//! A request's tree is built from its plan alone and every backend op is batch-invariant, so its
//! logits do not depend on which requests share its forward.

use super::limits::{BatchLimits, QuestionTree};
use super::round::Round;
use crate::backend::{Backend, MemoryProbe};
use crate::decision::Plan;
use crate::engine::positions::SequenceLayout;
use crate::engine::{LayerMark, Qwen35, Segment, State};
use crate::image::PatchedImage;
use anyhow::{anyhow, ensure};
use std::time::Instant;

/// Readout logits of every pass (`logits[scored][pass]`, per scored question of the plan) and where the time went.
#[derive(Debug, Clone, Default)]
pub struct EngineOutput {
    pub logits: Vec<Vec<Vec<f32>>>,
    pub vision_ms: f64,
    pub prefill_ms: f64,
    /// Whether the vision tower ran for this request (it had images).
    pub vision_ran: bool,
    /// Whether the shared prefix ran as its own stage (the request ran alone, prefix first);
    /// in a packed forward it is fused with the passes and `prefill_ms` is 0.
    pub prefill_ran: bool,
    /// The forwards this request's run opened, in order. A packed forward shared by several
    /// requests is listed on the first of them only, so a round's outputs count each forward once.
    pub forwards: Vec<ForwardShape>,
    /// The passes' time; in a packed forward, that forward's (shared by its requests).
    pub questions_ms: f64,
    /// Tokens the engine ran for this request.
    pub tokens: usize,
    pub passes: usize,
    /// Requests in the forward that answered this one (1: it ran alone).
    pub packed_with: usize,
}

/// One forward of the model: how many sequences it ran and how many of them were passes
/// (read out); the others are prefixes and shared question tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForwardShape {
    pub sequences: usize,
    pub passes: usize,
}

/// Why a run stops before its end (checked between its steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StopReason {
    #[error("deadline passed")]
    Deadline,
    #[error("caller disconnected")]
    CallerGone,
}

/// Where a run was stopped: the first stage that did not run to its end. Logged with the request
/// id (`work abandoned …`) and named in the caller's 504, so a client and an operator both see
/// what was given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Still waiting in the queue: nothing ran.
    Queued,
    /// Taken from the queue, stopped before its first stage.
    Start,
    /// In the vision tower, after `block` of its `blocks` blocks.
    Vision { block: usize, blocks: usize },
    /// After vision, before the prefix (alone) or the packed forward ran.
    Prefill,
    /// In the forward of a prefix that runs alone, before layer `layer` of `layers`.
    PrefixLayers { layer: usize, layers: usize },
    /// After the prefix, between batches of question passes: `done` of `total` passes ran.
    Questions { done: usize, total: usize },
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stage::Queued => write!(f, "while queued (nothing ran)"),
            Stage::Start => write!(f, "before its first stage"),
            Stage::Vision { block, blocks } => {
                write!(f, "in the vision tower (after {block} of {blocks} blocks)")
            }
            Stage::Prefill => write!(f, "after vision, before the prompt's forward"),
            Stage::PrefixLayers { layer, layers } => {
                write!(f, "in the prompt's forward (after {layer} of {layers} layers)")
            }
            Stage::Questions { done, total } => {
                write!(f, "between question passes ({done} of {total} ran)")
            }
        }
    }
}

/// Every `reason` label of `imajev_jobs_dropped_total` (preinitialised at 0): `deadline` and
/// `disconnected` ([`StopReason`]), and `over_budget` — a job refused before it started because
/// its estimated engine time ([`WorkEstimate`]) does not fit its deadline.
pub const DROP_REASONS: [&str; 3] = ["deadline", "disconnected", "over_budget"];

impl StopReason {
    /// Every reason, so that each label of `imajev_jobs_dropped_total` exists (at 0) before the
    /// first drop. A new reason goes here too (the test below fails otherwise).
    pub const ALL: [StopReason; 2] = [StopReason::Deadline, StopReason::CallerGone];

    /// The `reason` label of `imajev_jobs_dropped_total`.
    pub fn metric_label(self) -> &'static str {
        match self {
            StopReason::Deadline => "deadline",
            StopReason::CallerGone => "disconnected",
        }
    }
}

/// What a request would cost the engine, in multiply-accumulates per stage (the worker turns it
/// into seconds with the rates it measures, and refuses work that cannot finish in time).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkEstimate {
    /// The vision tower: linear in the images' patches, quadratic in each image's.
    pub vision_macs: f64,
    /// The decoder over every token the request runs.
    pub decoder_macs: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The caller gave up (deadline passed or client gone) between two steps, at this stage.
    #[error("stopped {1}: {0}")]
    Stopped(StopReason, Stage),
    #[error(transparent)]
    Engine(#[from] anyhow::Error),
}

/// One request of a packed run.
pub struct PackedJob<'a> {
    pub plan: &'a Plan,
    pub images: &'a [&'a PatchedImage],
    /// Polled between steps; returns why to stop this request, if anything.
    pub keep_going: &'a dyn Fn() -> Result<(), StopReason>,
}

/// What the worker needs from a loaded model, independent of its backend.
pub trait DecisionEngine: Send {
    /// Runs a plan; `keep_going` is polled between steps and returns why to stop, if anything.
    fn run(
        &self,
        plan: &Plan,
        images: &[&PatchedImage],
        limits: BatchLimits,
        keep_going: &dyn Fn() -> Result<(), StopReason>,
    ) -> Result<EngineOutput, RunError>;
    /// Runs several requests, one result per job in order. Engines that pack (the model) run
    /// every job whose tree fits ([`BatchLimits::one_forward`]) in one forward; the others run
    /// alone. This default runs the jobs one after another.
    fn run_packed(&self, jobs: &[PackedJob<'_>], limits: BatchLimits) -> Vec<Result<EngineOutput, RunError>> {
        jobs.iter().map(|j| self.run(j.plan, j.images, limits, j.keep_going)).collect()
    }
    /// Whether [`DecisionEngine::launch_round`] returns while the device still runs the round's
    /// forward (the engine thread may then launch the next round before finishing this one).
    fn launches_ahead(&self) -> bool {
        false
    }
    /// [`DecisionEngine::run_packed`] as a launch: the jobs' packed forward queued, its results
    /// collected by [`DecisionEngine::finish_round`]. Jobs that run alone, and every job of an
    /// engine that does not launch ahead, have their results when this returns.
    fn launch_round(&self, jobs: &[PackedJob<'_>], limits: BatchLimits) -> Round {
        Round::done(self.run_packed(jobs, limits))
    }
    /// Waits until a launched round's device work is far enough along ([`nearly_done_layer`]) for
    /// the engine thread to gather the next round: late enough that the callers the round before
    /// answered have sent their next requests, early enough to queue it before this one ends.
    /// Returns at once when nothing is in flight.
    fn wait_nearly_done(&self, _round: &Round) {}
    /// The results of a launched round, one per job in order (waits for the device).
    fn finish_round(&self, round: Round) -> Vec<Result<EngineOutput, RunError>> {
        round.finish(|_, _| {})
    }
    /// What `plan` with `images` would cost ([`WorkEstimate`]); zero (always admitted) for
    /// engines that cannot say.
    fn estimate(&self, _plan: &Plan, _images: &[&PatchedImage]) -> WorkEstimate {
        WorkEstimate::default()
    }
    /// Seconds per vision multiply-accumulate, measured on a synthetic image once the model is
    /// loaded (`None`: no vision tower, or an engine that cannot say). It lets the first large
    /// image be refused before it holds the engine; measured requests refine it.
    fn calibrate_vision(&self) -> Option<f64> {
        None
    }
    /// Backend description for `/v1/models` and logs.
    fn backend_name(&self) -> String;
    /// The backend's short name (`cpu`, `cuda`) for `imajev_build_info`.
    fn backend_kind(&self) -> &'static str {
        "unknown"
    }
    fn readout_rows(&self) -> Option<usize>;
    /// Bytes of weights the engine holds (host or device, after conversion and quantisation),
    /// when it knows.
    fn weight_bytes(&self) -> Option<u64> {
        None
    }
    /// A reader of the device's memory, when the engine runs on one.
    fn memory_probe(&self) -> Option<MemoryProbe> {
        None
    }
}

/// The layer of a forward of `layers` before which its round counts as nearly done
/// ([`DecisionEngine::wait_nearly_done`]): half of them. The host then has the second half's device
/// time to gather, lay out and queue the next round — ~50 ms of a 16-client round, where queueing
/// a round's ~550 launches takes the host ~12 ms — while callers answered at the end of the round
/// before send their next requests within a few milliseconds of their answers, long before it.
pub fn nearly_done_layer(layers: usize) -> usize {
    layers / 2
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// What a segment of a packed forward runs for its job.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Part {
    Prefix,
    /// The shared tokens of one of the job's questions (index into [`JobLayouts::commons`]).
    Common(usize),
    /// One pass (index into [`JobLayouts::passes`]).
    Pass(usize),
}

/// One segment of a packed forward.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PackedSegment {
    job: usize,
    part: Part,
    parent: Option<usize>,
}

/// A job's `keep_going` as the `stop` a loop of steps asks before each step
/// (`encode_images_until`, `forward_until`): counts the steps it let start and keeps why it
/// stopped.
struct StopAsker<'a> {
    keep_going: &'a dyn Fn() -> Result<(), StopReason>,
    asked: std::cell::Cell<usize>,
    why: std::cell::Cell<Option<StopReason>>,
}

impl<'a> StopAsker<'a> {
    fn new(keep_going: &'a dyn Fn() -> Result<(), StopReason>) -> Self {
        StopAsker { keep_going, asked: std::cell::Cell::new(0), why: std::cell::Cell::new(None) }
    }
    /// Whether to stop before the next step.
    fn stop(&self) -> bool {
        match (self.keep_going)() {
            Ok(()) => {
                self.asked.set(self.asked.get() + 1);
                false
            }
            Err(r) => {
                self.why.set(Some(r));
                true
            }
        }
    }
    /// Steps let start before it said stop.
    fn asked(&self) -> usize {
        self.asked.get()
    }
    /// Why it said stop.
    fn why(&self) -> StopReason {
        self.why.get().unwrap_or(StopReason::Deadline)
    }
}

impl<B: Backend> Qwen35<B> {
    /// The vision tower over `images`, stopped between blocks when `keep_going` says so.
    fn vision_checked(
        &self,
        images: &[&PatchedImage],
        keep_going: &dyn Fn() -> Result<(), StopReason>,
    ) -> Result<Vec<B::Tensor>, RunError> {
        // Asked before every block: the blocks that ran are the questions answered so far.
        let asker = StopAsker::new(keep_going);
        let t = Instant::now();
        let stop = || asker.stop();
        match self.encode_images_until(images, &stop)? {
            Some(f) => {
                // The device finishes the tower before the stage ends, so that `vision_ms` (the
                // metrics, and the rates that cost admission learns) is its time, not the time
                // to queue it; one wait per request with images, whose tower runs for far longer.
                if !images.is_empty() {
                    self.backend.synchronize()?;
                }
                Ok(f)
            }
            None => {
                let stage = Stage::Vision { block: asker.asked(), blocks: self.config.vision_config.depth };
                tracing::debug!(reason = %asker.why(), %stage, ms = ms(t).round(), "vision abandoned between blocks");
                Err(RunError::Stopped(asker.why(), stage))
            }
        }
    }

    /// The layouts of one job's tree: its prefix, its questions' shared tokens (two-level trees)
    /// and its passes, each pass with the shared tokens it continues (`None`: the prefix).
    fn job_layouts(
        &self,
        plan: &Plan,
        images: &[&PatchedImage],
        tree: QuestionTree,
    ) -> anyhow::Result<JobLayouts> {
        let prefix = self.layout(&plan.prefix, images, 0)?;
        ensure!(
            prefix.ids.len() == plan.prefix_tokens,
            "the prefix lays out as {} tokens, the plan counted {}",
            prefix.ids.len(),
            plan.prefix_tokens
        );
        let mut commons = Vec::new();
        let mut passes = Vec::new();
        for (q, sp) in plan.scored.iter().enumerate() {
            let shared = tree == QuestionTree::TwoLevel && !sp.common.is_empty();
            let parent = if shared {
                commons.push(self.layout(&sp.common, &[], prefix.next_pos)?);
                Some(commons.len() - 1)
            } else {
                None
            };
            for (p, pass) in sp.passes.iter().enumerate() {
                let layout = match parent {
                    Some(c) => self.layout(&pass.suffix, &[], commons[c].next_pos)?,
                    None if sp.common.is_empty() => self.layout(&pass.suffix, &[], prefix.next_pos)?,
                    None => {
                        let ids = [sp.common.as_slice(), pass.suffix.as_slice()].concat();
                        self.layout(&ids, &[], prefix.next_pos)?
                    }
                };
                passes.push((q, p, parent, layout));
            }
        }
        Ok(JobLayouts { prefix, commons, passes })
    }

    /// The one-forward path of [`DecisionEngine::launch_round`]: every job of `which` fits one
    /// forward. Vision once per image (waited for), then the packed forward and its readout queued;
    /// `None` when nothing was queued (every job stopped or failed, its result in `results`).
    /// `paced` (a job alone, [`BatchLimits::alone_in_one_forward`]): the forward is paced and the
    /// job asked before every layer whether to go on, as a prefix that runs alone is.
    fn launch_one_forward(
        &self,
        jobs: &[PackedJob<'_>],
        limits: BatchLimits,
        results: &mut [Option<Result<EngineOutput, RunError>>],
        which: &[usize],
        paced: bool,
    ) -> Option<LaunchedForward<B>> {
        // Vision once per image, request by request (a request's features never depend on
        // another's), then a last look at each caller before the forward.
        let mut live: Vec<(usize, Vec<B::Tensor>, JobLayouts, EngineOutput)> = Vec::new();
        for &j in which {
            let job = &jobs[j];
            let prepared = (|| -> Result<_, RunError> {
                (job.keep_going)().map_err(|r| RunError::Stopped(r, Stage::Start))?;
                let t = Instant::now();
                let feats = self.vision_checked(job.images, job.keep_going)?;
                let out = EngineOutput {
                    vision_ms: ms(t),
                    vision_ran: !job.images.is_empty(),
                    ..Default::default()
                };
                let layouts = self.job_layouts(job.plan, job.images, limits.question_tree)?;
                (job.keep_going)().map_err(|r| RunError::Stopped(r, Stage::Prefill))?;
                Ok((feats, layouts, out))
            })();
            match prepared {
                Ok((feats, layouts, out)) => live.push((j, feats, layouts, out)),
                Err(e) => results[j] = Some(Err(e)),
            }
        }
        if live.is_empty() {
            return None;
        }
        let started = Instant::now();
        let layouts: Vec<&JobLayouts> = live.iter().map(|(_, _, l, _)| l).collect();
        let tree = packed_tree(&layouts);
        // The engine thread gathers the next round once the device reaches this layer.
        let layers = self.config.text_config.num_hidden_layers;
        let mut mark = LayerMark { layer: nearly_done_layer(layers), marker: None };
        // Paced, a job alone is asked before every layer (at most a layer behind the device).
        let asker = match &live[..] {
            [(j, ..)] if paced => Some(StopAsker::new(jobs[*j].keep_going)),
            _ => None,
        };
        let ask = || asker.as_ref().is_some_and(|a| a.stop());
        let stop: Option<&dyn Fn() -> bool> = if asker.is_some() { Some(&ask) } else { None };
        let queued = (|| -> anyhow::Result<Option<B::Readout>> {
            let segs: Vec<Segment<B>> = tree
                .iter()
                .map(|s| {
                    let (_, feats, l, _) = &live[s.job];
                    match s.part {
                        Part::Prefix => Segment { layout: &l.prefix, images: feats, parent: None },
                        Part::Common(c) => Segment { layout: &l.commons[c], images: &[], parent: s.parent },
                        Part::Pass(p) => Segment { layout: &l.passes[p].3, images: &[], parent: s.parent },
                    }
                })
                .collect();
            // Roots start from empty states; every other state is replaced by a fork of its
            // parent's inside the forward (until then, a fork of an empty one: nothing is
            // allocated for it).
            let empty = self.new_state()?;
            let mut states: Vec<State<B>> = Vec::with_capacity(segs.len());
            for s in &segs {
                states.push(if s.parent.is_none() { self.new_state()? } else { empty.fork() });
            }
            let mut refs: Vec<&mut State<B>> = states.iter_mut().collect();
            // Nothing continues these states after the forward: only the states the forward
            // itself continues (prefixes, shared question tokens) are finished.
            let Some(hidden) = self.forward_readout_marked(&segs, &mut refs, stop, &mut mark)? else {
                return Ok(None);
            };
            // Only the passes' rows are read out (not the prefixes' or the shared tokens').
            let rows: Vec<usize> =
                (0..tree.len()).filter(|&i| matches!(tree[i].part, Part::Pass(_))).collect();
            let hidden = self.backend.gather_rows(&hidden, &rows)?;
            self.readout_start(&hidden).map(Some)
        })();
        let readout = match queued {
            Ok(Some(r)) => r,
            Ok(None) => {
                // Only a paced forward stops, and it has one job.
                let asker = asker.as_ref().expect("only a paced forward stops");
                let stage = Stage::PrefixLayers { layer: asker.asked(), layers };
                tracing::debug!(reason = %asker.why(), %stage, "forward abandoned between layers");
                for (j, ..) in &live {
                    results[*j] = Some(Err(RunError::Stopped(asker.why(), stage)));
                }
                return None;
            }
            Err(e) => {
                for (j, ..) in &live {
                    results[*j] = Some(Err(RunError::Engine(anyhow!("{e:#}"))));
                }
                return None;
            }
        };
        let packed_with = live.len();
        let shape = ForwardShape {
            sequences: tree.len(),
            passes: tree.iter().filter(|s| matches!(s.part, Part::Pass(_))).count(),
        };
        let outs: Vec<(usize, EngineOutput)> = live
            .iter()
            .enumerate()
            .map(|(i, (j, _, l, out))| {
                let plan = jobs[*j].plan;
                let out = EngineOutput {
                    logits: plan.scored.iter().map(|sp| vec![Vec::new(); sp.passes.len()]).collect(),
                    tokens: l.tokens(),
                    passes: l.passes.len(),
                    packed_with,
                    // The shared forward is counted once, on the first request.
                    forwards: if i == 0 { vec![shape] } else { Vec::new() },
                    ..out.clone()
                };
                (*j, out)
            })
            .collect();
        let rows = tree
            .iter()
            .filter_map(|s| match s.part {
                Part::Pass(p) => {
                    let (q, pass, ..) = layouts[s.job].passes[p];
                    Some((s.job, q, pass))
                }
                _ => None,
            })
            .collect();
        Some(LaunchedForward { outs, rows, readout, nearly_done: mark.marker, started })
    }

    /// Collects a [`Qwen35::launch_one_forward`]: waits for its readout and puts each pass's
    /// logits in its job's result.
    fn finish_one_forward(
        &self,
        launched: LaunchedForward<B>,
        results: &mut [Option<Result<EngineOutput, RunError>>],
    ) {
        let LaunchedForward { mut outs, rows, readout, started, .. } = launched;
        let logits = match self.readout_finish(readout) {
            Ok(l) => l,
            Err(e) => {
                for (j, _) in &outs {
                    results[*j] = Some(Err(RunError::Engine(anyhow!("{e:#}"))));
                }
                return;
            }
        };
        let questions_ms = ms(started);
        for ((i, q, pass), l) in rows.into_iter().zip(logits) {
            outs[i].1.logits[q][pass] = l;
        }
        for (j, mut out) in outs {
            out.questions_ms = questions_ms;
            results[j] = Some(Ok(out));
        }
    }

    /// A request too large for one packed forward: the prefix prefilled once, each question's
    /// shared tokens once when that saves enough, then every pass as forks extended in batches.
    fn run_alone(
        &self,
        plan: &Plan,
        images: &[&PatchedImage],
        limits: BatchLimits,
        keep_going: &dyn Fn() -> Result<(), StopReason>,
    ) -> Result<EngineOutput, RunError> {
        keep_going().map_err(|r| RunError::Stopped(r, Stage::Start))?;
        let mut out = EngineOutput { packed_with: 1, ..Default::default() };
        let t = Instant::now();
        let feats = self.vision_checked(images, keep_going)?;
        out.vision_ms = ms(t);
        out.vision_ran = !images.is_empty();
        keep_going().map_err(|r| RunError::Stopped(r, Stage::Prefill))?;

        let layout = self.layout(&plan.prefix, images, 0)?;
        // Per scored question: the prefix state extended with the tokens all its passes share — when that
        // saves enough work; otherwise those tokens stay at the front of every pass's suffix.
        let saved: usize =
            plan.scored.iter().map(|q| q.common.len() * q.passes.len().saturating_sub(1)).sum();
        let share_commons = saved >= limits.min_shared_tokens;
        // Every pass (scored question q, pass p) and the tokens it runs after its question's state.
        let passes: Vec<(usize, usize)> = plan
            .scored
            .iter()
            .enumerate()
            .flat_map(|(q, sp)| (0..sp.passes.len()).map(move |p| (q, p)))
            .collect();
        let suffix: Vec<std::borrow::Cow<'_, [u32]>> = passes
            .iter()
            .map(|&(q, p)| {
                let sp = &plan.scored[q];
                if share_commons || sp.common.is_empty() {
                    std::borrow::Cow::Borrowed(sp.passes[p].suffix.as_slice())
                } else {
                    std::borrow::Cow::Owned([sp.common.as_slice(), sp.passes[p].suffix.as_slice()].concat())
                }
            })
            .collect();
        out.logits = plan.scored.iter().map(|sp| vec![Vec::new(); sp.passes.len()]).collect();

        let t = Instant::now();
        let mut prefix = self.new_state()?;
        // Asked before every layer (paced: the device is at most a layer behind the question).
        let asker = StopAsker::new(keep_going);
        let segment = Segment { layout: &layout, images: &feats, parent: None };
        if self.forward_until(&[segment], &mut [&mut prefix], &|| asker.stop())?.is_none() {
            let layers = self.config.text_config.num_hidden_layers;
            return Err(RunError::Stopped(asker.why(), Stage::PrefixLayers { layer: asker.asked(), layers }));
        }
        prefix.share(&self.backend)?;
        // As after the vision tower: `prefill_ms` is the device's time for the prefix.
        self.backend.synchronize()?;
        out.tokens += layout.ids.len();
        out.prefill_ms = ms(t);
        out.prefill_ran = true;
        out.forwards.push(ForwardShape { sequences: 1, passes: 0 });
        let total = passes.len();
        let stopped = |done: usize| move |r| RunError::Stopped(r, Stage::Questions { done, total });
        keep_going().map_err(stopped(0))?;

        let t = Instant::now();
        let mut question_states: Vec<Option<State<B>>> = (0..plan.scored.len()).map(|_| None).collect();
        let with_common: Vec<usize> = if share_commons {
            (0..plan.scored.len()).filter(|&i| !plan.scored[i].common.is_empty()).collect()
        } else {
            Vec::new()
        };
        for chunk in batches(&with_common, |&i| plan.scored[i].common.len(), limits) {
            let mut states: Vec<State<B>> = chunk.iter().map(|_| prefix.fork()).collect();
            let suffixes: Vec<&[u32]> = chunk.iter().map(|&i| plan.scored[i].common.as_slice()).collect();
            self.extend(&mut states, &suffixes)?;
            out.forwards.push(ForwardShape { sequences: chunk.len(), passes: 0 });
            out.tokens += suffixes.iter().map(|s| s.len()).sum::<usize>();
            for (&i, mut s) in chunk.iter().zip(states) {
                s.share(&self.backend)?;
                question_states[i] = Some(s);
            }
            keep_going().map_err(stopped(0))?;
        }
        // Every pass: a fork of its question's state, extended with its suffix.
        let mut prof = crate::engine::profile::StageTimer::start(&self.backend);
        let indices: Vec<usize> = (0..passes.len()).collect();
        for chunk in batches(&indices, |&i| suffix[i].len(), limits) {
            let mut states: Vec<State<B>> = chunk
                .iter()
                .map(|&i| question_states[passes[i].0].as_ref().unwrap_or(&prefix).fork())
                .collect();
            prof.mark(&self.backend, "fork");
            let suffixes: Vec<&[u32]> = chunk.iter().map(|&i| suffix[i].as_ref()).collect();
            let hidden = self.extend_readout(&mut states, &suffixes)?;
            out.forwards.push(ForwardShape { sequences: chunk.len(), passes: chunk.len() });
            prof.mark(&self.backend, "extend");
            let logits = self.readout(&hidden)?;
            prof.mark(&self.backend, "readout");
            out.tokens += suffixes.iter().map(|s| s.len()).sum::<usize>();
            for (&i, l) in chunk.iter().zip(logits) {
                let (q, p) = passes[i];
                out.logits[q][p] = l;
            }
            out.passes += chunk.len();
            if out.passes < total {
                keep_going().map_err(stopped(out.passes))?;
            }
        }
        out.questions_ms = ms(t);
        prof.report("question passes", out.passes);
        Ok(out)
    }
}

/// A packed forward queued on the device ([`Qwen35::launch_one_forward`]).
struct LaunchedForward<B: Backend> {
    /// Per job in the forward: its index in the round and its output, all but the logits' values.
    outs: Vec<(usize, EngineOutput)>,
    /// Per read-out row, in order: (index into `outs`, scored question, pass).
    rows: Vec<(usize, usize, usize)>,
    readout: B::Readout,
    /// In the device's queue before layer [`nearly_done_layer`].
    nearly_done: Option<B::Marker>,
    /// When the forward began to be queued.
    started: Instant,
}

/// One job's layouts in a packed forward.
struct JobLayouts {
    prefix: SequenceLayout,
    /// With [`QuestionTree::TwoLevel`]: the shared tokens of each question that has some.
    commons: Vec<SequenceLayout>,
    /// `(scored question, pass, common it continues, layout)`.
    passes: Vec<(usize, usize, Option<usize>, SequenceLayout)>,
}

impl JobLayouts {
    fn tokens(&self) -> usize {
        self.prefix.ids.len()
            + self.commons.iter().map(|l| l.ids.len()).sum::<usize>()
            + self.passes.iter().map(|p| p.3.ids.len()).sum::<usize>()
    }
}

/// The segments of a packed forward: every job's prefix, its questions' shared tokens and the
/// passes that continue the prefix (job by job), then every pass that continues shared tokens —
/// so that each mixer call of a two-level tree reads one contiguous block of rows.
fn packed_tree(jobs: &[&JobLayouts]) -> Vec<PackedSegment> {
    let mut first = Vec::new();
    let mut second = Vec::new();
    for (job, l) in jobs.iter().enumerate() {
        let root = first.len();
        first.push(PackedSegment { job, part: Part::Prefix, parent: None });
        for c in 0..l.commons.len() {
            first.push(PackedSegment { job, part: Part::Common(c), parent: Some(root) });
        }
        for (p, (_, _, common, _)) in l.passes.iter().enumerate() {
            match common {
                None => first.push(PackedSegment { job, part: Part::Pass(p), parent: Some(root) }),
                Some(c) => {
                    second.push(PackedSegment { job, part: Part::Pass(p), parent: Some(root + 1 + c) })
                }
            }
        }
    }
    first.extend(second);
    first
}

impl<B: Backend> DecisionEngine for Qwen35<B> {
    fn run(
        &self,
        plan: &Plan,
        images: &[&PatchedImage],
        limits: BatchLimits,
        keep_going: &dyn Fn() -> Result<(), StopReason>,
    ) -> Result<EngineOutput, RunError> {
        let job = PackedJob { plan, images, keep_going };
        self.run_packed(std::slice::from_ref(&job), limits).pop().expect("one result per job")
    }

    fn run_packed(&self, jobs: &[PackedJob<'_>], limits: BatchLimits) -> Vec<Result<EngineOutput, RunError>> {
        let round = self.launch_round(jobs, limits);
        self.finish_round(round)
    }

    fn launches_ahead(&self) -> bool {
        self.backend.queues_work()
    }

    fn launch_round(&self, jobs: &[PackedJob<'_>], limits: BatchLimits) -> Round {
        let mut results: Vec<Option<Result<EngineOutput, RunError>>> = jobs.iter().map(|_| None).collect();
        let (fit, alone): (Vec<usize>, Vec<usize>) =
            (0..jobs.len()).partition(|&j| limits.one_forward(jobs[j].plan).is_some());
        let launched = if fit.is_empty() {
            None
        } else {
            self.launch_one_forward(jobs, limits, &mut results, &fit, false)
        };
        for j in alone {
            let job = &jobs[j];
            if limits.alone_in_one_forward(job.plan) {
                if let Some(one) = self.launch_one_forward(jobs, limits, &mut results, &[j], true) {
                    self.finish_one_forward(one, &mut results);
                }
            } else {
                results[j] = Some(self.run_alone(job.plan, job.images, limits, job.keep_going));
            }
        }
        Round::launched(results, launched.map(|l| Box::new(l) as Box<dyn std::any::Any>))
    }

    fn wait_nearly_done(&self, round: &Round) {
        let launched = round.pending().and_then(|p| p.downcast_ref::<LaunchedForward<B>>());
        if let Some(marker) = launched.and_then(|l| l.nearly_done.as_ref()) {
            // An error here surfaces again when the round is finished.
            let _ = self.backend.wait_marker(marker);
        }
    }

    fn finish_round(&self, round: Round) -> Vec<Result<EngineOutput, RunError>> {
        round.finish(|pending, results| match pending.downcast::<LaunchedForward<B>>() {
            Ok(launched) => self.finish_one_forward(*launched, results),
            Err(_) => tracing::error!("a round launched by another engine cannot be finished by this one"),
        })
    }

    fn estimate(&self, plan: &Plan, images: &[&PatchedImage]) -> WorkEstimate {
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        WorkEstimate {
            vision_macs: if images.is_empty() { 0.0 } else { self.vision_macs(&grids) },
            decoder_macs: self.decoder_macs(plan.processed_tokens),
        }
    }

    fn calibrate_vision(&self) -> Option<f64> {
        let vc = &self.config.vision_config;
        // 32 × 32 patches (a 512 × 512 image): long enough to time, short enough for any load.
        let side = 32 * vc.spatial_merge_size.max(1) / 2;
        let img = PatchedImage {
            rgb: vec![0; side * side * vc.patch_size * vc.patch_size * 3],
            lut: [[0.0; 256]; 3],
            grid_thw: [1, side, side],
            resized_hw: (side * vc.patch_size, side * vc.patch_size),
            patch_dim: vc.patch_dim(),
            patch_size: vc.patch_size,
            temporal_patch_size: vc.temporal_patch_size,
            merge_size: vc.spatial_merge_size,
        };
        let t = Instant::now();
        self.encode_images(&[&img]).ok()?;
        let secs = t.elapsed().as_secs_f64();
        Some(secs / self.vision_macs(&[img.grid_thw]).max(1.0))
    }

    fn backend_name(&self) -> String {
        self.backend.describe()
    }

    fn readout_rows(&self) -> Option<usize> {
        Qwen35::readout_rows(self)
    }

    fn backend_kind(&self) -> &'static str {
        self.backend.kind()
    }

    fn weight_bytes(&self) -> Option<u64> {
        Some(self.report.weight_bytes)
    }

    fn memory_probe(&self) -> Option<MemoryProbe> {
        self.backend.memory_probe()
    }
}

/// Splits items into consecutive batches within the limits (an item larger than the token
/// limit gets a batch of its own).
fn batches<T: Copy>(items: &[T], tokens: impl Fn(&T) -> usize, limits: BatchLimits) -> Vec<Vec<T>> {
    let mut out: Vec<Vec<T>> = Vec::new();
    let mut cur: Vec<T> = Vec::new();
    let mut cur_tokens = 0;
    for it in items {
        let n = tokens(it);
        if !cur.is_empty() && (cur.len() >= limits.max_sequences.max(1) || cur_tokens + n > limits.max_tokens)
        {
            out.push(std::mem::take(&mut cur));
            cur_tokens = 0;
        }
        cur.push(*it);
        cur_tokens += n;
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stop_reason_is_listed_once() {
        // A reason missing from ALL would have no preinitialised label: the match makes a new
        // variant fail to compile here until it is counted.
        let listed = |r: StopReason| match r {
            StopReason::Deadline | StopReason::CallerGone => StopReason::ALL.contains(&r),
        };
        assert!(listed(StopReason::Deadline) && listed(StopReason::CallerGone));
        let mut labels: Vec<&str> = StopReason::ALL.iter().map(|r| r.metric_label()).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), StopReason::ALL.len());
        // ... and every stop reason's label is among the preinitialised drop reasons.
        for r in StopReason::ALL {
            assert!(DROP_REASONS.contains(&r.metric_label()), "{} not in DROP_REASONS", r.metric_label());
        }
    }

    #[test]
    fn batches_respect_limits() {
        let items: Vec<usize> = vec![3, 3, 3, 10, 1, 1];
        let limits = BatchLimits { max_tokens: 7, max_sequences: 2, ..Default::default() };
        let b = batches(&items, |&n| n, limits);
        assert_eq!(b, vec![vec![3, 3], vec![3], vec![10], vec![1, 1]]);
    }
}
