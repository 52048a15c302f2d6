//! imajev-serve: typed decisions from one prefill of Qwen3.5.
//!
//! The data flow is the folder layout (see ARCHITECTURE in the README):
//! api → decision → worker → engine → backend; [`app`] puts a serving process together.
pub mod api;
pub mod app;
pub mod backend;
pub mod cli;
pub mod decision;
pub mod engine;
pub mod image;
pub mod release;
pub mod synth;
pub mod tokenizer;
pub mod weights;
pub mod worker;
