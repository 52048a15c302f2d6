//! Decisions: the imajev prompt layout to the byte, option codes, rotation plans, combining
//! rotations, calibration and the answer math. Knows nothing about tensors or HTTP: it turns a
//! validated [`DecisionRequest`] into a [`Plan`] of token sequences, and readout logits back
//! into answers.

pub mod answer;
pub mod calibration;
pub mod codebook;
pub mod outcome;
pub mod prompt;
pub mod pyjson;
pub mod request;

pub use calibration::Calibration;
pub use codebook::Codebook;
pub use prompt::Plan;
pub use request::{ContractMode, DecisionRequest, Question, QuestionKind, RequestImage};

use crate::tokenizer::QwenTokenizer;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// Settings that change answers.
#[derive(Debug, Clone)]
pub struct DecisionSettings {
    /// Option orders averaged per question (imajev `--rotations`).
    pub rotations: usize,
    pub calibration: Option<Calibration>,
    pub mode: ContractMode,
    /// Longest processed pass (image tokens included) a request may need.
    pub max_input_tokens: usize,
    /// Reported as the response's `model`.
    pub model_name: String,
}

/// Why a valid-looking request cannot be planned.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("the request needs {got} processed tokens in its longest pass (image tokens included); the limit is {limit} (--max-input-tokens). Shorten the state, the question or the options, or send a smaller image")]
    TooManyTokens { got: usize, limit: usize },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

/// Wall-clock parts of a request, for `usage`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timings {
    pub vision_ms: f64,
    pub prefill_ms: f64,
    pub questions_ms: f64,
    pub total_ms: f64,
}

/// The decision layer of one served adapter.
pub struct Decider {
    pub tokenizer: Arc<QwenTokenizer>,
    pub codebook: Codebook,
    pub settings: DecisionSettings,
}

impl Decider {
    pub fn new(tokenizer: Arc<QwenTokenizer>, codebook: Codebook, settings: DecisionSettings) -> Self {
        Decider { tokenizer, codebook, settings }
    }

    /// Options a choice may have: unknown takes the code after the last option.
    pub fn max_options(&self) -> usize {
        self.codebook.len().saturating_sub(1)
    }

    pub fn plan(&self, req: &DecisionRequest) -> Result<Plan, PlanError> {
        let image_tokens: Vec<usize> = req.images.iter().map(|i| i.tokens).collect();
        for q in prompt::scored_questions(req) {
            if q.candidates.len() > self.codebook.len() {
                return Err(PlanError::Invalid(format!(
                    "a question has {} options; this adapter's readout allows at most {}",
                    q.option_count(),
                    self.max_options()
                )));
            }
        }
        let plan =
            prompt::plan(req, &self.tokenizer, &self.codebook, self.settings.rotations, &image_tokens)?;
        if plan.max_pass_tokens > self.settings.max_input_tokens {
            return Err(PlanError::TooManyTokens {
                got: plan.max_pass_tokens,
                limit: self.settings.max_input_tokens,
            });
        }
        Ok(plan)
    }

    /// Outcomes per scored question from readout logits (`logits[scored][pass]`), calibrated if
    /// configured.
    pub fn outcomes(
        &self,
        req: &DecisionRequest,
        plan: &Plan,
        logits: &[Vec<Vec<f32>>],
    ) -> Vec<outcome::Outcome> {
        let photo_only = !req.images.is_empty() && req.state_is_empty();
        plan.scored
            .iter()
            .zip(logits)
            .map(|(sp, l)| {
                let o = outcome::combine(sp, l);
                match &self.settings.calibration {
                    Some(c) => outcome::calibrate(o, sp.question.kind, c, !req.images.is_empty(), photo_only),
                    None => o,
                }
            })
            .collect()
    }

    /// The full response body.
    pub fn respond(&self, req: &DecisionRequest, plan: &Plan, logits: &[Vec<Vec<f32>>], t: Timings) -> Value {
        self.respond_with(req, plan, &self.outcomes(req, plan, logits), t)
    }

    /// The full response body from the request's outcomes ([`Decider::outcomes`]).
    pub fn respond_with(
        &self,
        req: &DecisionRequest,
        plan: &Plan,
        outcomes: &[outcome::Outcome],
        t: Timings,
    ) -> Value {
        let scored: Vec<prompt::ScoredQuestion> = plan.scored.iter().map(|q| q.question.clone()).collect();
        let answers = answer::answers(req, &scored, outcomes, self.settings.mode);
        let images: Vec<Value> = req
            .images
            .iter()
            .map(|i| json!({"sha256": i.sha256, "width": i.width, "height": i.height}))
            .collect();
        let mut usage = Map::new();
        usage.insert("input_tokens".into(), json!(plan.max_pass_tokens));
        usage.insert("output_tokens".into(), json!(0));
        usage.insert("processed_tokens".into(), json!(plan.processed_tokens));
        usage.insert("passes".into(), json!(plan.pass_count()));
        usage.insert("rotations".into(), json!(self.settings.rotations));
        usage.insert("vision_ms".into(), json!(round1(t.vision_ms)));
        usage.insert("prefill_ms".into(), json!(round1(t.prefill_ms)));
        usage.insert("questions_ms".into(), json!(round1(t.questions_ms)));
        usage.insert("total_ms".into(), json!(round1(t.total_ms)));
        usage.insert("images".into(), Value::Array(images));
        json!({"model": self.settings.model_name, "answers": answers, "usage": usage})
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
