//! `preprocessor_config.json`: what the checkpoint says about image preprocessing.
//!
//! Exists so that the Rust pipeline reads the same knobs transformers reads, with the same
//! precedence (`Qwen2VLImageProcessor.__init__`: legacy `min_pixels` / `max_pixels` keys override
//! `size.shortest_edge` / `size.longest_edge`), and so that a synthetic checkpoint writer can emit
//! a realistic file ([`ImageProcessorConfig::to_json`]).

use std::path::Path;

use serde::Deserialize;

use super::ImageError;

/// Image-processor settings. Defaults are Qwen3.5's `preprocessor_config.json`.
///
/// Note: a key *missing* from the JSON takes the Qwen3.5 value here, whereas transformers would
/// fall back to the `Qwen2VLImageProcessor` class defaults (patch 14, min 3136, max 1003520, CLIP
/// mean/std). Real Qwen3.5 checkpoints spell out every key, so the two agree on them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "ConfigJson")]
pub struct ImageProcessorConfig {
    pub do_resize: bool,
    /// `size.shortest_edge` (sic: transformers stores min_pixels there).
    pub min_pixels: usize,
    /// `size.longest_edge` (max_pixels).
    pub max_pixels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    pub do_convert_rgb: bool,
    /// PIL resample id; only 3 (BICUBIC) is implemented.
    pub resample: u32,
}

impl Default for ImageProcessorConfig {
    fn default() -> Self {
        Self {
            do_resize: true,
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            do_convert_rgb: true,
            resample: 3,
        }
    }
}

#[derive(Deserialize)]
struct SizeJson {
    shortest_edge: Option<usize>,
    longest_edge: Option<usize>,
    // other shapes of `size` ({height,width}, {max_height,...}) are not used by this processor
    height: Option<usize>,
    width: Option<usize>,
}

/// Accepts a scalar where transformers accepts one for mean/std (broadcast to 3 channels).
/// (Read through `serde_json::Value`: untagged enums cannot see numbers when serde_json keeps
/// arbitrary-precision literals, as this crate does.)
#[derive(Deserialize)]
#[serde(try_from = "serde_json::Value")]
struct Triple([f64; 3]);

impl TryFrom<serde_json::Value> for Triple {
    type Error = String;
    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        if let Some(x) = v.as_f64() {
            return Ok(Triple([x; 3]));
        }
        match v.as_array().map(|a| a.iter().map(|x| x.as_f64()).collect::<Option<Vec<f64>>>()) {
            Some(Some(a)) if a.len() == 3 => Ok(Triple([a[0], a[1], a[2]])),
            _ => Err(format!("expected a number or 3 numbers, got {v}")),
        }
    }
}

impl Triple {
    fn get(self) -> [f64; 3] {
        self.0
    }
}

#[derive(Deserialize)]
struct ConfigJson {
    do_resize: Option<bool>,
    size: Option<SizeJson>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    do_rescale: Option<bool>,
    rescale_factor: Option<f64>,
    do_normalize: Option<bool>,
    image_mean: Option<Triple>,
    image_std: Option<Triple>,
    do_convert_rgb: Option<bool>,
    resample: Option<u32>,
}

impl TryFrom<ConfigJson> for ImageProcessorConfig {
    type Error = ImageError;

    fn try_from(j: ConfigJson) -> Result<Self, ImageError> {
        let d = Self::default();
        let (mut min_pixels, mut max_pixels) = match &j.size {
            None => (Some(d.min_pixels), Some(d.max_pixels)),
            Some(size) => (size.shortest_edge, size.longest_edge),
        };
        // Qwen2VLImageProcessor.__init__: the legacy keys override `size`.
        if j.min_pixels.is_some() {
            min_pixels = j.min_pixels;
        }
        if j.max_pixels.is_some() {
            max_pixels = j.max_pixels;
        }
        let (Some(min_pixels), Some(max_pixels)) = (min_pixels, max_pixels) else {
            let size = j.size.as_ref();
            return Err(ImageError::Config(format!(
                "`size` must contain 'shortest_edge' and 'longest_edge' keys (got height={:?}, width={:?})",
                size.and_then(|s| s.height),
                size.and_then(|s| s.width)
            )));
        };
        let cfg = Self {
            do_resize: j.do_resize.unwrap_or(d.do_resize),
            min_pixels,
            max_pixels,
            patch_size: j.patch_size.unwrap_or(d.patch_size),
            temporal_patch_size: j.temporal_patch_size.unwrap_or(d.temporal_patch_size),
            merge_size: j.merge_size.unwrap_or(d.merge_size),
            do_rescale: j.do_rescale.unwrap_or(d.do_rescale),
            rescale_factor: j.rescale_factor.unwrap_or(d.rescale_factor),
            do_normalize: j.do_normalize.unwrap_or(d.do_normalize),
            image_mean: j.image_mean.map(Triple::get).unwrap_or(d.image_mean),
            image_std: j.image_std.map(Triple::get).unwrap_or(d.image_std),
            do_convert_rgb: j.do_convert_rgb.unwrap_or(d.do_convert_rgb),
            resample: j.resample.unwrap_or(d.resample),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

impl ImageProcessorConfig {
    /// Parses a `preprocessor_config.json` text; absent keys take the Qwen3.5 defaults.
    pub fn from_json_str(text: &str) -> Result<Self, ImageError> {
        serde_json::from_str(text).map_err(|e| ImageError::Config(format!("preprocessor_config.json: {e}")))
    }

    /// Reads `dir/preprocessor_config.json` if present, else the Qwen3.5 defaults.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self, ImageError> {
        let path = dir.as_ref().join("preprocessor_config.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::from_json_str(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(ImageError::Config(format!("reading {}: {e}", path.display()))),
        }
    }

    /// Checks what this implementation supports (everything the Qwen3.5 checkpoints use).
    pub fn validate(&self) -> Result<(), ImageError> {
        let bad = |m: String| Err(ImageError::Config(m));
        if self.resample != 3 {
            return bad(format!("resample {} is not implemented (only 3 = BICUBIC)", self.resample));
        }
        if self.patch_size == 0 || self.merge_size == 0 || self.temporal_patch_size == 0 {
            return bad("patch_size, merge_size and temporal_patch_size must be positive".into());
        }
        if self.do_resize && (self.min_pixels == 0 || self.max_pixels == 0) {
            return bad("size.shortest_edge and size.longest_edge must be positive".into());
        }
        if self.do_rescale && !(self.rescale_factor.is_finite() && self.rescale_factor != 0.0) {
            return bad(format!("rescale_factor {} must be finite and non-zero", self.rescale_factor));
        }
        if self.do_normalize && self.image_std.contains(&0.0) {
            return bad("std evaluated to zero, leading to division by zero".into());
        }
        Ok(())
    }

    /// Spatial factor of smart_resize (patch_size · merge_size = 32 for Qwen3.5).
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// A realistic `preprocessor_config.json` (keys sorted, as transformers writes them).
    pub fn to_json(&self) -> String {
        let v = serde_json::json!({
            "do_convert_rgb": self.do_convert_rgb,
            "do_normalize": self.do_normalize,
            "do_rescale": self.do_rescale,
            "do_resize": self.do_resize,
            "image_mean": self.image_mean,
            "image_processor_type": "Qwen2VLImageProcessor",
            "image_std": self.image_std,
            "merge_size": self.merge_size,
            "patch_size": self.patch_size,
            "processor_class": "Qwen3VLProcessor",
            "resample": self.resample,
            "rescale_factor": self.rescale_factor,
            "size": {"longest_edge": self.max_pixels, "shortest_edge": self.min_pixels},
            "temporal_patch_size": self.temporal_patch_size,
        });
        let mut s = serde_json::to_string_pretty(&v).expect("serialising a json! value");
        s.push('\n');
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_legacy_keys() {
        let d = ImageProcessorConfig::default();
        assert_eq!(ImageProcessorConfig::from_json_str(&d.to_json()).unwrap(), d);
        let c = ImageProcessorConfig::from_json_str(
            r#"{"size": {"shortest_edge": 10, "longest_edge": 20}, "min_pixels": 1024, "max_pixels": 4096}"#,
        )
        .unwrap();
        assert_eq!((c.min_pixels, c.max_pixels), (1024, 4096));
        let c = ImageProcessorConfig::from_json_str(r#"{"min_pixels": 1024, "max_pixels": 4096}"#).unwrap();
        assert_eq!((c.min_pixels, c.max_pixels, c.patch_size), (1024, 4096, 16));
        assert!(ImageProcessorConfig::from_json_str(r#"{"resample": 2}"#).is_err());
        assert!(ImageProcessorConfig::from_json_str(r#"{"size": {"height": 224, "width": 224}}"#).is_err());
    }
}
