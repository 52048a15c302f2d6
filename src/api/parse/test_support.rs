//! Helpers shared by the wire-rule tests of every step.

use super::{check_request, CheckedRequest, ParseContext};
use crate::api::error::ApiError;
use crate::decision::ContractMode;
use crate::image::{ImageLimits, ImageProcessorConfig};
pub use base64::Engine;
use serde_json::{json, Value};

pub fn ctx(mode: ContractMode) -> ParseContext {
    ParseContext {
        mode,
        max_questions: 64,
        max_options: 255,
        image_limits: ImageLimits::default(),
        image_config: ImageProcessorConfig::default(),
    }
}

pub fn check(v: Value) -> Result<CheckedRequest, ApiError> {
    check_request(v, None, &ctx(ContractMode::Imajev))
}

pub fn check_ts(v: Value) -> Result<CheckedRequest, ApiError> {
    check_request(v, None, &ctx(ContractMode::Typesafe))
}

pub fn err(v: Value) -> (u16, &'static str, String) {
    let e = check(v).expect_err("should be refused");
    (e.status, e.code, e.summary())
}

pub fn noul(i: Value) -> Value {
    json!({"type": "noul", "instructions": i})
}

pub fn png() -> Vec<u8> {
    let img = image::RgbImage::from_fn(8, 6, |x, y| image::Rgb([x as u8 * 30, y as u8 * 40, 7]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

pub fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}
