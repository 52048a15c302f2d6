//! Qwen3.5 prefill: config, weights (read through [`crate::weights`]), vision tower, hybrid
//! decoder (Gated DeltaNet + gated attention), LoRA, readout, and the forkable `State`.
//! Written against [`crate::backend::Backend`]; knows nothing about HTTP or questions.

pub mod adapter;
pub mod config;
pub mod model;
pub mod positions;
pub mod profile;
pub mod progress;

pub use config::{LayerKind, ModelConfig};
pub use model::{FinalStates, LayerDump, LayerMark, LoadReport, Qwen35, Segment, State};
