//! imajev-serve: typed decisions from one prefill of Qwen3.5.
//!
//! The data flow is the folder layout (see ARCHITECTURE in the README):
//! api → decision → worker → engine → backend; [`app`] puts a serving process together.
pub mod api;
pub mod backend;
pub mod engine;
pub mod image;
pub mod tokenizer;
pub mod cli;
pub mod decision;
pub mod worker;
pub mod app;
pub mod synth;
pub mod weights;
