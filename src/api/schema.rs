//! The wire types of the API, for its JSON Schemas and OpenAPI document.
//!
//! The request is parsed by hand (`super::parse`), because its rules (flattening, limits,
//! imajev's error order) go beyond what a schema says; these types describe the same wire
//! format for clients and generators, and tests keep them honest: real responses round-trip
//! through [`SystemOneResponse`], and `schemas/*.json` must equal what is generated here
//! (`IMAJEV_UPDATE_SCHEMAS=1 cargo test --test api_schemas` refreshes them).

use schemars::generate::SchemaSettings;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// Instructions or a description: a string, an object (one `key: value` line per entry in the
/// model's prompt; non-string values are written as JSON) or an array (one line per item).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Text {
    String(String),
    Object(Map<String, Value>),
    Array(Vec<Value>),
}

/// The body of `POST /v1/systemone` (as JSON, or as the `request` part of a
/// `multipart/form-data` body). Unknown top-level fields are ignored.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct SystemOneRequest {
    /// Accepted whatever it names, and ignored (the response names the served model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// What the questions are about: a string or an object (anything else is wrapped as
    /// `{"state": value}`). Nesting depth ≤ 8, ≤ 131,072 bytes as compact UTF-8 JSON, finite
    /// numbers. Image data URLs inside its strings become images (`[image N]` in the text).
    /// Optional in the imajev contract mode (default `{}`); required and not null in the TypeSafe mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Value>,
    /// Question id (any non-empty string, echoed back, never shown to the model) → question.
    #[schemars(extend("minProperties" = 1))]
    pub questions: BTreeMap<String, Question>,
    /// Up to two `data:image/...;base64,...` URLs (JPEG, PNG or WebP, ≤ 20 MiB each, ≤ 20
    /// million pixels). First = reference, second = target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2))]
    pub images: Option<Vec<String>>,
    /// TypeSafe assets: placeholder → image. Every occurrence of a placeholder inside a string of
    /// `state`, `instructions` or a criteria description is replaced by `[image K]`, K being the
    /// image's position among all images of the request. At least one entry when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("minProperties" = 1))]
    pub assets: Option<BTreeMap<String, Asset>>,
}

/// An image asset: inline base64, or the name of a part of the `multipart/form-data` body.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Asset {
    #[serde(rename = "type")]
    pub kind: AssetType,
    /// Required with `data_base64`; the format is detected from the bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<AssetFormat>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
    /// The multipart part holding the image bytes; each part is claimed by exactly one asset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AssetType {
    Image,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AssetFormat {
    Png,
    Jpg,
    Jpeg,
}

/// One question.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Question {
    Noul(NoulQuestion),
    Choice(ChoiceQuestion),
    Score(ScoreQuestion),
    Multi(MultiQuestion),
}

/// A yes/no question or statement. Answer: P(yes) + ½·P(unknown).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct NoulQuestion {
    /// 1–2000 characters once flattened. Required, except in the TypeSafe contract mode when
    /// `criteria` describes a side (its text is then the question).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<Text>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criteria: Option<NoulCriteria>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct NoulCriteria {
    /// What counts as yes (≤ 2000 characters once flattened).
    #[serde(default, rename = "true", skip_serializing_if = "Option::is_none")]
    pub yes: Option<Text>,
    /// What counts as no.
    #[serde(default, rename = "false", skip_serializing_if = "Option::is_none")]
    pub no: Option<Text>,
}

/// One of the options.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ChoiceQuestion {
    pub instructions: Text,
    /// Option (1–128 characters, not `__unknown__`) → description or null; 2 to the adapter's
    /// `max_options` (255 with a 256-code readout) entries, in the order shown to the model.
    #[schemars(extend("minProperties" = 2, "maxProperties" = 255))]
    pub criteria: BTreeMap<String, Option<Text>>,
}

/// A rating: levels 0..n−1 described lowest first.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ScoreQuestion {
    pub instructions: Text,
    /// 2–10 level descriptions (an array; the object form is refused).
    #[schemars(length(min = 2, max = 10))]
    pub criteria: Vec<Text>,
}

/// Any subset of labels (imajev extension): one noul per label.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct MultiQuestion {
    pub instructions: Text,
    /// Label → description or null; 1–32 entries.
    #[schemars(extend("minProperties" = 1, "maxProperties" = 32))]
    pub criteria: BTreeMap<String, Option<Text>>,
    /// A label is selected when its noul value exceeds this (default 0.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub threshold: Option<f64>,
}

/// The 200 response of `POST /v1/systemone`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct SystemOneResponse {
    /// The served model's name.
    pub model: String,
    /// One answer per question id, in request order.
    pub answers: BTreeMap<String, Answer>,
    pub usage: Usage,
}

/// Fields imajev adds to every noul/choice/score answer: unprefixed in the imajev contract
/// mode, prefixed `x_` in the TypeSafe mode.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct AnswerExtras {
    /// Probability of the trained "unknown" candidate (after calibration when configured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown_probability: Option<f64>,
    /// The unknown candidate scored highest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abstained: Option<bool>,
    /// The calibration file's version, when one produced the probabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_unknown_probability: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_abstained: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_calibration_version: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Answer {
    Noul(NoulAnswer),
    Choice(ChoiceAnswer),
    Score(ScoreAnswer),
    Multi(MultiAnswer),
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct NoulAnswer {
    /// P(yes) + ½·P(unknown), in [0, 1].
    pub noul: f64,
    #[serde(flatten)]
    pub extras: AnswerExtras,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ChoiceAnswer {
    /// The selected option (the most probable one when the model abstained).
    pub choice: String,
    /// Option → probability over the real options (unknown removed), in criteria order.
    pub probabilities: BTreeMap<String, f64>,
    /// imajev mode: concentration × (1 − unknown); TypeSafe mode: (max − 1/n)/(1 − 1/n).
    pub confidence: f64,
    #[serde(flatten)]
    pub extras: AnswerExtras,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ScoreAnswer {
    /// Σ level × p(level).
    pub score: f64,
    /// `"0".."n-1"` → the level's (flattened) description.
    pub legend: BTreeMap<String, String>,
    /// `"0".."n-1"` → probability over the levels (unknown removed).
    pub probabilities: BTreeMap<String, f64>,
    pub confidence: f64,
    #[serde(flatten)]
    pub extras: AnswerExtras,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct MultiAnswer {
    /// Selected labels (noul value > threshold), in criteria order.
    pub labels: Vec<String>,
    /// Label → its noul value.
    pub probabilities: BTreeMap<String, f64>,
    pub threshold: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown_probabilities: Option<BTreeMap<String, f64>>,
    /// Every label abstained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abstained: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_unknown_probabilities: Option<BTreeMap<String, f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_abstained: Option<bool>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    /// Tokens of the longest pass (image tokens included).
    pub input_tokens: u64,
    /// Always 0: nothing is generated.
    pub output_tokens: u64,
    /// Tokens the engine ran (shared prefix once, every pass's own tokens).
    pub processed_tokens: u64,
    /// Forward passes (question × rotation).
    pub passes: u64,
    pub rotations: u64,
    pub vision_ms: f64,
    /// The separate prefill of the shared prefix; 0 when the prefix ran in the same forward as
    /// the passes (whenever they fit in one packed batch together), which `questions_ms` counts.
    pub prefill_ms: f64,
    pub questions_ms: f64,
    pub total_ms: f64,
    /// One entry per image, in request order.
    pub images: Vec<UsageImage>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct UsageImage {
    /// SHA-256 (hex) of the image bytes as sent.
    pub sha256: String,
    /// Size after EXIF orientation.
    pub width: u32,
    pub height: u32,
}

/// A 422: what to fix, where (FastAPI's validation shape plus imajev's code).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ValidationErrorBody {
    /// `invalid_request`, `bad_json`, `bad_image` or `bad_request`.
    pub error: String,
    pub detail: Vec<ValidationItem>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ValidationItem {
    /// Path into the body, starting with `"body"`.
    pub loc: Vec<LocItem>,
    pub msg: String,
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum LocItem {
    Key(String),
    Index(u64),
}

/// Every other error (TypeSafe's shape plus imajev's code).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    /// E.g. `authentication_error`, `image_too_large`, `request_too_large`,
    /// `unsupported_media_type`, `overloaded`, `timeout`, `loading`, `unavailable`,
    /// `too_many_connections`, `request_timeout`, `malformed_request`, `headers_too_large`,
    /// `not_found`, `method_not_allowed`, `internal_error`.
    pub error: String,
    pub detail: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ErrorDetail {
    pub error_type: String,
    pub message: String,
}

/// `GET /v1/models`: imajev's fields plus TypeSafe's `models` list.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ModelsResponse {
    pub models: Vec<ModelEntry>,
    pub model: String,
    /// The adapter folder (or its label), if any.
    pub adapter: Option<String>,
    pub backend: String,
    pub loaded: bool,
    pub load_seconds: f64,
    pub readout_codes: u64,
    pub prompt_layout: String,
    pub max_options: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ModelEntry {
    pub name: String,
    pub description: String,
    /// `YYYY-MM-DD`.
    pub release_date: String,
}

/// `GET /healthz`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Health {
    /// `ok`, `loading` or `failed`.
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub queue_depth: u64,
    pub queue_capacity: u64,
}

/// `GET /livez`: liveness, apart from readiness (`/healthz`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Liveness {
    /// `alive` (200: loading or serving; restarting would not help) or `failed` (503: the model
    /// failed to load and the process is stopping).
    pub status: String,
    /// While alive: `loading` or `ready`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// When failed: why the model did not load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn root_schema<T: JsonSchema>() -> Value {
    SchemaSettings::draft2020_12().into_generator().into_root_schema_for::<T>().to_value()
}

/// `schemas/request.schema.json`.
pub fn request_schema() -> Value {
    root_schema::<SystemOneRequest>()
}

/// `schemas/response.schema.json`.
pub fn response_schema() -> Value {
    root_schema::<SystemOneResponse>()
}

/// `schemas/openapi.json` (also served at `GET /openapi.json`).
pub fn openapi() -> Value {
    let mut g = SchemaSettings::draft2020_12()
        .with(|s| {
            s.definitions_path = "/components/schemas".into();
            s.meta_schema = None;
        })
        .into_generator();
    let r = |s: schemars::Schema| s.to_value();
    let request = r(g.subschema_for::<SystemOneRequest>());
    let response = r(g.subschema_for::<SystemOneResponse>());
    let validation = r(g.subschema_for::<ValidationErrorBody>());
    let error = r(g.subschema_for::<ErrorBody>());
    let models = r(g.subschema_for::<ModelsResponse>());
    let health = r(g.subschema_for::<Health>());
    let liveness = r(g.subschema_for::<Liveness>());
    let schemas = g.take_definitions(true);
    let err = |d: &str| json!({"description": d, "content": {"application/json": {"schema": error}}});
    let retry = json!({
        "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}},
        "retry-after-ms": {"description": "Milliseconds to wait before retrying", "schema": {"type": "integer"}}
    });
    let request_id = json!({
        "x-request-id": {"description": "The request's id (echoed when the client sent a sane one)", "schema": {"type": "string"}},
        "x-typesafe-request-id": {"description": "Same as x-request-id", "schema": {"type": "string"}}
    });
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "imajev-serve",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Typed decisions (noul, choice, score, multi) from one prefill of Qwen3.5 with the imajev LoRA and readout. Compatible with the TypeSafe System One contract.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"}
        },
        "paths": {
            "/v1/systemone": {"post": {
                "operationId": "systemone",
                "summary": "Answer typed questions about a state and up to two images",
                "security": [{}, {"bearer": []}],
                "parameters": [
                    {"name": "Content-Encoding", "in": "header", "required": false,
                     "description": "zstd, gzip or identity (request body compression)",
                     "schema": {"type": "string", "enum": ["identity", "zstd", "gzip"]}}
                ],
                "requestBody": {"required": true, "content": {
                    "application/json": {"schema": request},
                    "multipart/form-data": {
                        "schema": {"type": "object", "required": ["request"], "properties": {
                            "request": {"description": "The JSON request (text or file part)", "type": "string", "contentMediaType": "application/json"},
                            "image": {"type": "array", "items": {"type": "string", "contentMediaType": "application/octet-stream"}},
                            "images": {"type": "array", "items": {"type": "string", "contentMediaType": "application/octet-stream"}},
                            "image[]": {"type": "array", "items": {"type": "string", "contentMediaType": "application/octet-stream"}}
                        }, "additionalProperties": {"description": "An asset part, named by an asset's `part`", "type": "string", "contentMediaType": "application/octet-stream"}},
                        "encoding": {"request": {"contentType": "application/json, text/plain"}}
                    }
                }},
                "responses": {
                    "200": {"description": "One answer per question", "headers": request_id, "content": {"application/json": {"schema": response}}},
                    "400": err("malformed_request: the HTTP layer could not read the request (a garbage request line, TLS or HTTP/2 bytes, a bad Content-Length or Transfer-Encoding, no Host); the connection is closed"),
                    "401": err("authentication_error: missing or wrong API key (only when keys are configured)"),
                    "408": err("request_timeout: the request head did not arrive within --head-timeout, or the body came slower than --body-timeout and --min-body-rate allow; the connection is closed"),
                    "413": err("request_too_large, image_too_large, or bad_image (over 20 million pixels); also a request over the processed-token limit"),
                    "415": err("unsupported_media_type: not application/json or multipart/form-data, or an unknown Content-Encoding"),
                    "422": {"description": "invalid_request, bad_json, bad_image, bad_request", "content": {"application/json": {"schema": validation}}},
                    "431": err("headers_too_large: more than 96 header lines, or a request head over 64 KiB"),
                    "500": err("internal_error"),
                    "503": {"description": "loading: the model is not loaded yet; unavailable: it failed to load or the engine stopped; too_many_connections: over --max-connections (the connection is closed)", "headers": retry, "content": {"application/json": {"schema": error}}},
                    "504": err("timeout: the request's deadline passed; its work was abandoned (the message says at which stage)"),
                    "529": {"description": "overloaded: the queue is full", "headers": retry, "content": {"application/json": {"schema": error}}}
                }
            }},
            "/v1/models": {"get": {
                "operationId": "models",
                "summary": "The served model",
                "responses": {
                    "200": {"description": "The served model", "content": {"application/json": {"schema": models}}},
                    "503": err("loading")
                }
            }},
            "/healthz": {"get": {
                "operationId": "health",
                "summary": "Readiness",
                "responses": {
                    "200": {"description": "Ready", "content": {"application/json": {"schema": health}}},
                    "503": {"description": "Loading or failed", "content": {"application/json": {"schema": health}}}
                }
            }},
            "/livez": {"get": {
                "operationId": "liveness",
                "summary": "Liveness: the process serves or is loading the model",
                "responses": {
                    "200": {"description": "Alive (loading or ready)", "content": {"application/json": {"schema": liveness}}},
                    "503": {"description": "The model failed to load; the process is stopping", "content": {"application/json": {"schema": liveness}}}
                }
            }},
            "/metrics": {"get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics",
                "responses": {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}
            }},
            "/openapi.json": {"get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {"200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}
            }}
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "Only when the server is started with API keys"}}
        }
    })
}

/// The checked-in files under `schemas/`: (file name, contents).
pub fn schema_files() -> Vec<(&'static str, String)> {
    let pretty = |v: Value| serde_json::to_string_pretty(&v).expect("serialising a schema") + "\n";
    vec![
        ("request.schema.json", pretty(request_schema())),
        ("response.schema.json", pretty(response_schema())),
        ("openapi.json", pretty(openapi())),
    ]
}
