//! Decisions: the imajev prompt layout to the byte, option codes, rotation plans, combining
//! rotations, calibration and the answer math. Knows nothing about tensors or HTTP.

pub mod codebook;
