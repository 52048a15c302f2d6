//! What checkpoint files hold, below both the engine and the backends: the memory-mapped
//! safetensors store with its stored dtypes ([`store`]) and the block-FP8 formats ([`fp8`]).
//!
//! The engine reads tensors by name from a [`WeightStore`] and hands [`TensorRef`]s to a backend,
//! which places them on its device; neither this module nor the backends know which model the
//! tensors belong to.

pub mod fp8;
pub mod store;

pub use store::{scale_name, ScaleRef, StoredDtype, TensorRef, WeightStore};
