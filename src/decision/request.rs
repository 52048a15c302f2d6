//! A validated decision request: the state, the questions (as the model will see them) and what
//! the prompt and the answers need to know of its images (not their pixels: those go to the
//! engine beside the plan). The API layer builds it from the wire format; everything here is
//! already checked, so planning and answering cannot fail on user input.

use serde_json::Value;

/// Which public contract the answers follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ContractMode {
    /// imajev's answer fields unprefixed and imajev's confidence (concentration × (1 − unknown)).
    #[default]
    Imajev,
    /// imajev's extra answer fields prefixed `x_`, TypeSafe's confidence formulas.
    Typesafe,
}

impl ContractMode {
    /// The flag value (`imajev`, `typesafe`).
    pub fn name(self) -> &'static str {
        match self {
            ContractMode::Imajev => "imajev",
            ContractMode::Typesafe => "typesafe",
        }
    }
}

/// One question of a request, in the model's words (instructions and descriptions flattened).
#[derive(Debug, Clone, PartialEq)]
pub enum QuestionKind {
    /// Yes/no; optional descriptions of what counts as yes and as no.
    Noul { question: String, yes: Option<String>, no: Option<String> },
    /// One of the options (value, optional description), in request order.
    Choice { question: String, options: Vec<(String, Option<String>)> },
    /// Ordered levels 0..n−1 with their descriptions.
    Score { question: String, levels: Vec<String> },
    /// Any subset of labels: one noul per label, folded back into one answer.
    Multi { instructions: String, labels: Vec<(String, Option<String>)>, threshold: f64 },
}

impl QuestionKind {
    /// Every question type's wire name (the `type` of a question and of its answer).
    pub const TYPE_NAMES: [&'static str; 4] = ["choice", "noul", "score", "multi"];

    /// The wire name of this question's type.
    pub fn type_name(&self) -> &'static str {
        match self {
            QuestionKind::Choice { .. } => "choice",
            QuestionKind::Noul { .. } => "noul",
            QuestionKind::Score { .. } => "score",
            QuestionKind::Multi { .. } => "multi",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Question {
    /// The client's id: echoed back, never shown to the model.
    pub id: String,
    pub kind: QuestionKind,
}

/// A decoded, preprocessed image of a request, as the decision layer sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestImage {
    /// Of the encoded bytes (`usage.images`).
    pub sha256: String,
    pub width: u32,
    pub height: u32,
    /// `<|image_pad|>` tokens it takes in the prompt after the vision merger
    /// ([`crate::image::PatchedImage::merged_tokens`]).
    pub tokens: usize,
}

#[derive(Debug, Clone)]
pub struct DecisionRequest {
    /// An object or a string (other JSON values were wrapped as `{"state": value}`).
    pub state: Value,
    pub questions: Vec<Question>,
    pub images: Vec<RequestImage>,
}

impl DecisionRequest {
    /// `{}` or `""`: the "photo only" case of schema-1.2 calibration.
    pub fn state_is_empty(&self) -> bool {
        match &self.state {
            Value::Object(m) => m.is_empty(),
            Value::String(s) => s.is_empty(),
            _ => false,
        }
    }
}
