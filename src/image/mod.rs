//! Images: bytes → `pixel_values` + `image_grid_thw`, bit-identical to the reference.
//!
//! The reference is what the Python imajev server does with an uploaded image: Pillow opens it,
//! `ImageOps.exif_transpose`, `.convert("RGB")`, then transformers 5.17's `Qwen2VLImageProcessor`
//! (the class `AutoImageProcessor` returns for model_type `qwen3_5`; torchvision backend) turns it
//! into patches. The vision tower's outputs are compared against transformers at 1e-4, so every
//! stage here reproduces the reference's integer and float32 arithmetic exactly rather than
//! approximately:
//!
//! * [`decode`] — format sniffing from magic bytes, header-only size checks before any pixel
//!   allocation (decompression bombs), single-frame check, pixel decoding, and the
//!   Pillow-specific conversions to RGB8 (alpha dropped, not composited; palette expanded; 16-bit
//!   colour keeps the high byte; 16-bit grayscale is *clipped* at 255 the way Pillow's
//!   `I;16 → RGB` conversion does). PNG and WebP go through the `image` crate.
//! * `jpeg` (Cargo feature `exact-jpeg`) — JPEG through libjpeg-turbo's decoder (the `mozjpeg`
//!   crate, vendored C built with `cc`), because zune-jpeg (the `image` crate's JPEG decoder)
//!   differs from Pillow's libjpeg-turbo on about a quarter of the bytes of a 4:2:0 photo.
//! * [`exif`] — EXIF/XMP orientation exactly as `ImageOps.exif_transpose` finds and applies it
//!   (our own tiny TIFF-IFD reader, because the `image` crate only accepts SHORT-typed tags and
//!   does not look at XMP or PNG text chunks).
//! * [`resize`] — `smart_resize` (f64, round-half-even like Python) and a hand-written port of
//!   torch's CPU uint8 antialiased bicubic (`_upsample_bicubic2d_aa`, what torchvision's
//!   `resize(uint8, BICUBIC, antialias=True)` runs). No crate does this exactly: Pillow-style
//!   resamplers (`image`, `resize`) use 22-bit int32 or float weights, `fast_image_resize` is
//!   Pillow-SIMD-derived but its precision selection and rounding are its own; torch computes
//!   the Keys a = −0.5 weights in f64, normalises them, picks a per-axis int16 precision from the
//!   largest weight and rounds half away from zero, then runs a horizontal and a vertical pass
//!   through a uint8 intermediate. Any deviation shows up as ±1 LSB on some pixels.
//! * [`patches`] — the fused rescale+normalise in float32 (`(x − mean·255) / (std·255)` with the
//!   constants rounded to f32 the way torch does) and the merge-block patch order.
//! * [`config`] — `preprocessor_config.json` (reading and writing).
//!
//! Exactness (`tests/image_parity.rs`, goldens from `tools/image_golden.py`): every fixture —
//! PNG of all colour types/bit depths/interlacing, WebP lossless and lossy, JPEG baseline,
//! progressive, 4:2:0/4:2:2/4:4:4, grayscale, CMYK, EXIF/XMP orientations — gives
//! `pixel_values` bit-identical to transformers, JPEG only with `exact-jpeg` (without it JPEG
//! is off by up to a few LSB). The resampler matched torch on 560 further random size pairs.

// `exact-jpeg` is the Cargo feature that pulls in `mozjpeg` (see `jpeg`); the allow keeps the
// build quiet where Cargo.toml does not declare it yet.
#![allow(unexpected_cfgs)]

mod buffer;
pub mod config;
pub mod decode;
pub mod exif;
#[cfg(feature = "exact-jpeg")]
mod jpeg;
#[cfg(feature = "exact-jpeg")]
mod jpeg_bands;
pub mod patches;
pub mod resize;

pub use config::ImageProcessorConfig;
pub use decode::{decode_image, sniff_format, DecodedImage, ImageFormat, ImageInfo, ImageLimits};
pub use patches::{
    patchify, preprocess, preprocess_owned, preprocess_rgb, resized_rgb, PatchGeometry, PatchedImage,
};
pub use resize::{resize_bicubic_aa_u8, smart_resize};

/// Why an image was refused. Every message says what the caller can do about it.
///
/// Suggested HTTP mapping (imajev contract §1): `TooLarge` → 413 `image_too_large`;
/// `TooManyPixels` → 413 `bad_image` ("Image exceeds 20 million decoded pixels"); everything
/// else → 422 `bad_image`; `Config` is a server-side problem → 500.
///
/// Reference quirk: in the Python server the aspect-ratio check runs inside the processor, i.e.
/// during scoring, so it surfaces as HTTP 500 `{"error": "ValueError", "detail": "absolute
/// aspect ratio must be smaller than 200, got 250.0"}`. [`ImageError::AspectRatio`]'s message
/// starts with that exact detail text; [`ImageError::http_status`] says 422 (it is the client's
/// image), change it there to mimic the quirk.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image is {bytes} bytes; the limit is {limit} bytes: downscale or recompress it")]
    TooLarge { bytes: usize, limit: usize },
    #[error(
        "Image exceeds {} decoded pixels ({width}x{height} = {pixels}); downscale it before sending",
        millions(*limit)
    )]
    TooManyPixels { width: u64, height: u64, pixels: u64, limit: u64 },
    #[error("unsupported image format: {0}; send JPEG, PNG or WebP")]
    UnsupportedFormat(String),
    #[error("corrupt or truncated image: {0}; re-encode or re-upload it")]
    Corrupt(String),
    #[error("animated images are not supported; send a single frame (e.g. the first frame as PNG)")]
    Animated,
    #[error("image has zero width or height ({width}x{height})")]
    Empty { width: u64, height: u64 },
    #[error(
        "absolute aspect ratio must be smaller than 200, got {ratio:?} ({width}x{height}); crop or pad the image"
    )]
    AspectRatio { width: usize, height: usize, ratio: f64 },
    #[error("{format} image uses an unsupported feature: {detail}; re-encode it as 8-bit RGB")]
    UnsupportedFeature { format: &'static str, detail: String },
    #[error("image processor configuration: {0}")]
    Config(String),
}

/// "20 million" for 20_000_000 (the reference's wording), the plain number otherwise.
fn millions(n: u64) -> String {
    if n >= 1_000_000 && n % 1_000_000 == 0 {
        format!("{} million", n / 1_000_000)
    } else {
        n.to_string()
    }
}

impl ImageError {
    pub(crate) fn corrupt(format: ImageFormat, detail: impl Into<String>) -> Self {
        ImageError::Corrupt(format!("{}: {}", format.name(), detail.into()))
    }

    /// HTTP status a server should answer with (imajev contract §1, "Errors").
    pub fn http_status(&self) -> u16 {
        match self {
            ImageError::TooLarge { .. } | ImageError::TooManyPixels { .. } => 413,
            ImageError::Config(_) => 500,
            _ => 422,
        }
    }

    /// The `error` code of the JSON error body.
    pub fn error_code(&self) -> &'static str {
        match self {
            ImageError::TooLarge { .. } => "image_too_large",
            ImageError::Config(_) => "ValueError",
            _ => "bad_image",
        }
    }
}

/// Decode + preprocess in one go (what the server does per image): the image's description and
/// the processor's output, the decoded pixels moved into it when no resize is needed.
pub fn load_and_preprocess(
    bytes: &[u8],
    limits: &ImageLimits,
    cfg: &ImageProcessorConfig,
) -> Result<(ImageInfo, PatchedImage), ImageError> {
    let (info, rgb) = decode_image(bytes, limits)?.into_parts();
    let patched = preprocess_owned(rgb, info.width as usize, info.height as usize, cfg)?;
    Ok((info, patched))
}
