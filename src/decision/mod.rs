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
    /// Found over the limit before every pass was tokenized (planning stops there).
    #[error("the request needs more than {limit} processed tokens in its longest pass (at least {at_least}, image tokens included; --max-input-tokens). Shorten the state, the question or the options, or send a smaller image")]
    TooManyTokensAtLeast { at_least: usize, limit: usize },
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
        let limit = self.settings.max_input_tokens;
        let plan = prompt::plan_within(
            req,
            &self.tokenizer,
            &self.codebook,
            self.settings.rotations,
            &image_tokens,
            limit,
        )?;
        match plan {
            Ok(plan) if plan.max_pass_tokens > limit => {
                Err(PlanError::TooManyTokens { got: plan.max_pass_tokens, limit })
            }
            Ok(plan) => Ok(plan),
            Err(at_least) => Err(PlanError::TooManyTokensAtLeast { at_least, limit }),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn decider(max_input_tokens: usize) -> Decider {
        let tok = Arc::new(QwenTokenizer::builtin().unwrap());
        let codebook = Codebook::derive(&tok, 256).unwrap();
        let settings = DecisionSettings {
            rotations: 4,
            calibration: None,
            mode: ContractMode::Imajev,
            max_input_tokens,
            model_name: "test".into(),
        };
        Decider::new(tok, codebook, settings)
    }

    /// Issue 16, item 9: 16 questions × 255 options of 2,000 characters used to be tokenized in
    /// full (every rotation of every question: ~5 s of a core, more under load) before the 413.
    /// The first rotation of the first question is enough to know, and its tokenizing stops at
    /// the limit.
    #[test]
    fn far_over_the_token_limit_is_refused_before_tokenizing_everything() {
        let d = decider(65536);
        let options: Vec<(String, Option<String>)> =
            (0..255).map(|i| (format!("o{i}"), Some("word ".repeat(400).trim_end().to_string()))).collect();
        let req = DecisionRequest {
            state: serde_json::json!("x"),
            questions: (0..16)
                .map(|i| Question {
                    id: format!("q{i}"),
                    kind: QuestionKind::Choice { question: "Which?".into(), options: options.clone() },
                })
                .collect(),
            images: vec![],
        };
        let t0 = std::time::Instant::now();
        let e = d.plan(&req).unwrap_err();
        let took = t0.elapsed();
        assert!(
            matches!(e, PlanError::TooManyTokensAtLeast { limit: 65536, at_least } if at_least > 65536),
            "{e}"
        );
        assert!(took < std::time::Duration::from_millis(1500), "{took:?}");
        // Under the limit, the plan is the full one (the same as without a limit).
        let small = DecisionRequest { questions: req.questions[..1].to_vec(), ..req.clone() };
        let mut one = small.clone();
        if let QuestionKind::Choice { options, .. } = &mut one.questions[0].kind {
            options.truncate(3);
        }
        let p = d.plan(&one).unwrap();
        let q = prompt::plan(&one, &d.tokenizer, &d.codebook, 4, &[]).unwrap();
        assert_eq!(
            (p.prefix, p.processed_tokens, p.max_pass_tokens),
            (q.prefix, q.processed_tokens, q.max_pass_tokens)
        );
        // Exactly at the limit is allowed; one below it is refused with the exact count.
        let exact = decider(q.max_pass_tokens).plan(&one).unwrap();
        assert_eq!(exact.max_pass_tokens, q.max_pass_tokens);
        let e = decider(q.max_pass_tokens - 1).plan(&one).unwrap_err();
        assert!(
            matches!(e, PlanError::TooManyTokens { got, .. } | PlanError::TooManyTokensAtLeast { at_least: got, .. } if got >= q.max_pass_tokens),
            "{e}"
        );
    }
}
