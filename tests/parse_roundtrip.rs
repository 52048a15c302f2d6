//! Property tests of the wire rules: parse → render → parse of valid requests.
//!
//! *Render* is written here, not in the server: a checked request ([`CheckedRequest`]: the state,
//! the questions in the model's words, the encoded images) written back as the plainest request
//! body that says the same — the state as it is, every question's instructions and descriptions
//! as strings, every image in the `images` list. Two properties, over random valid requests:
//!
//! * a request already in that plain form is parsed to exactly what it says (nothing trimmed,
//!   normalised, reordered or dropped: any Unicode, control characters, special-token text,
//!   numbers as written, question ids and option values verbatim), and rendering that again
//!   gives the same bytes;
//! * any valid request, in every form the rules accept (a state that is not an object and gets
//!   wrapped, data URLs embedded in state strings, instructions and descriptions given as objects
//!   or arrays and flattened, nulls for missing descriptions), parses to a request whose
//!   rendering parses to the same request again: parsing is a projection, so what a client sees
//!   echoed (`usage.images`, question ids) and what the model reads is stable.
//!
//! Both run the whole entry point too ([`parse_request`]: JSON bytes to decoded images), so a
//! body the rules accept is never refused later by the decoding step.

use base64::Engine;
use imajev_serve::api::error::Loc;
use imajev_serve::api::parse::{
    check_request, parse_json, parse_request, CheckedRequest, ParseContext, RequestBody,
};
use imajev_serve::decision::{ContractMode, Question, QuestionKind};
use imajev_serve::image::{ImageLimits, ImageProcessorConfig};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use serde_json::{json, Map, Number, Value};

fn ctx() -> ParseContext {
    ParseContext {
        mode: ContractMode::Imajev,
        max_questions: 64,
        max_options: 255,
        image_limits: ImageLimits::default(),
        image_config: ImageProcessorConfig::default(),
    }
}

// ------------------------------------------------------------------------------- render

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn opt(d: &Option<String>) -> Value {
    d.as_ref().map(|s| Value::String(s.clone())).unwrap_or(Value::Null)
}

fn pairs(items: &[(String, Option<String>)]) -> Value {
    Value::Object(items.iter().map(|(k, d)| (k.clone(), opt(d))).collect())
}

/// Instructions as one string, except empty ones: the contract refuses `""` but accepts `[""]`,
/// which flattens to the same empty text (found by this test, seed in the CI log of 2eb8349).
fn instructions(text: &str) -> Value {
    if text.is_empty() {
        json!([""])
    } else {
        json!(text)
    }
}

fn render_question(kind: &QuestionKind) -> Value {
    match kind {
        QuestionKind::Noul { question, yes, no } => {
            json!({"type": "noul", "instructions": instructions(question),
                                                            "criteria": {"true": opt(yes), "false": opt(no)}})
        }
        QuestionKind::Choice { question, options } => {
            json!({"type": "choice", "instructions": instructions(question), "criteria": pairs(options)})
        }
        QuestionKind::Score { question, levels } => {
            json!({"type": "score", "instructions": instructions(question), "criteria": levels})
        }
        QuestionKind::Multi { instructions: text, labels, threshold } => json!({"type": "multi",
            "instructions": instructions(text), "criteria": pairs(labels), "threshold": threshold}),
    }
}

/// The plainest body that says what `state`, `questions` and the PNGs `images` say.
fn render(state: &Value, questions: &[Question], images: &[Vec<u8>]) -> Vec<u8> {
    let mut body = Map::new();
    body.insert("state".into(), state.clone());
    let qs: Map<String, Value> = questions.iter().map(|q| (q.id.clone(), render_question(&q.kind))).collect();
    body.insert("questions".into(), Value::Object(qs));
    if !images.is_empty() {
        body.insert("images".into(), images.iter().map(|b| Value::String(data_url(b))).collect());
    }
    serde_json::to_vec(&Value::Object(body)).unwrap()
}

fn render_checked(c: &CheckedRequest) -> Vec<u8> {
    let images: Vec<Vec<u8>> = c.images.iter().map(|b| b.bytes.clone()).collect();
    render(&c.state, &c.questions, &images)
}

/// The rules on a body's bytes (the JSON step included), images still encoded.
fn check_bytes(body: &[u8]) -> Result<CheckedRequest, String> {
    let v = parse_json(body, Loc::body()).map_err(|e| e.to_string())?;
    check_request(v, None, &ctx()).map_err(|e| e.to_string())
}

/// The whole entry point accepts `body`, and decodes the images `checked` holds, in its order.
fn assert_fully_parsed(body: &[u8], checked: &CheckedRequest) {
    let parsed = parse_request(RequestBody::json(body.to_vec()), &ctx())
        .unwrap_or_else(|e| panic!("the rules accepted it, the entry point refused it: {e}"));
    assert_eq!(parsed.request.state, checked.state);
    assert_eq!(parsed.request.questions, checked.questions);
    assert_eq!(parsed.request.images.len(), checked.images.len());
    assert_eq!(parsed.pixels.len(), checked.images.len());
    for (img, blob) in parsed.request.images.iter().zip(&checked.images) {
        let png = image::load_from_memory(&blob.bytes).unwrap();
        assert_eq!((img.width, img.height), (png.width(), png.height()));
    }
}

// --------------------------------------------------------------------------- generators

/// Any text of 1..=`max` characters: any Unicode scalar, control characters and newlines
/// included, and now and then text that looks like a chat-template token.
fn text(max: usize) -> BoxedStrategy<String> {
    prop_oneof![
        6 => proptest::string::string_regex(&format!("(?s).{{1,{max}}}")).unwrap(),
        1 => prop::sample::select(vec!["<|im_start|>", "<|im_end|>", "<|image_pad|>", "</think>", "é\u{301}", "\r\n\t\"\\"])
            .prop_map(String::from),
    ]
    .boxed()
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(|i| Value::Number(i.into())),
        any::<u64>().prop_map(|u| Value::Number(u.into())),
        (prop::num::f64::POSITIVE
            | prop::num::f64::NEGATIVE
            | prop::num::f64::NORMAL
            | prop::num::f64::SUBNORMAL
            | prop::num::f64::ZERO)
            .prop_map(|f| Value::Number(Number::from_f64(f).unwrap())),
    ]
}

/// Any JSON value, nested at most 4 deep (within the state's limits).
fn json_value() -> impl Strategy<Value = Value> {
    nested_json(4, 48)
}

/// Any JSON value of about `size` values, nested at most `depth` deep.
fn nested_json(depth: u32, size: u32) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        proptest::string::string_regex("(?s).{0,20}").unwrap().prop_map(Value::String),
    ];
    leaf.prop_recursive(depth, size, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((proptest::string::string_regex("(?s).{0,12}").unwrap(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// 1..=`n` distinct keys, in a random order (`filter`ed as the rules need).
fn keys(n: usize, ok: fn(&str) -> bool) -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(text(24), 1..=n).prop_map(move |ks| {
        let mut seen = std::collections::HashSet::new();
        ks.into_iter().filter(|k| ok(k) && seen.insert(k.clone())).collect::<Vec<_>>()
    })
}

fn option_value_ok(k: &str) -> bool {
    k != "__unknown__"
}

fn described(n: usize, min: usize) -> impl Strategy<Value = Vec<(String, Option<String>)>> {
    keys(n, option_value_ok)
        .prop_filter("too few distinct keys", move |ks| ks.len() >= min)
        .prop_flat_map(|ks| {
            let len = ks.len();
            (Just(ks), prop::collection::vec(prop::option::of(text(60)), len))
        })
        .prop_map(|(ks, ds)| ks.into_iter().zip(ds).collect())
}

/// A question of any type in its plain form.
fn question_kind() -> impl Strategy<Value = QuestionKind> {
    prop_oneof![
        (text(120), prop::option::of(text(60)), prop::option::of(text(60)))
            .prop_map(|(question, yes, no)| QuestionKind::Noul { question, yes, no }),
        (text(120), described(8, 2))
            .prop_map(|(question, options)| QuestionKind::Choice { question, options }),
        (text(120), prop::collection::vec(text(40), 2..=10))
            .prop_map(|(question, levels)| QuestionKind::Score { question, levels }),
        (text(120), described(6, 1), 0.0..=1.0f64).prop_map(|(instructions, labels, threshold)| {
            QuestionKind::Multi { instructions, labels, threshold }
        }),
    ]
}

fn questions() -> impl Strategy<Value = Vec<Question>> {
    keys(6, |_| true)
        .prop_flat_map(|ids| {
            let n = ids.len();
            (Just(ids), prop::collection::vec(question_kind(), n))
        })
        .prop_map(|(ids, kinds)| ids.into_iter().zip(kinds).map(|(id, kind)| Question { id, kind }).collect())
}

/// A PNG of `w`×`h` pixels, its colours from `seed`.
fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([seed ^ x as u8, y as u8, seed]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

fn pngs(max: usize) -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop::collection::vec((8u32..64, 8u32..64, any::<u8>()), 0..=max)
        .prop_map(|v| v.into_iter().map(|(w, h, s)| png(w, h, s)).collect())
}

/// A state in its plain form: a string, or an object of any values.
fn plain_state() -> impl Strategy<Value = Value> {
    prop_oneof![
        proptest::string::string_regex("(?s).{0,80}").unwrap().prop_map(Value::String),
        prop::collection::vec((proptest::string::string_regex("(?s).{0,12}").unwrap(), json_value()), 0..8)
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
    ]
}

/// Text as a client may send it where the rules flatten it: a string, an object of `key: value`
/// lines, or an array of items (strings, numbers, booleans, null, small nested values: all of
/// it well within the 2,000 characters a text may have once flattened).
fn flattenable(max: usize) -> impl Strategy<Value = Value> {
    let item = prop_oneof![
        4 => text(max).prop_map(Value::String),
        1 => number(),
        1 => any::<bool>().prop_map(Value::Bool),
        1 => nested_json(2, 6),
    ];
    prop_oneof![
        3 => text(max).prop_map(Value::String),
        1 => prop::collection::vec((text(12), item.clone()), 1..4).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        1 => prop::collection::vec(item, 1..4).prop_map(Value::Array),
    ]
}

/// Instructions a noul, choice or score question accepts: any flattenable form except one that
/// flattens to no text (`[""]`: its question would be empty, which the contract refuses; a multi
/// question still reads its labels, so multi takes any flattenable form).
fn question_instructions() -> impl Strategy<Value = Value> {
    flattenable(80).prop_filter("flattens to no text", |v| match v {
        Value::Array(a) => !matches!(a.as_slice(), [Value::String(s)] if s.is_empty()),
        _ => true,
    })
}

/// A question as a client may send it: instructions and descriptions in any accepted form.
fn wire_question() -> impl Strategy<Value = Value> {
    let desc = || prop_oneof![1 => Just(Value::Null), 3 => flattenable(40)];
    let crit_obj = |n: usize| prop::collection::vec((text(24), desc()), 1..=n);
    prop_oneof![
        (question_instructions(), desc(), desc()).prop_map(
            |(i, t, f)| json!({"type": "noul", "instructions": i, "criteria": {"true": t, "false": f}})
        ),
        question_instructions().prop_map(|i| json!({"type": "noul", "instructions": i})),
        (question_instructions(), crit_obj(8)).prop_filter_map("fewer than 2 distinct options", |(i, c)| {
            let c: Map<String, Value> = c.into_iter().filter(|(k, _)| option_value_ok(k)).collect();
            (c.len() >= 2).then(|| json!({"type": "choice", "instructions": i, "criteria": c}))
        }),
        (question_instructions(), prop::collection::vec(text(30).prop_map(Value::String), 2..=10))
            .prop_map(|(i, l)| json!({"type": "score", "instructions": i, "criteria": l})),
        (flattenable(80), crit_obj(6), prop::option::of(0.0..=1.0f64)).prop_map(|(i, c, t)| {
            let mut q =
                json!({"type": "multi", "instructions": i, "criteria": c.into_iter().collect::<Map<_, _>>()});
            if let Some(t) = t {
                q["threshold"] = json!(t);
            }
            q
        }),
    ]
}

/// A valid body in any accepted form, as bytes.
fn wire_request() -> impl Strategy<Value = Vec<u8>> {
    let state = prop_oneof![
        2 => plain_state(),
        1 => json_value(),
    ];
    let qs = prop::collection::vec((text(24), wire_question()), 1..6)
        .prop_map(|qs| qs.into_iter().collect::<Map<String, Value>>());
    (state, qs, pngs(1), prop::option::of((8u32..64, 8u32..64, any::<u8>())), any::<bool>()).prop_map(
        |(mut state, qs, explicit, embedded, extra_field)| {
            // An image embedded in a state string (cut out, in its place: `[image 1]`).
            if let Some((w, h, s)) = embedded {
                let url = data_url(&png(w, h, s));
                match &mut state {
                    Value::Object(m) => {
                        m.insert("photo".into(), Value::String(format!("the photo: {url} (front)")));
                    }
                    Value::String(t) => t.push_str(&format!(" {url}")),
                    _ => {}
                }
            }
            let mut body = json!({"state": state, "questions": qs});
            if !explicit.is_empty() {
                body["images"] = explicit.iter().map(|b| Value::String(data_url(b))).collect();
            }
            if extra_field {
                body["model"] = json!("imajev-4b");
            }
            serde_json::to_vec(&body).unwrap()
        },
    )
}

// ------------------------------------------------------------------------------ properties

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 192,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// A request in its plain form parses to exactly what it says, and renders back to the same
    /// bytes.
    #[test]
    fn a_plain_request_parses_to_what_it_says(state in plain_state(), qs in questions(), images in pngs(2)) {
        let body = render(&state, &qs, &images);
        let checked = check_bytes(&body).map_err(|e| TestCaseError::fail(format!("refused: {e}")))?;
        prop_assert_eq!(&checked.state, &state);
        prop_assert_eq!(&checked.questions, &qs);
        let bytes: Vec<&[u8]> = checked.images.iter().map(|b| b.bytes.as_slice()).collect();
        let want: Vec<&[u8]> = images.iter().map(Vec::as_slice).collect();
        prop_assert_eq!(bytes, want);
        prop_assert_eq!(render_checked(&checked), body.clone());
        assert_fully_parsed(&body, &checked);
    }

    /// Any valid request parses to a request whose rendering parses to the same request.
    #[test]
    fn parse_render_parse_is_the_first_parse(body in wire_request()) {
        let first = check_bytes(&body).map_err(|e| TestCaseError::fail(format!("refused: {e}\n{}", String::from_utf8_lossy(&body))))?;
        let rendered = render_checked(&first);
        let second = check_bytes(&rendered).map_err(|e| TestCaseError::fail(format!("the rendering was refused: {e}")))?;
        prop_assert_eq!(&second.state, &first.state);
        prop_assert_eq!(&second.questions, &first.questions);
        let bytes = |c: &CheckedRequest| c.images.iter().map(|b| b.bytes.clone()).collect::<Vec<_>>();
        prop_assert_eq!(bytes(&second), bytes(&first));
        prop_assert_eq!(render_checked(&second), rendered.clone());
        assert_fully_parsed(&body, &first);
        assert_fully_parsed(&rendered, &second);
    }
}

/// The properties can fail: what the rules change is seen. A state that is not an object is
/// wrapped, an embedded image is cut out, flattened instructions become one string — so the
/// first body's rendering differs from it, while parsing the rendering again changes nothing.
#[test]
fn the_first_parse_changes_what_it_should() {
    let url = data_url(&png(9, 9, 1));
    let body = serde_json::to_vec(&json!({
        "state": [1, format!("see {url}")],
        "questions": {"q": {"type": "noul", "instructions": {"task": "decide", "n": 1.0}, "criteria": {"true": ["a", "b"]}}}
    }))
    .unwrap();
    let first = check_bytes(&body).unwrap();
    assert_eq!(first.state, json!({"state": [1, "see [image 1]"]}));
    assert_eq!(
        first.questions[0].kind,
        QuestionKind::Noul { question: "task: decide\nn: 1.0".into(), yes: Some("a; b".into()), no: None }
    );
    let rendered = render_checked(&first);
    assert_ne!(rendered, body);
    let second = check_bytes(&rendered).unwrap();
    assert_eq!(render_checked(&second), rendered);
}
