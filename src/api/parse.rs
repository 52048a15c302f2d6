//! The wire rules: a request body (JSON value + multipart files) → a checked [`DecisionRequest`].
//!
//! Pure functions, no HTTP. The rules are imajev's (`jev_api.to_request_with_plan`,
//! `contracts.Request`, `scripts/playground/server.py`) with imajev-serve's deliberate changes,
//! and they follow `tools/reference_decide.py` step by step, including the order in which the
//! checks run (so a request with two problems is refused for the same one):
//!
//! 1. `images` must be a list; the TypeSafe contract needs a non-null `state`;
//! 2. `data:image/…;base64,…` URLs inside state strings are cut out (→ `[image N]`);
//! 3. `assets` are checked (and multipart parts claimed); at most two images in all;
//! 4. every image's base64 is decoded (413 for an oversized payload before decoding);
//! 5. the state is wrapped (`{"state": value}` unless an object or a string), placeholders are
//!    replaced, and depth / size / finiteness are checked;
//! 6. the questions, in request order;
//! 7. only then are the images decoded and preprocessed ([`decode_images`]), the expensive part.

use super::error::{ApiError, Loc};
use crate::decision::prompt::{multi_label_question, UNKNOWN_KEY};
use crate::decision::pyjson::{self, py_len, py_strip};
use crate::decision::{ContractMode, Decider, DecisionRequest, Question, QuestionKind, RequestImage};
use crate::image::{load_and_preprocess, ImageLimits, ImageProcessorConfig};
use base64::engine::general_purpose::GeneralPurpose;
use base64::engine::{DecodePaddingMode, GeneralPurposeConfig};
use base64::Engine;
use serde_json::{Map, Value};

/// Longest instructions / description / question text, in Python characters (`contracts.Text`).
pub const MAX_TEXT: usize = 2000;
/// Longest choice option value (`contracts.Option.value`).
pub const MAX_OPTION_VALUE: usize = 128;
/// Compact UTF-8 JSON size limit of the state (`contracts.MAX_STATE_BYTES`, phase 3).
pub const MAX_STATE_BYTES: usize = 131_072;
/// Deepest state nesting (`contracts.Request.bounds`: the top level is depth 0).
pub const MAX_STATE_DEPTH: usize = 8;
pub const MAX_MULTI_LABELS: usize = 32;
pub const MIN_SCORE_LEVELS: usize = 2;
pub const MAX_SCORE_LEVELS: usize = 10;
pub const DEFAULT_MULTI_THRESHOLD: f64 = 0.5;
pub const MAX_IMAGES: usize = 2;
/// Default for `max_questions`.
pub const DEFAULT_MAX_QUESTIONS: usize = 64;
/// Multipart keys that hold image uploads, in the order their files are taken.
pub const IMAGE_KEYS: [&str; 3] = ["image", "images", "image[]"];

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

/// Encoded bytes of one image and where they came from (for error messages).
#[derive(Debug, Clone)]
pub struct ImageBlob {
    pub bytes: Vec<u8>,
    pub loc: Loc,
    pub what: String,
}

/// A request that passed every rule; its images are still encoded.
#[derive(Debug, Clone)]
pub struct CheckedRequest {
    pub state: Value,
    pub questions: Vec<Question>,
    pub images: Vec<ImageBlob>,
}

/// `decide`'s entry point: one JSON body → a request ready to plan (images decoded).
pub fn parse_request_json(body: &[u8], ctx: &ParseContext) -> Result<DecisionRequest, ApiError> {
    let value = parse_json(body, Loc::body())?;
    let checked = check_request(value, None, ctx)?;
    let images = decode_images(&checked.images, ctx)?;
    Ok(DecisionRequest { state: checked.state, questions: checked.questions, images })
}

/// Parses JSON bytes (a leading UTF-8 BOM is skipped, as Python's `json.loads(bytes)` does).
pub fn parse_json(body: &[u8], loc: Loc) -> Result<Value, ApiError> {
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    serde_json::from_slice(body).map_err(|e| ApiError::bad_json(loc, format!("the body is not valid JSON: {e}")))
}

/// Decodes and preprocesses every image (the expensive step; run it off the async threads), the
/// images in parallel. A bad image is reported as the first bad one in request order.
pub fn decode_images(blobs: &[ImageBlob], ctx: &ParseContext) -> Result<Vec<RequestImage>, ApiError> {
    use rayon::prelude::*;
    let each: Vec<Result<RequestImage, ApiError>> = blobs
        .par_iter()
        .map(|b| {
            let (img, patched) = load_and_preprocess(&b.bytes, &ctx.image_limits, &ctx.image_config)
                .map_err(|e| image_error(e, b))?;
            Ok(RequestImage { sha256: hex::encode(img.sha256), width: img.width, height: img.height, patched })
        })
        .collect();
    each.into_iter().collect()
}

fn image_error(e: crate::image::ImageError, b: &ImageBlob) -> ApiError {
    let msg = format!("{}: {e}", b.what);
    match e.http_status() {
        422 => ApiError::bad_image(b.loc.clone(), msg),
        413 => ApiError::message(413, e.error_code(), msg),
        // A preprocessor configuration problem is ours, not the caller's.
        _ => ApiError::internal(msg),
    }
}

// ----------------------------------------------------------------------------- request

/// Applies every rule of the contract to a parsed body. `files` is the multipart body's parts
/// (None for a JSON body).
pub fn check_request(body: Value, files: Option<MultipartFiles>, ctx: &ParseContext) -> Result<CheckedRequest, ApiError> {
    let root = Loc::body();
    let Value::Object(mut obj) = body else {
        return Err(ApiError::bad_request(root, "the request must be a JSON object", "type_error"));
    };
    let typesafe = ctx.mode == ContractMode::Typesafe;
    let multipart = files.is_some();
    let files = files.unwrap_or_default();

    // ---- images: uploads and `images` first, then embedded in the state, then assets
    let explicit: Vec<Value> = match obj.get("images") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::bad_image(root.at("images"), "'images' must be a list of data URL strings")),
    };
    let has_state = obj.contains_key("state");
    let mut state = obj.remove("state").unwrap_or(Value::Null);
    if typesafe && state.is_null() {
        let why = if has_state { "'state' must not be null" } else { "'state' is required" };
        return Err(ApiError::invalid(
            root.at("state"),
            format!("{why}: send a string, an object or an array (use \"\" or {{}} for no state)"),
            "missing",
        ));
    }
    let mut embedded = Vec::new();
    if !state.is_null() {
        state = extract_embedded(state, &mut embedded);
    }
    for u in &files.images {
        if !u.is_file {
            return Err(ApiError::bad_image(root.at(u.name.as_str()), format!("form field {:?} must be an uploaded file", u.name)));
        }
    }
    let assets = match obj.get("assets") {
        Some(a) => parse_assets(a, &files.parts, multipart, &root.at("assets"))?,
        None => Vec::new(),
    };
    if let Some(p) = files.parts.iter().find(|p| p.is_file && !assets.iter().any(|a| a.part.as_deref() == Some(&p.name))) {
        return Err(ApiError::invalid(
            root.at("assets"),
            format!("the multipart file part {:?} is not claimed by any asset: name it in 'assets' as {{\"type\": \"image\", \"part\": {:?}}} or leave it out", p.name, p.name),
            "value_error",
        ));
    }
    let total = files.images.len() + explicit.len() + embedded.len() + assets.len();
    if total > MAX_IMAGES {
        return Err(ApiError::bad_image(
            root.at("images"),
            format!("Provide at most two images (uploads, 'images', data URLs in the state and assets together); got {total}"),
        ));
    }
    let max_bytes = ctx.image_limits.max_bytes;
    let mut blobs = Vec::with_capacity(total);
    for u in &files.images {
        if u.bytes.len() > max_bytes {
            return Err(image_too_large(&format!("the uploaded file {:?}", u.name), u.bytes.len(), max_bytes));
        }
        blobs.push(ImageBlob { bytes: u.bytes.clone(), loc: root.at(u.name.as_str()), what: format!("uploaded image {}", blobs.len() + 1) });
    }
    for (i, v) in explicit.iter().enumerate() {
        let loc = root.at("images").at(i);
        let what = format!("images[{i}]");
        blobs.push(ImageBlob { bytes: decode_data_url(v, &loc, &what, max_bytes)?, loc, what });
    }
    for (i, url) in embedded.iter().enumerate() {
        let loc = root.at("state");
        let what = format!("the data URL image {} embedded in the state", i + 1);
        blobs.push(ImageBlob { bytes: decode_data_url(&Value::String(url.clone()), &loc, &what, max_bytes)?, loc, what });
    }
    let base = blobs.len();
    let mut placeholders = Vec::new();
    for (i, a) in assets.iter().enumerate() {
        let loc = root.at("assets").at(a.placeholder.as_str());
        let what = format!("asset {:?}", a.placeholder);
        let bytes = match (&a.part, &a.data_base64) {
            (Some(name), _) => {
                let part = files.parts.iter().find(|p| &p.name == name).expect("claimed parts exist");
                if part.bytes.len() > max_bytes {
                    return Err(image_too_large(&what, part.bytes.len(), max_bytes));
                }
                part.bytes.clone()
            }
            (None, Some(b64)) => strict_b64(b64, &loc.at("data_base64"), &what, max_bytes)?,
            (None, None) => unreachable!("parse_assets requires part or data_base64"),
        };
        blobs.push(ImageBlob { bytes, loc, what });
        placeholders.push((a.placeholder.clone(), format!("[image {}]", base + i + 1)));
    }
    let replace = Replacer::new(placeholders);

    // ---- state
    let state = match state {
        _ if !has_state => Value::Object(Map::new()),
        s @ (Value::Object(_) | Value::String(_)) => s,
        other => {
            let mut m = Map::new();
            m.insert("state".into(), other);
            Value::Object(m)
        }
    };
    let state = replace.value(&state);
    check_state(&state, &root.at("state"))?;

    // ---- questions
    let qloc = root.at("questions");
    let questions = match obj.get("questions") {
        Some(Value::Object(q)) if !q.is_empty() => q,
        Some(Value::Object(_)) => {
            return Err(ApiError::invalid(qloc, "'questions' is empty: send at least one question", "too_short"))
        }
        None => {
            return Err(ApiError::invalid(qloc, "'questions' is required: an object of question id → question", "missing"))
        }
        Some(_) => {
            return Err(ApiError::invalid(qloc, "'questions' must be an object of question id → question", "type_error"))
        }
    };
    if questions.len() > ctx.max_questions {
        return Err(ApiError::invalid(
            qloc,
            format!("a request has at most {} questions; got {}: split it into several requests", ctx.max_questions, questions.len()),
            "too_long",
        ));
    }
    let mut out = Vec::with_capacity(questions.len());
    for (name, q) in questions {
        out.push(Question { id: name.clone(), kind: question(name, q, &qloc.at(name.as_str()), ctx, &replace)? });
    }
    Ok(CheckedRequest { state, questions: out, images: blobs })
}

fn question(name: &str, q: &Value, loc: &Loc, ctx: &ParseContext, replace: &Replacer) -> Result<QuestionKind, ApiError> {
    if name.is_empty() {
        return Err(ApiError::invalid(loc.clone(), "question ids must be non-empty strings", "value_error"));
    }
    let Value::Object(q) = q else {
        return Err(ApiError::invalid(
            loc.clone(),
            format!("question {name:?} must be an object with 'type' and 'instructions'"),
            "type_error",
        ));
    };
    let kind = match q.get("type") {
        Some(Value::String(t)) if matches!(t.as_str(), "noul" | "choice" | "score" | "multi") => t.as_str(),
        other => {
            let shown = other.map(|v| v.to_string()).unwrap_or_else(|| "missing".into());
            return Err(ApiError::invalid(
                loc.at("type"),
                format!("question {name:?} has unsupported type {shown}; use noul, choice, score or multi"),
                if other.is_none() { "missing" } else { "value_error" },
            ));
        }
    };
    let iloc = loc.at("instructions");
    let instructions = match q.get("instructions") {
        Some(v) => Some(flatten_instructions(&replace.value(v), &iloc)?),
        None if ctx.mode == ContractMode::Typesafe && kind == "noul" => None,
        None => {
            let hint = if kind == "noul" && ctx.mode == ContractMode::Imajev {
                " (a noul without instructions is accepted only in the TypeSafe contract mode)"
            } else {
                ""
            };
            return Err(ApiError::invalid(iloc, format!("question {name:?} needs 'instructions'{hint}"), "missing"));
        }
    };
    let criteria = q.get("criteria").unwrap_or(&Value::Null);
    let cloc = loc.at("criteria");
    match kind {
        "noul" => {
            let empty = Map::new();
            let c = match criteria {
                Value::Null => &empty,
                Value::Object(c) => c,
                _ => {
                    return Err(ApiError::invalid(
                        cloc,
                        format!("noul question {name:?}: criteria must be an object with optional 'true' and 'false' descriptions"),
                        "type_error",
                    ))
                }
            };
            let side = |key: &str| -> Result<Option<String>, ApiError> {
                let l = cloc.at(key);
                let d = flatten_description(&replace.value(c.get(key).unwrap_or(&Value::Null)), &l)?;
                d.map(|d| check_text(d, &l)).transpose()
            };
            let yes = side("true")?;
            let no = side("false")?;
            let question = match instructions {
                Some(i) => i,
                None => yes.clone().or_else(|| no.clone()).ok_or_else(|| {
                    ApiError::invalid(iloc.clone(), format!("question {name:?} needs 'instructions' or a criteria description"), "missing")
                })?,
            };
            Ok(QuestionKind::Noul { question: check_text(question, &iloc)?, yes, no })
        }
        "choice" => {
            let instructions = instructions.expect("checked above");
            let Value::Object(c) = criteria else {
                return Err(ApiError::invalid(
                    cloc,
                    format!("choice question {name:?} needs a criteria object of option → description"),
                    "type_error",
                ));
            };
            if c.len() < 2 || c.len() > ctx.max_options {
                return Err(ApiError::invalid(
                    cloc,
                    format!("choice question {name:?} needs 2-{} options; got {}", ctx.max_options, c.len()),
                    if c.len() < 2 { "too_short" } else { "too_long" },
                ));
            }
            let mut options = Vec::with_capacity(c.len());
            for (value, desc) in c {
                let l = cloc.at(value.as_str());
                let n = py_len(value);
                if n == 0 || n > MAX_OPTION_VALUE {
                    return Err(ApiError::invalid(
                        l,
                        format!("option values must be 1-{MAX_OPTION_VALUE} characters; got {n}"),
                        if n == 0 { "too_short" } else { "too_long" },
                    ));
                }
                if value == UNKNOWN_KEY {
                    return Err(ApiError::invalid(l, "the option value __unknown__ is reserved; rename the option", "value_error"));
                }
                let d = flatten_description(&replace.value(desc), &l)?.map(|d| check_text(d, &l)).transpose()?;
                options.push((value.clone(), d));
            }
            Ok(QuestionKind::Choice { question: check_text(instructions, &iloc)?, options })
        }
        "score" => {
            let instructions = instructions.expect("checked above");
            let Value::Array(levels) = criteria else {
                return Err(ApiError::invalid(
                    cloc,
                    format!("score question {name:?} needs an ordered criteria list of level descriptions, lowest first (not an object)"),
                    "type_error",
                ));
            };
            if levels.len() < MIN_SCORE_LEVELS || levels.len() > MAX_SCORE_LEVELS {
                return Err(ApiError::invalid(
                    cloc,
                    format!("score question {name:?} needs {MIN_SCORE_LEVELS}-{MAX_SCORE_LEVELS} levels; got {}", levels.len()),
                    if levels.len() < MIN_SCORE_LEVELS { "too_short" } else { "too_long" },
                ));
            }
            let mut out = Vec::with_capacity(levels.len());
            for (i, d) in levels.iter().enumerate() {
                let l = cloc.at(i);
                let Some(d) = flatten_description(&replace.value(d), &l)? else {
                    return Err(ApiError::invalid(l, format!("level {i} needs a description"), "missing"));
                };
                out.push(check_text(d, &l)?);
            }
            Ok(QuestionKind::Score { question: check_text(instructions, &iloc)?, levels: out })
        }
        _ => {
            let instructions = instructions.expect("checked above");
            let c = match criteria {
                Value::Object(c) if !c.is_empty() => c,
                _ => {
                    return Err(ApiError::invalid(
                        cloc,
                        format!("multi question {name:?} needs a non-empty criteria object of label → description"),
                        if criteria.is_object() { "too_short" } else { "type_error" },
                    ))
                }
            };
            if c.len() > MAX_MULTI_LABELS {
                return Err(ApiError::invalid(
                    cloc,
                    format!("multi question {name:?} has {} labels; at most {MAX_MULTI_LABELS}", c.len()),
                    "too_long",
                ));
            }
            let tloc = loc.at("threshold");
            let threshold = match q.get("threshold") {
                None => DEFAULT_MULTI_THRESHOLD,
                Some(Value::Number(n)) => match n.as_f64() {
                    Some(t) if t.is_finite() && (0.0..=1.0).contains(&t) => t,
                    _ => return Err(ApiError::invalid(tloc, "threshold must be a number in [0, 1]", "value_error")),
                },
                Some(_) => return Err(ApiError::invalid(tloc, "threshold must be a number in [0, 1]", "type_error")),
            };
            let mut labels = Vec::with_capacity(c.len());
            for (label, desc) in c {
                let l = cloc.at(label.as_str());
                let d = flatten_description(&replace.value(desc), &l)?;
                check_text(multi_label_question(&instructions, label, d.as_deref()), &l)?;
                labels.push((label.clone(), d));
            }
            Ok(QuestionKind::Multi { instructions, labels, threshold })
        }
    }
}

// ----------------------------------------------------------------------------- text

/// `jev_api._text`: strings as they are, anything else as `json.dumps(v, ensure_ascii=False)`.
fn text_of(v: &Value, loc: &Loc) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        other => pyjson::dumps(other, pyjson::PLAIN).map_err(|e| {
            ApiError::invalid(loc.clone(), format!("contains the number {} that is not finite; send finite numbers", e.0), "value_error")
        }),
    }
}

/// `jev_api.flatten_instructions`: a non-empty string; an object as `key: value` lines; an
/// array as one line per item.
pub fn flatten_instructions(v: &Value, loc: &Loc) -> Result<String, ApiError> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        Value::Object(m) if !m.is_empty() => {
            let lines: Result<Vec<String>, ApiError> = m.iter().map(|(k, v)| Ok(format!("{k}: {}", text_of(v, loc)?))).collect();
            Ok(lines?.join("\n"))
        }
        Value::Array(a) if !a.is_empty() => {
            let lines: Result<Vec<String>, ApiError> = a.iter().map(|v| text_of(v, loc)).collect();
            Ok(lines?.join("\n"))
        }
        _ => Err(ApiError::invalid(loc.clone(), "'instructions' must be a non-empty string, object or array", "value_error")),
    }
}

/// `jev_api.flatten_description`: null → none; a string; an object as `"; "`-joined `k: v`; an
/// array as `"; "`-joined items; empty results are none. Numbers and booleans are refused.
pub fn flatten_description(v: &Value, loc: &Loc) -> Result<Option<String>, ApiError> {
    let s = match v {
        Value::Null => return Ok(None),
        Value::String(s) => s.clone(),
        Value::Object(m) => {
            let parts: Result<Vec<String>, ApiError> = m.iter().map(|(k, v)| Ok(format!("{k}: {}", text_of(v, loc)?))).collect();
            parts?.join("; ")
        }
        Value::Array(a) => {
            let parts: Result<Vec<String>, ApiError> = a.iter().map(|v| text_of(v, loc)).collect();
            parts?.join("; ")
        }
        _ => {
            return Err(ApiError::invalid(
                loc.clone(),
                "a description must be null, a string, an object or an array",
                "type_error",
            ))
        }
    };
    Ok(if s.is_empty() { None } else { Some(s) })
}

/// `contracts.Text`: 1..=2000 Python characters.
fn check_text(s: String, loc: &Loc) -> Result<String, ApiError> {
    let n = py_len(&s);
    if n == 0 {
        return Err(ApiError::invalid(loc.clone(), "must not be empty", "too_short"));
    }
    if n > MAX_TEXT {
        return Err(ApiError::invalid(loc.clone(), format!("is {n} characters; the limit is {MAX_TEXT}: shorten it"), "too_long"));
    }
    Ok(s)
}

// ----------------------------------------------------------------------------- state

fn depth_ok(v: &Value, depth: usize) -> bool {
    if depth > MAX_STATE_DEPTH {
        return false;
    }
    match v {
        Value::Object(m) => m.values().all(|x| depth_ok(x, depth + 1)),
        Value::Array(a) => a.iter().all(|x| depth_ok(x, depth + 1)),
        _ => true,
    }
}

/// `contracts.Request.bounds`: nesting ≤ 8, finite numbers, ≤ 131,072 bytes of compact JSON.
pub fn check_state(state: &Value, loc: &Loc) -> Result<(), ApiError> {
    if !depth_ok(state, 0) {
        return Err(ApiError::invalid(
            loc.clone(),
            format!("State nesting exceeds {MAX_STATE_DEPTH}: flatten the state (at most {MAX_STATE_DEPTH} levels of objects/arrays)"),
            "value_error",
        ));
    }
    let compact = pyjson::dumps(state, pyjson::COMPACT).map_err(|e| {
        ApiError::invalid(loc.clone(), format!("State contains the number {} that is not finite; send finite numbers", e.0), "value_error")
    })?;
    if compact.len() > MAX_STATE_BYTES {
        return Err(ApiError::invalid(
            loc.clone(),
            format!("State exceeds {MAX_STATE_BYTES} bytes ({} bytes of compact UTF-8 JSON): shorten it", compact.len()),
            "too_long",
        ));
    }
    Ok(())
}

// ----------------------------------------------------------------------------- images

/// Python's `\w` (Unicode word characters) plus `.+-`: the MIME subtype characters.
fn is_mime_char(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '.' | '+' | '-')
}

fn is_b64_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=')
}

/// The length of a match of `data:image/[\w.+-]+;base64,[A-Za-z0-9+/=]+` at the start of `s`.
fn embedded_match(s: &str) -> Option<usize> {
    let rest = s.strip_prefix("data:image/")?;
    let sub: usize = rest.chars().take_while(|&c| is_mime_char(c)).map(char::len_utf8).sum();
    if sub == 0 {
        return None;
    }
    let rest = rest[sub..].strip_prefix(";base64,")?;
    let payload = rest.bytes().take_while(|&b| is_b64_char(b)).count();
    if payload == 0 {
        return None;
    }
    Some("data:image/".len() + sub + ";base64,".len() + payload)
}

/// `server.extract_state_images` on one string: every image data URL is cut out and replaced
/// by `[image N]` (N counting all embedded images so far, from 1).
fn extract_from_str(s: &str, found: &mut Vec<String>) -> Option<String> {
    if !s.contains("data:image/") {
        return None;
    }
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i..].find("data:image/") {
            None => break,
            Some(off) => {
                let start = i + off;
                out.push_str(&s[i..start]);
                match embedded_match(&s[start..]) {
                    Some(len) => {
                        found.push(s[start..start + len].to_string());
                        out.push_str(&format!("[image {}]", found.len()));
                        i = start + len;
                    }
                    None => {
                        out.push('d');
                        i = start + 1;
                    }
                }
            }
        }
    }
    out.push_str(&s[i..]);
    Some(out)
}

/// Walks strings in the state (object values and array items, in document order).
pub fn extract_embedded(v: Value, found: &mut Vec<String>) -> Value {
    match v {
        Value::String(s) => match extract_from_str(&s, found) {
            Some(t) => Value::String(t),
            None => Value::String(s),
        },
        Value::Array(a) => Value::Array(a.into_iter().map(|x| extract_embedded(x, found)).collect()),
        Value::Object(m) => Value::Object(m.into_iter().map(|(k, x)| (k, extract_embedded(x, found))).collect()),
        other => other,
    }
}

/// The longest base64 payload whose decoded size can stay within `max_bytes`: 4·⌈max/3⌉.
pub fn max_b64_len(max_bytes: usize) -> usize {
    4 * max_bytes.div_ceil(3)
}

fn image_too_large(what: &str, bytes: usize, max_bytes: usize) -> ApiError {
    ApiError::message(
        413,
        "image_too_large",
        format!("{what} is {bytes} bytes; images may be at most {max_bytes} bytes (20 MiB): downscale or recompress it"),
    )
}

/// Python's `base64.b64decode(s, validate=True)` (3.11+, strict mode): only the RFC 4648
/// alphabet, padding only at the end and exactly as much as the last quantum needs (extra `=`
/// after a complete quantum is tolerated, as CPython does); unused trailing bits are ignored.
pub fn strict_b64_decode(s: &str) -> Result<Vec<u8>, &'static str> {
    let bytes = s.as_bytes();
    let data_len = bytes.iter().position(|&b| b == b'=').unwrap_or(bytes.len());
    let (data, pad) = bytes.split_at(data_len);
    if !data.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/') {
        return Err("only base64 characters (A-Z a-z 0-9 + / =) are allowed, without whitespace");
    }
    if pad.iter().any(|&b| b != b'=') {
        return Err("padding ('=') may only appear at the end");
    }
    if data.is_empty() && !pad.is_empty() {
        return Err("leading padding is not allowed");
    }
    let ok = match data.len() % 4 {
        0 => true,
        1 => false,
        2 => pad.len() == 2,
        _ => pad.len() == 1,
    };
    if !ok {
        return Err("incorrect padding or length");
    }
    const ENGINE: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::RequireNone).with_decode_allow_trailing_bits(true),
    );
    ENGINE.decode(data).map_err(|_| "not valid base64")
}

fn strict_b64(payload: &str, loc: &Loc, what: &str, max_bytes: usize) -> Result<Vec<u8>, ApiError> {
    let n = py_len(payload);
    if n > max_b64_len(max_bytes) {
        return Err(ApiError::message(
            413,
            "image_too_large",
            format!("{what}: its base64 is {n} characters, more than 20 MiB of image ({} characters): downscale or recompress it", max_b64_len(max_bytes)),
        ));
    }
    strict_b64_decode(payload).map_err(|why| ApiError::bad_image(loc.clone(), format!("{what} is not valid base64: {why}")))
}

/// `server.decode_data_url`: `^data:(mime)?(;base64)?,(payload)$` on the stripped string,
/// `;base64` required, then a strict base64 decode.
pub fn decode_data_url(v: &Value, loc: &Loc, what: &str, max_bytes: usize) -> Result<Vec<u8>, ApiError> {
    let s = match v {
        Value::String(s) if !s.is_empty() => py_strip(s),
        _ => return Err(ApiError::bad_image(loc.clone(), format!("{what} must be a data URL string (data:image/png;base64,...)"))),
    };
    let not_url = || ApiError::bad_image(loc.clone(), format!("{what} is not a data: URL (send data:image/png;base64,...)"));
    let rest = s.strip_prefix("data:").ok_or_else(not_url)?;
    // Optional `type/subtype`.
    let mut rest = rest;
    let t: usize = rest.chars().take_while(|&c| is_mime_char(c)).map(char::len_utf8).sum();
    if t > 0 {
        if let Some(after) = rest[t..].strip_prefix('/') {
            let st: usize = after.chars().take_while(|&c| is_mime_char(c)).map(char::len_utf8).sum();
            if st > 0 {
                rest = &after[st..];
            }
        }
    }
    let (b64, rest) = match rest.strip_prefix(";base64") {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let payload = rest.strip_prefix(',').ok_or_else(not_url)?;
    if !b64 {
        return Err(ApiError::bad_image(loc.clone(), format!("{what} must be base64-encoded (data:...;base64,...)")));
    }
    strict_b64(payload, loc, what, max_bytes)
}

// ----------------------------------------------------------------------------- assets

/// One checked TypeSafe asset.
#[derive(Debug, Clone)]
struct Asset {
    placeholder: String,
    part: Option<String>,
    data_base64: Option<String>,
}

fn parse_assets(v: &Value, parts: &[Upload], multipart: bool, loc: &Loc) -> Result<Vec<Asset>, ApiError> {
    let map = match v {
        Value::Object(m) if !m.is_empty() => m,
        _ => {
            return Err(ApiError::invalid(
                loc.clone(),
                "'assets' must be a non-empty object of placeholder → {\"type\": \"image\", ...} (leave it out when there are no assets)",
                if v.is_object() { "too_short" } else { "type_error" },
            ))
        }
    };
    let mut out: Vec<Asset> = Vec::with_capacity(map.len());
    for (ph, a) in map {
        let l = loc.at(ph.as_str());
        if ph.is_empty() {
            return Err(ApiError::invalid(l, "asset placeholders must be non-empty strings", "value_error"));
        }
        let Value::Object(a) = a else {
            return Err(ApiError::invalid(l, format!("asset {ph:?} must be an object with type 'image'"), "type_error"));
        };
        if a.get("type") != Some(&Value::String("image".into())) {
            return Err(ApiError::invalid(l.at("type"), format!("asset {ph:?} must have type 'image'"), "value_error"));
        }
        let format_ok = |required: bool| match a.get("format") {
            Some(Value::String(f)) => matches!(f.as_str(), "png" | "jpg" | "jpeg"),
            None | Some(Value::Null) => !required,
            Some(_) => false,
        };
        match a.get("part") {
            Some(Value::Null) | None => {
                if !format_ok(true) {
                    return Err(ApiError::invalid(l.at("format"), format!("asset {ph:?}: format must be png, jpg or jpeg"), "value_error"));
                }
                match a.get("data_base64") {
                    Some(Value::String(d)) => out.push(Asset { placeholder: ph.clone(), part: None, data_base64: Some(d.clone()) }),
                    _ => {
                        return Err(ApiError::invalid(
                            l.at("data_base64"),
                            format!("asset {ph:?} needs a data_base64 string (or a multipart 'part')"),
                            "missing",
                        ))
                    }
                }
            }
            Some(Value::String(name)) => {
                if !format_ok(false) {
                    return Err(ApiError::invalid(l.at("format"), format!("asset {ph:?}: format must be png, jpg or jpeg"), "value_error"));
                }
                let pl = l.at("part");
                if !multipart {
                    return Err(ApiError::invalid(
                        pl,
                        format!("asset {ph:?} names the multipart part {name:?}, but the body is not multipart/form-data: send data_base64, or send the image as that part"),
                        "value_error",
                    ));
                }
                match parts.iter().filter(|p| &p.name == name).count() {
                    0 => {
                        return Err(ApiError::invalid(
                            pl,
                            format!("asset {ph:?} names the part {name:?}, which the multipart body does not have"),
                            "value_error",
                        ))
                    }
                    1 => {}
                    _ => {
                        return Err(ApiError::invalid(
                            pl,
                            format!("the multipart body has several parts named {name:?}; give each image part its own name"),
                            "value_error",
                        ))
                    }
                }
                if out.iter().any(|x| x.part.as_deref() == Some(name)) {
                    return Err(ApiError::invalid(
                        pl,
                        format!("the part {name:?} is claimed by more than one asset; each part belongs to exactly one asset"),
                        "value_error",
                    ));
                }
                out.push(Asset { placeholder: ph.clone(), part: Some(name.clone()), data_base64: None });
            }
            Some(_) => {
                return Err(ApiError::invalid(l.at("part"), format!("asset {ph:?}: part must be a string"), "type_error"));
            }
        }
    }
    Ok(out)
}

/// Replaces asset placeholders inside strings (object values and array items, recursively;
/// keys untouched) in one left-to-right pass, longest placeholder first at each position.
pub struct Replacer {
    /// (placeholder, replacement), longest placeholder first.
    pairs: Vec<(String, String)>,
}

impl Replacer {
    pub fn new(mut pairs: Vec<(String, String)>) -> Self {
        pairs.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        pairs.retain(|p| !p.0.is_empty());
        Replacer { pairs }
    }

    pub fn text(&self, s: &str) -> String {
        if self.pairs.is_empty() || !self.pairs.iter().any(|(p, _)| s.contains(p.as_str())) {
            return s.to_string();
        }
        let mut out = String::with_capacity(s.len());
        let mut i = 0;
        'scan: while i < s.len() {
            for (p, r) in &self.pairs {
                if s[i..].starts_with(p.as_str()) {
                    out.push_str(r);
                    i += p.len();
                    continue 'scan;
                }
            }
            let c = s[i..].chars().next().expect("in bounds");
            out.push(c);
            i += c.len_utf8();
        }
        out
    }

    pub fn value(&self, v: &Value) -> Value {
        if self.pairs.is_empty() {
            return v.clone();
        }
        match v {
            Value::String(s) => Value::String(self.text(s)),
            Value::Array(a) => Value::Array(a.iter().map(|x| self.value(x)).collect()),
            Value::Object(m) => Value::Object(m.iter().map(|(k, x)| (k.clone(), self.value(x))).collect()),
            other => other.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx(mode: ContractMode) -> ParseContext {
        ParseContext {
            mode,
            max_questions: 64,
            max_options: 255,
            image_limits: ImageLimits::default(),
            image_config: ImageProcessorConfig::default(),
        }
    }

    fn check(v: Value) -> Result<CheckedRequest, ApiError> {
        check_request(v, None, &ctx(ContractMode::Imajev))
    }

    fn check_ts(v: Value) -> Result<CheckedRequest, ApiError> {
        check_request(v, None, &ctx(ContractMode::Typesafe))
    }

    fn err(v: Value) -> (u16, &'static str, String) {
        let e = check(v).expect_err("should be refused");
        (e.status, e.code, e.summary())
    }

    fn noul(i: Value) -> Value {
        json!({"type": "noul", "instructions": i})
    }

    fn png() -> Vec<u8> {
        let img = image::RgbImage::from_fn(8, 6, |x, y| image::Rgb([x as u8 * 30, y as u8 * 40, 7]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn b64(b: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(b)
    }

    #[test]
    fn state_defaults_and_wrapping() {
        let q = json!({"q": noul(json!("Is it?"))});
        assert_eq!(check(json!({"questions": q})).unwrap().state, json!({}));
        assert_eq!(check(json!({"state": null, "questions": q})).unwrap().state, json!({"state": null}));
        assert_eq!(check(json!({"state": [1, "a"], "questions": q})).unwrap().state, json!({"state": [1, "a"]}));
        assert_eq!(check(json!({"state": 3.5, "questions": q})).unwrap().state, json!({"state": 3.5}));
        assert_eq!(check(json!({"state": "text", "questions": q})).unwrap().state, json!("text"));
        assert_eq!(check(json!({"state": {"a": 1}, "questions": q})).unwrap().state, json!({"a": 1}));
        // TypeSafe: state required and not null; lists still wrapped.
        assert_eq!(check_ts(json!({"questions": q})).unwrap_err().status, 422);
        assert_eq!(check_ts(json!({"state": null, "questions": q})).unwrap_err().status, 422);
        assert_eq!(check_ts(json!({"state": ["a"], "questions": q})).unwrap().state, json!({"state": ["a"]}));
        // model and unknown fields are ignored.
        assert!(check(json!({"model": 5, "x_trace": {}, "seed": 7, "questions": q})).is_ok());
    }

    #[test]
    fn state_limits() {
        let q = json!({"q": noul(json!("Is it?"))});
        let mut deep = json!("leaf");
        for _ in 0..8 {
            deep = json!({"d": deep});
        }
        // Eight levels of objects below the top: the leaf is at depth 8 — allowed.
        assert!(check(json!({"state": deep.clone(), "questions": q})).is_ok());
        // Wrapped inside one more object: depth 9.
        let (s, c, m) = err(json!({"state": {"x": deep}, "questions": q}));
        assert_eq!((s, c), (422, "invalid_request"));
        assert!(m.contains("nesting"), "{m}");
        // An empty list nine levels down is also too deep (the check runs before looking inside).
        let mut deep = json!([]);
        for _ in 0..9 {
            deep = json!([deep]);
        }
        assert_eq!(err(json!({"state": deep, "questions": q})).0, 422);
        // Size: compact JSON bytes, exactly at the limit and one over. {"s":"…"} is 8 bytes + n.
        let ok = "z".repeat(MAX_STATE_BYTES - 8);
        assert!(check(json!({"state": {"s": ok}, "questions": q})).is_ok());
        let over = "z".repeat(MAX_STATE_BYTES - 7);
        assert!(err(json!({"state": {"s": over}, "questions": q})).2.contains("131072"));
        // Multi-byte characters count as their UTF-8 bytes.
        let e = "é".repeat(MAX_STATE_BYTES / 2);
        assert_eq!(err(json!({"state": {"s": e}, "questions": q})).0, 422);
        // Non-finite numbers.
        let v: Value = serde_json::from_str(r#"{"state": {"x": 1e400}, "questions": {"q": {"type": "noul", "instructions": "?"}}}"#).unwrap();
        assert!(err(v).2.contains("not finite"));
    }

    #[test]
    fn questions_rules() {
        assert_eq!(err(json!({"state": {}})).1, "invalid_request");
        assert_eq!(err(json!({"questions": {}})).1, "invalid_request");
        assert_eq!(err(json!({"questions": []})).1, "invalid_request");
        let many: Map<String, Value> = (0..65).map(|i| (format!("q{i}"), noul(json!("?")))).collect();
        assert!(err(json!({"questions": many})).2.contains("at most 64"));
        let many: Map<String, Value> = (0..64).map(|i| (format!("q{i}"), noul(json!("?")))).collect();
        assert!(check(json!({"questions": many})).is_ok());
        assert_eq!(err(json!({"questions": {"": noul(json!("?"))}})).1, "invalid_request");
        assert!(err(json!({"questions": {"q": "Is it?"}})).2.contains("must be an object"));
        let m = err(json!({"questions": {"q": {"type": "boolean", "instructions": "?"}}})).2;
        assert!(m.contains("unsupported type \"boolean\"; use noul, choice, score or multi"), "{m}");
        assert!(err(json!({"questions": {"q": {"instructions": "?"}}})).2.contains("unsupported type missing"));
        // Any non-empty id works and is kept verbatim, in request order.
        let r = check(json!({"questions": {"ticket-1": noul(json!("a")), "with space": noul(json!("b")), "질문 🎯": noul(json!("c"))}}))
            .unwrap();
        let ids: Vec<&str> = r.questions.iter().map(|q| q.id.as_str()).collect();
        assert_eq!(ids, ["ticket-1", "with space", "질문 🎯"]);
    }

    #[test]
    fn instructions_flattening() {
        let q = |i: Value| check(json!({"questions": {"q": noul(i)}})).map(|r| r.questions[0].kind.clone());
        let text = |k: QuestionKind| match k {
            QuestionKind::Noul { question, .. } => question,
            _ => unreachable!(),
        };
        assert_eq!(text(q(json!("Is it?")).unwrap()), "Is it?");
        assert_eq!(
            text(q(json!({"task": "Decide", "include": ["refunds", "chargebacks"], "n": 1.0, "o": {"a": null}})).unwrap()),
            "task: Decide\ninclude: [\"refunds\", \"chargebacks\"]\nn: 1.0\no: {\"a\": null}"
        );
        assert_eq!(text(q(json!(["Route it.", 5, ["x"], "é"])).unwrap()), "Route it.\n5\n[\"x\"]\né");
        for bad in [json!(""), json!({}), json!([]), json!(null), json!(7), json!(true)] {
            assert_eq!(q(bad.clone()).unwrap_err().status, 422, "{bad}");
        }
        assert!(q(json!("i".repeat(2000))).is_ok());
        assert!(q(json!("é".repeat(2001))).unwrap_err().summary().contains("2001 characters"));
        // Missing instructions: refused in imajev mode, for every type in TypeSafe mode but noul.
        assert!(check(json!({"questions": {"q": {"type": "noul", "criteria": {"true": "yes it is"}}}})).is_err());
        let r = check_ts(json!({"state": "", "questions": {"q": {"type": "noul", "criteria": {"true": {"a": 1}, "false": "no"}}}})).unwrap();
        assert_eq!(r.questions[0].kind, QuestionKind::Noul { question: "a: 1".into(), yes: Some("a: 1".into()), no: Some("no".into()) });
        let r = check_ts(json!({"state": "", "questions": {"q": {"type": "noul", "criteria": {"false": "nope"}}}})).unwrap();
        assert_eq!(r.questions[0].kind, QuestionKind::Noul { question: "nope".into(), yes: None, no: Some("nope".into()) });
        assert!(check_ts(json!({"state": "", "questions": {"q": {"type": "noul"}}})).is_err());
        assert!(check_ts(json!({"state": "", "questions": {"q": {"type": "noul", "instructions": null, "criteria": {"true": "x"}}}})).is_err());
        assert!(check_ts(json!({"state": "", "questions": {"q": {"type": "choice", "criteria": {"a": null, "b": null}}}})).is_err());
    }

    #[test]
    fn descriptions() {
        let l = Loc::body();
        assert_eq!(flatten_description(&json!(null), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!(""), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!({}), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!([]), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!([""]), &l).unwrap(), None);
        assert_eq!(flatten_description(&json!("x"), &l).unwrap().as_deref(), Some("x"));
        assert_eq!(
            flatten_description(&json!({"owns": ["invoices", "refunds"], "n": 2}), &l).unwrap().as_deref(),
            Some("owns: [\"invoices\", \"refunds\"]; n: 2")
        );
        assert_eq!(flatten_description(&json!(["bugs", null, 1e2]), &l).unwrap().as_deref(), Some("bugs; null; 100.0"));
        assert!(flatten_description(&json!(5), &l).is_err());
        assert!(flatten_description(&json!(false), &l).is_err());
    }

    #[test]
    fn noul_choice_score_multi() {
        let one = |q: Value| check(json!({"questions": {"q": q}})).map(|r| r.questions[0].kind.clone());
        // noul criteria
        assert_eq!(
            one(json!({"type": "noul", "instructions": "?", "criteria": {"true": "yes", "false": null}})).unwrap(),
            QuestionKind::Noul { question: "?".into(), yes: Some("yes".into()), no: None }
        );
        assert!(one(json!({"type": "noul", "instructions": "?", "criteria": null})).is_ok());
        assert!(one(json!({"type": "noul", "instructions": "?", "criteria": "yes"})).is_err());
        assert!(one(json!({"type": "noul", "instructions": "?", "criteria": {"true": "d".repeat(2001)}})).is_err());
        // choice
        let c = |crit: Value| one(json!({"type": "choice", "instructions": "Which?", "criteria": crit}));
        assert_eq!(
            c(json!({"Billing": {"owns": ["a"]}, "Tech": ["bugs", "outages"], "Sales": "", "Other": null})).unwrap(),
            QuestionKind::Choice {
                question: "Which?".into(),
                options: vec![
                    ("Billing".into(), Some("owns: [\"a\"]".into())),
                    ("Tech".into(), Some("bugs; outages".into())),
                    ("Sales".into(), None),
                    ("Other".into(), None)
                ]
            }
        );
        assert!(c(json!({"a": null})).is_err());
        assert!(c(json!({})).is_err());
        assert!(c(json!(["a", "b"])).is_err());
        assert!(c(json!({"a": null, "__unknown__": null})).is_err());
        assert!(c(json!({"a": null, "": null})).is_err());
        assert!(c(json!({"a": null, "y".repeat(129): null})).is_err());
        assert!(c(json!({"a": null, "é".repeat(128): null})).is_ok());
        assert!(c(json!({"a": 5, "b": null})).is_err());
        assert!(c(json!({"a": "d".repeat(2001), "b": null})).is_err());
        let n255: Map<String, Value> = (0..255).map(|i| (i.to_string(), Value::Null)).collect();
        assert!(c(Value::Object(n255)).is_ok());
        let n256: Map<String, Value> = (0..256).map(|i| (i.to_string(), Value::Null)).collect();
        assert!(c(Value::Object(n256)).unwrap_err().summary().contains("2-255 options; got 256"));
        // score
        let s = |crit: Value| one(json!({"type": "score", "instructions": "How much?", "criteria": crit}));
        assert_eq!(
            s(json!(["low", {"label": "high"}])).unwrap(),
            QuestionKind::Score { question: "How much?".into(), levels: vec!["low".into(), "label: high".into()] }
        );
        assert!(s(json!({"0": "low", "1": "high"})).is_err());
        assert!(s(json!(["only"])).is_err());
        assert!(s(json!((0..11).map(|i| i.to_string()).collect::<Vec<_>>())).is_err());
        assert!(s(json!((0..10).map(|i| i.to_string()).collect::<Vec<_>>())).is_ok());
        assert!(s(json!(["low", null])).is_err());
        assert!(s(json!(["low", ""])).is_err());
        assert!(s(json!(["low", "x".repeat(2001)])).is_err());
        // multi
        let m = |crit: Value, t: Option<Value>| {
            let mut q = json!({"type": "multi", "instructions": "Which?", "criteria": crit});
            if let Some(t) = t {
                q["threshold"] = t;
            }
            one(q)
        };
        assert_eq!(
            m(json!({"a": null, "b": "bee"}), Some(json!(1))).unwrap(),
            QuestionKind::Multi {
                instructions: "Which?".into(),
                labels: vec![("a".into(), None), ("b".into(), Some("bee".into()))],
                threshold: 1.0
            }
        );
        assert!(matches!(m(json!({"a": null}), None).unwrap(), QuestionKind::Multi { threshold, .. } if threshold == 0.5));
        assert!(m(json!({}), None).is_err());
        assert!(m(json!((0..33).map(|i| (format!("l{i}"), Value::Null)).collect::<Map<_, _>>()), None).is_err());
        assert!(m(json!((0..32).map(|i| (format!("l{i}"), Value::Null)).collect::<Map<_, _>>()), None).is_ok());
        for t in [json!(1.5), json!(-0.1), json!(true), json!(null), json!("0.5")] {
            assert!(m(json!({"a": null}), Some(t.clone())).is_err(), "{t}");
        }
        // The label's question (instructions + label + description) must fit in 2000 characters.
        let q = json!({"type": "multi", "instructions": "w".repeat(1990), "criteria": {"label": "abc"}});
        assert!(one(q).is_err());
    }

    #[test]
    fn data_urls() {
        let l = Loc::body();
        let max = 20 << 20;
        let d = |s: &str| decode_data_url(&json!(s), &l, "images[0]", max);
        assert_eq!(d("data:image/png;base64,QUJD").unwrap(), b"ABC");
        assert_eq!(d("  data:;base64,QUI=\n").unwrap(), b"AB");
        assert_eq!(d("data:application/octet-stream;base64,QQ==").unwrap(), b"A");
        assert_eq!(d("data:image/png;base64,").unwrap(), b"");
        for bad in [
            "https://example.com/a.png",
            "data:image/png,QUJD",
            "data:image/png;charset=utf-8;base64,QUJD",
            "data:image/png;base64,QUJ*",
            "data:image/png;base64,QQ",
            "data:image/png;base64,QUJDR",
            "data:image/png;base64,QQ==QQ==",
            "data:image/png;base64,QU JD",
            "",
        ] {
            let e = d(bad).expect_err(bad);
            assert_eq!((e.status, e.code), (422, "bad_image"), "{bad}");
        }
        assert_eq!(decode_data_url(&json!(5), &l, "x", max).unwrap_err().code, "bad_image");
        // Longer than the base64 of 20 MiB: 413 before decoding (even if it is not base64).
        let long = format!("data:image/png;base64,{}", "*".repeat(max_b64_len(max) + 1));
        let e = d(&long).unwrap_err();
        assert_eq!((e.status, e.code), (413, "image_too_large"));
        assert!(d(&format!("data:image/png;base64,{}", "A".repeat(max_b64_len(max)))).is_ok());
    }

    #[test]
    fn strict_base64_matches_cpython() {
        // (input, CPython 3.11 base64.b64decode(s, validate=True))
        let cases: [(&str, Option<&[u8]>); 17] = [
            ("", Some(b"")),
            ("=", None),
            ("==", None),
            ("QQ", None),
            ("QQ=", None),
            ("QQ==", Some(b"A")),
            ("QR==", Some(b"A")),
            ("QUI=", Some(b"AB")),
            ("QUJD", Some(b"ABC")),
            ("QUJDR", None),
            ("QQ==QQ==", None),
            ("Q===", None),
            ("QUJD====", Some(b"ABC")),
            ("QQ===", None),
            ("QUI==", None),
            ("QUJD=", Some(b"ABC")),
            ("QUJD=QQ==", None),
        ];
        for (s, want) in cases {
            assert_eq!(strict_b64_decode(s).ok().as_deref(), want, "{s:?}");
        }
    }

    #[test]
    fn embedded_images_are_cut_out() {
        let p = b64(&png());
        let url = format!("data:image/png;base64,{p}");
        let mut found = Vec::new();
        let v = extract_embedded(
            json!({"a": format!("see {url} and data:image/x;base64,!! then {url}."), "k": [format!("{url}")], "n": 1}),
            &mut found,
        );
        assert_eq!(v, json!({"a": "see [image 1] and data:image/x;base64,!! then [image 2].", "k": ["[image 3]"], "n": 1}));
        assert_eq!(found.len(), 3);
        // Three images → refused before any decoding.
        let e = check(json!({"state": {"a": url.clone(), "b": url.clone()}, "images": [url.clone()], "questions": {"q": noul(json!("?"))}}))
            .unwrap_err();
        assert_eq!((e.status, e.code), (422, "bad_image"));
        // Explicit first, embedded after, and the state text refers to its own numbering.
        let r = check(json!({"state": format!("photo: {url}"), "images": [url.clone()], "questions": {"q": noul(json!("?"))}})).unwrap();
        assert_eq!(r.state, json!("photo: [image 1]"));
        assert_eq!(r.images.len(), 2);
        assert_eq!(r.images[1].what, "the data URL image 1 embedded in the state");
        // Not a string state: nothing to extract.
        assert!(check(json!({"state": 5, "questions": {"q": noul(json!("?"))}})).unwrap().images.is_empty());
    }

    #[test]
    fn images_field() {
        let q = json!({"q": noul(json!("?"))});
        for bad in [json!("data:image/png;base64,QUJD"), json!(null), json!({})] {
            let e = check(json!({"images": bad, "questions": q})).unwrap_err();
            assert_eq!((e.status, e.code), (422, "bad_image"));
        }
        // Corrupt image bytes pass the wire rules and fail decoding.
        let r = check(json!({"images": ["data:image/png;base64,aGVsbG8="], "questions": q})).unwrap();
        let e = decode_images(&r.images, &ctx(ContractMode::Imajev)).unwrap_err();
        assert_eq!((e.status, e.code), (422, "bad_image"));
        // A real PNG decodes; sha256 is of the encoded bytes.
        let png = png();
        let r = check(json!({"images": [format!("data:image/png;base64,{}", b64(&png))], "questions": q})).unwrap();
        let imgs = decode_images(&r.images, &ctx(ContractMode::Imajev)).unwrap();
        use sha2::Digest;
        assert_eq!(imgs[0].sha256, hex::encode(sha2::Sha256::digest(&png)));
        assert_eq!((imgs[0].width, imgs[0].height), (8, 6));
    }

    #[test]
    fn assets_and_placeholders() {
        let png = png();
        let ph1 = "<image:0123456789abcdef0123456789abcdef>";
        let ph2 = "<image:0123456789abcdef0123456789abcdee>";
        let url = format!("data:image/png;base64,{}", b64(&png));
        let body = json!({
            "state": {"photo": format!("look at {ph2}, then {url}"), "list": [ph1], ph1: "keys stay"},
            "questions": {
                "q": {"type": "noul", "instructions": {"ask": format!("Is {ph1} like {ph2}?")}, "criteria": {"true": [ph1]}},
                "c": {"type": "choice", "instructions": "Which?", "criteria": {ph1: format!("same as {ph2}"), "b": null}}
            },
            "assets": {
                ph1: {"type": "image", "format": "png", "data_base64": b64(&png)},
                ph2: {"type": "image", "part": "asset-0"}
            }
        });
        let files = MultipartFiles {
            images: vec![Upload { name: "image".into(), is_file: true, bytes: png.clone() }],
            parts: vec![Upload { name: "asset-0".into(), is_file: true, bytes: png.clone() }],
        };
        let c = ctx(ContractMode::Typesafe);
        // upload = image 1, embedded data URL = image 2 ... that is 4 images: too many.
        let e = check_request(body.clone(), Some(files.clone()), &c).unwrap_err();
        assert_eq!(e.code, "bad_image");
        // Without the upload and the embedded URL: assets are images 1 and 2 in 'assets' order.
        let mut body2 = body.clone();
        body2["state"]["photo"] = json!(format!("look at {ph2}"));
        let files2 = MultipartFiles { images: vec![], parts: files.parts.clone() };
        let r = check_request(body2.clone(), Some(files2.clone()), &c).unwrap();
        assert_eq!(r.state, json!({"photo": "look at [image 2]", "list": ["[image 1]"], ph1: "keys stay"}));
        assert_eq!(
            r.questions[0].kind,
            QuestionKind::Noul { question: "ask: Is [image 1] like [image 2]?".into(), yes: Some("[image 1]".into()), no: None }
        );
        // Option values are keys: untouched; descriptions are replaced.
        assert_eq!(
            r.questions[1].kind,
            QuestionKind::Choice { question: "Which?".into(), options: vec![(ph1.into(), Some("same as [image 2]".into())), ("b".into(), None)] }
        );
        assert_eq!(r.images.len(), 2);
        // With one explicit image, the assets become images 2 and 3 → too many; with one asset, image 2.
        let mut body3 = body2.clone();
        body3["assets"].as_object_mut().unwrap().remove(ph2);
        body3["images"] = json!([url]);
        let r = check_request(body3, Some(MultipartFiles::default()), &c).unwrap();
        assert_eq!(r.state["list"], json!(["[image 2]"]));
        // A part reference in a JSON body, an unclaimed file part, a part claimed twice, a missing part.
        assert!(check_request(body2.clone(), None, &c).unwrap_err().summary().contains("not multipart"));
        let extra = MultipartFiles {
            images: vec![],
            parts: vec![files.parts[0].clone(), Upload { name: "asset-9".into(), is_file: true, bytes: png.clone() }],
        };
        assert!(check_request(body2.clone(), Some(extra), &c).unwrap_err().summary().contains("not claimed"));
        let mut twice = body2.clone();
        twice["assets"][ph1] = json!({"type": "image", "part": "asset-0"});
        assert!(check_request(twice, Some(files2.clone()), &c).unwrap_err().summary().contains("more than one asset"));
        assert!(check_request(body2.clone(), Some(MultipartFiles::default()), &c).unwrap_err().summary().contains("does not have"));
        // Unclaimed text parts are ignored.
        let text = MultipartFiles {
            images: vec![],
            parts: vec![files.parts[0].clone(), Upload { name: "note".into(), is_file: false, bytes: b"hi".to_vec() }],
        };
        assert!(check_request(body2.clone(), Some(text), &c).is_ok());
        // Asset shape rules.
        let q = json!({"q": noul(json!("?"))});
        for bad in [
            json!({}),
            json!([]),
            json!({"": {"type": "image", "format": "png", "data_base64": "QUJD"}}),
            json!({"p": {"type": "video", "format": "png", "data_base64": "QUJD"}}),
            json!({"p": {"type": "image", "format": "gif", "data_base64": "QUJD"}}),
            json!({"p": {"type": "image", "data_base64": "QUJD"}}),
            json!({"p": {"type": "image", "format": "png"}}),
            json!({"p": "QUJD"}),
        ] {
            let e = check_request(json!({"state": "", "questions": q, "assets": bad}), None, &c).unwrap_err();
            assert_eq!((e.status, e.code), (422, "invalid_request"), "{bad}");
        }
        let e = check_request(
            json!({"state": "", "questions": q, "assets": {"p": {"type": "image", "format": "png", "data_base64": "QU*D"}}}),
            None,
            &c,
        )
        .unwrap_err();
        assert_eq!(e.code, "bad_image");
    }

    #[test]
    fn replacer_is_leftmost_longest_single_pass() {
        let r = Replacer::new(vec![("ab".into(), "[image 1]".into()), ("abc".into(), "[image 2]".into())]);
        assert_eq!(r.text("xabcab abab"), "x[image 2][image 1] [image 1][image 1]");
        // Replacements are never re-scanned.
        let r = Replacer::new(vec![("[".into(), "[image 1]".into())]);
        assert_eq!(r.text("a[b"), "a[image 1]b");
    }

    #[test]
    fn multipart_uploads() {
        let png = png();
        let q = json!({"q": noul(json!("?"))});
        let up = |name: &str, is_file: bool, bytes: Vec<u8>| Upload { name: name.into(), is_file, bytes };
        let files = MultipartFiles { images: vec![up("image", true, png.clone()), up("images", true, png.clone())], parts: vec![] };
        let r = check_request(json!({"questions": q}), Some(files), &ctx(ContractMode::Imajev)).unwrap();
        assert_eq!(r.images.len(), 2);
        let files = MultipartFiles { images: vec![up("image", false, png.clone())], parts: vec![] };
        assert_eq!(check_request(json!({"questions": q}), Some(files), &ctx(ContractMode::Imajev)).unwrap_err().code, "bad_image");
        let big = MultipartFiles { images: vec![up("image", true, vec![0; (20 << 20) + 1])], parts: vec![] };
        let e = check_request(json!({"questions": q}), Some(big), &ctx(ContractMode::Imajev)).unwrap_err();
        assert_eq!((e.status, e.code), (413, "image_too_large"));
    }

    #[test]
    fn body_must_be_an_object_and_json() {
        assert_eq!(check(json!([1])).unwrap_err().code, "bad_request");
        let e = parse_json(b"{\"questions\": {", Loc::body()).unwrap_err();
        assert_eq!((e.status, e.code), (422, "bad_json"));
        assert!(parse_json(b"\xEF\xBB\xBF{}", Loc::body()).is_ok());
        // Duplicate keys: the last value wins at the first key's position (as json.loads).
        let v = parse_json(br#"{"a": 1, "b": 2, "a": 3}"#, Loc::body()).unwrap();
        assert_eq!(serde_json::to_string(&v).unwrap(), r#"{"a":3,"b":2}"#);
    }
}
