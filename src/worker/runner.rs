//! Runs a decision [`Plan`] on a model: vision once per image, then — when the prefix and every
//! (question, rotation) pass fit one packed batch — ONE forward in which every pass continues the
//! prefix; otherwise the shared prefix prefilled once, each question's common tokens once, then
//! every pass as forks extended in packed batches. Only the readout logits leave the engine.

use crate::backend::Backend;
use crate::decision::Plan;
use crate::engine::{Qwen35, State};
use crate::image::PatchedImage;
use std::time::Instant;

/// How passes are grouped into packed forwards.
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    /// Most suffix tokens in one packed forward.
    pub max_tokens: usize,
    /// Most sequences (forks) in one packed forward.
    pub max_sequences: usize,
    /// Prefill each question's shared tokens once only when that saves at least this many
    /// tokens overall; below it the extra forward (a fixed cost of launches on a GPU) costs more
    /// than recomputing those tokens in every pass.
    pub min_shared_tokens: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits { max_tokens: 8192, max_sequences: 64, min_shared_tokens: 1024 }
    }
}

/// Readout logits of every pass (`logits[scored][pass]`, per scored question of the plan) and where the time went.
#[derive(Debug, Clone, Default)]
pub struct EngineOutput {
    pub logits: Vec<Vec<Vec<f32>>>,
    pub vision_ms: f64,
    pub prefill_ms: f64,
    pub questions_ms: f64,
    pub tokens: usize,
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

impl StopReason {
    /// The `reason` label of `imajev_jobs_dropped_total`.
    pub fn metric_label(self) -> &'static str {
        match self {
            StopReason::Deadline => "deadline",
            StopReason::CallerGone => "disconnected",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The caller gave up (deadline passed or client gone) between two steps.
    #[error("stopped: {0}")]
    Stopped(StopReason),
    #[error(transparent)]
    Engine(#[from] anyhow::Error),
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
    /// Backend description for `/v1/models` and logs.
    fn backend_name(&self) -> String;
    fn readout_rows(&self) -> Option<usize>;
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

impl<B: Backend> DecisionEngine for Qwen35<B> {
    fn run(
        &self,
        plan: &Plan,
        images: &[&PatchedImage],
        limits: BatchLimits,
        keep_going: &dyn Fn() -> Result<(), StopReason>,
    ) -> Result<EngineOutput, RunError> {
        let mut out = EngineOutput::default();
        let t = Instant::now();
        let feats = self.encode_images(images)?;
        out.vision_ms = ms(t);
        keep_going().map_err(RunError::Stopped)?;

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

        // When every pass fits in one packed forward together with the prefix, the prefix and
        // the passes that continue it are that one forward (no separate prefill: one pass over
        // the weights and one set of launches instead of two).
        let pass_tokens: usize = suffix.iter().map(|s| s.len()).sum();
        if !share_commons
            && !passes.is_empty()
            && layout.ids.len() + pass_tokens <= limits.max_tokens
            && passes.len() < limits.max_sequences
        {
            let t = Instant::now();
            let suffixes: Vec<&[u32]> = suffix.iter().map(|s| s.as_ref()).collect();
            let (_, hidden) = self.prefill_extend(&layout, &feats, &suffixes)?;
            // Row 0 is the prefix's last token: not a pass.
            let logits = self.readout(&hidden)?;
            for (&(q, p), l) in passes.iter().zip(logits.into_iter().skip(1)) {
                out.logits[q][p] = l;
            }
            out.tokens += layout.ids.len() + pass_tokens;
            out.passes = passes.len();
            out.questions_ms = ms(t);
            return Ok(out);
        }

        let t = Instant::now();
        let mut prefix = self.new_state()?;
        self.forward(
            &[crate::engine::Segment { layout: &layout, images: &feats, parent: None }],
            &mut [&mut prefix],
        )?;
        prefix.share(&self.backend)?;
        out.tokens += layout.ids.len();
        out.prefill_ms = ms(t);
        keep_going().map_err(RunError::Stopped)?;

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
            out.tokens += suffixes.iter().map(|s| s.len()).sum::<usize>();
            for (&i, mut s) in chunk.iter().zip(states) {
                s.share(&self.backend)?;
                question_states[i] = Some(s);
            }
            keep_going().map_err(RunError::Stopped)?;
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
            let hidden = self.extend(&mut states, &suffixes)?;
            prof.mark(&self.backend, "extend");
            let logits = self.readout(&hidden)?;
            prof.mark(&self.backend, "readout");
            out.tokens += suffixes.iter().map(|s| s.len()).sum::<usize>();
            for (&i, l) in chunk.iter().zip(logits) {
                let (q, p) = passes[i];
                out.logits[q][p] = l;
            }
            out.passes += chunk.len();
            keep_going().map_err(RunError::Stopped)?;
        }
        out.questions_ms = ms(t);
        prof.report("question passes", out.passes);
        Ok(out)
    }

    fn backend_name(&self) -> String {
        self.backend.describe()
    }

    fn readout_rows(&self) -> Option<usize> {
        Qwen35::readout_rows(self)
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
    fn batches_respect_limits() {
        let items: Vec<usize> = vec![3, 3, 3, 10, 1, 1];
        let b =
            batches(&items, |&n| n, BatchLimits { max_tokens: 7, max_sequences: 2, min_shared_tokens: 0 });
        assert_eq!(b, vec![vec![3, 3], vec![3], vec![10], vec![1, 1]]);
    }
}
