//! The wire rules: a request body (JSON value + multipart files) → a checked [`DecisionRequest`].
//!
//! Pure functions, no HTTP. The rules are imajev's (`jev_api.to_request_with_plan`,
//! `contracts.Request`, `scripts/playground/server.py`) with imajev-serve's deliberate changes,
//! and they follow `tools/reference_decide.py` step by step, including the order in which the
//! checks run (so a request with two problems is refused for the same one). [`check_request`]
//! runs steps 1–6 in this order; each step's rules live in the module named:
//!
//! 0. the body is JSON; only the members the rules read are parsed, their values counted and
//!    their memory reserved ([`json`]);
//! 1. `images` must be a list ([`images`]); the TypeSafe contract needs a non-null `state`
//!    ([`state`]);
//! 2. `data:image/…;base64,…` URLs inside state strings are cut out (→ `[image N]`) ([`images`]);
//! 3. `assets` are checked (and multipart parts claimed) ([`assets`]); at most two images in all;
//! 4. every image's base64 is decoded (413 for an oversized payload before decoding) ([`images`],
//!    then [`assets`]);
//! 5. the state is wrapped (`{"state": value}` unless an object or a string), placeholders are
//!    replaced, and depth / size / finiteness are checked ([`state`]);
//! 6. the questions, in request order ([`questions`]);
//! 7. only then are the images decoded and preprocessed ([`decode_images`]), the expensive part.

mod assets;
mod images;
mod json;
mod questions;
mod state;
#[cfg(test)]
mod test_support;

pub use assets::{Replacer, MAX_PLACEHOLDER_CHARS};
pub use images::{
    decode_data_url, decode_images, extract_embedded, max_b64_len, strict_b64_decode, ImageBlob, IMAGE_KEYS,
    MAX_IMAGES,
};
pub use json::{parse_json, parse_json_within, top_level_members, Member, MAX_JSON_VALUES, READ_FIELDS};
pub use questions::{
    flatten_description, flatten_instructions, DEFAULT_MULTI_THRESHOLD, MAX_MULTI_LABELS, MAX_OPTION_VALUE,
    MAX_SCORE_LEVELS, MAX_TEXT, MIN_SCORE_LEVELS,
};
pub use state::{check_state, MAX_STATE_BYTES, MAX_STATE_DEPTH};

use super::budget::Reservation;
use super::error::{ApiError, Loc};
use crate::decision::{ContractMode, Decider, DecisionRequest, Question};
use crate::image::{ImageLimits, ImageProcessorConfig, PatchedImage};
use serde_json::Value;

/// Default for `max_questions`.
pub const DEFAULT_MAX_QUESTIONS: usize = 64;

/// What the rules depend on.
#[derive(Debug, Clone)]
pub struct ParseContext {
    pub mode: ContractMode,
    pub max_questions: usize,
    /// Most options of a choice (readout rows − 1).
    pub max_options: usize,
    pub image_limits: ImageLimits,
    pub image_config: ImageProcessorConfig,
}

impl ParseContext {
    /// The rules for a loaded adapter: its contract mode and option limit.
    pub fn for_decider(decider: &Decider, max_questions: usize, image_config: ImageProcessorConfig) -> Self {
        ParseContext {
            mode: decider.settings.mode,
            max_questions,
            max_options: decider.max_options(),
            image_limits: ImageLimits::default(),
            image_config,
        }
    }
}

/// One part of a multipart body.
#[derive(Debug, Clone)]
pub struct Upload {
    pub name: String,
    /// The part had a `filename` (a file upload rather than a text field).
    pub is_file: bool,
    pub bytes: Vec<u8>,
}

/// The parts of a multipart body besides `request`.
#[derive(Debug, Clone, Default)]
pub struct MultipartFiles {
    /// Parts named `image`, `images`, `image[]`: in that key order, then in order of appearance.
    pub images: Vec<Upload>,
    /// Every other part, in order of appearance (TypeSafe asset parts).
    pub parts: Vec<Upload>,
}

/// A request that passed every rule; its images are still encoded.
#[derive(Debug, Clone)]
pub struct CheckedRequest {
    pub state: Value,
    pub questions: Vec<Question>,
    pub images: Vec<ImageBlob>,
}

/// A request body: the JSON (the whole body, or a multipart body's `request` part) and the
/// multipart body's other parts.
#[derive(Debug)]
pub struct RequestBody {
    pub json: Vec<u8>,
    /// None for a JSON body.
    pub files: Option<MultipartFiles>,
    /// What the body holds of the in-flight memory budget; parsing reserves more from the same
    /// budget, and all of it is given back once the request is parsed.
    pub held: Reservation,
}

/// A copy holds none of the in-flight memory budget.
impl Clone for RequestBody {
    fn clone(&self) -> Self {
        RequestBody { json: self.json.clone(), files: self.files.clone(), held: Reservation::none() }
    }
}

impl RequestBody {
    /// A JSON body.
    pub fn json(json: Vec<u8>) -> Self {
        RequestBody { json, files: None, held: Reservation::none() }
    }

    /// A multipart body: its `request` part and the other parts.
    pub fn multipart(json: Vec<u8>, files: MultipartFiles) -> Self {
        RequestBody { json, files: Some(files), held: Reservation::none() }
    }

    /// The same body, holding `held` of the in-flight memory budget.
    pub fn holding(mut self, held: Reservation) -> Self {
        self.held = held;
        self
    }
}

/// A request that passed every step: what the decision layer reads, and the pixels only the
/// engine reads (one per `request.images`, in the same order).
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub request: DecisionRequest,
    pub pixels: Vec<PatchedImage>,
}

/// The entry point: every step, from the body's bytes to a request ready to plan.
pub fn parse_request(body: RequestBody, ctx: &ParseContext) -> Result<ParsedRequest, ApiError> {
    let RequestBody { json, files, mut held } = body;
    let json_loc = if files.is_some() { Loc::body().at("request") } else { Loc::body() };
    let value = parse_json_within(&json, json_loc, &mut held)?;
    drop(json);
    let checked = check_request(value, files, ctx)?;
    let (images, pixels) = decode_images(&checked.images, ctx)?;
    Ok(ParsedRequest {
        request: DecisionRequest { state: checked.state, questions: checked.questions, images },
        pixels,
    })
}

/// Applies every rule of the contract to a parsed body (steps 1–6 above, in that order).
/// `files` is the multipart body's parts (None for a JSON body).
pub fn check_request(
    body: Value,
    files: Option<MultipartFiles>,
    ctx: &ParseContext,
) -> Result<CheckedRequest, ApiError> {
    let root = Loc::body();
    let Value::Object(mut obj) = body else {
        return Err(ApiError::bad_request(root, "the request must be a JSON object", "type_error"));
    };
    let multipart = files.is_some();
    let files = files.unwrap_or_default();

    // 1. the `images` list; the state's presence
    let explicit = images::explicit_images(obj.get("images"), &root)?;
    let has_state = obj.contains_key("state");
    let state = obj.remove("state").unwrap_or(Value::Null);
    state::require_state(&state, has_state, ctx.mode, root.at("state"))?;
    // 2. data URLs embedded in the state
    let mut embedded = Vec::new();
    let state = if state.is_null() { state } else { extract_embedded(state, &mut embedded) };
    // 3. uploads, assets and the parts they claim, the image count
    images::check_uploads(&files, &root)?;
    let assets = match obj.get("assets") {
        Some(a) => assets::parse_assets(a, &files.parts, multipart, &root.at("assets"))?,
        None => Vec::new(),
    };
    assets::check_parts_claimed(&files.parts, &assets, root.at("assets"))?;
    images::check_image_count(files.images.len() + explicit.len() + embedded.len() + assets.len(), &root)?;
    // 4. the encoded bytes of every image, in prompt order
    let max_bytes = ctx.image_limits.max_bytes;
    let mut blobs = images::encoded_images(&files.images, &explicit, &embedded, max_bytes, &root)?;
    let replace = assets::decode_assets(&assets, &files.parts, max_bytes, &root, &mut blobs)?;
    // 5. the state
    let state = state::finish_state(state, has_state, &replace, &root.at("state"))?;
    // 6. the questions
    let questions = questions::check_questions(obj.get("questions"), ctx, &replace, root.at("questions"))?;
    Ok(CheckedRequest { state, questions, images: blobs })
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use serde_json::json;

    #[test]
    fn body_must_be_an_object_and_json() {
        assert_eq!(check(json!([1])).unwrap_err().code, "bad_request");
        let e = parse_json(b"{\"questions\": {", Loc::body()).unwrap_err();
        assert_eq!((e.status, e.code), (422, "bad_json"));
        assert!(parse_json(b"\xEF\xBB\xBF{}", Loc::body()).is_ok());
        // Duplicate keys: the last value wins at the first key's position (as json.loads).
        let v = parse_json(br#"{"state": 1, "images": 2, "state": 3}"#, Loc::body()).unwrap();
        assert_eq!(serde_json::to_string(&v).unwrap(), r#"{"state":3,"images":2}"#);
    }
}
