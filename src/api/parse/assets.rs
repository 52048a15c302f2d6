//! TypeSafe assets: `{"placeholder": {"type": "image", "format": …, "data_base64": …}}` or, in a
//! multipart body, `{"type": "image", "part": "asset-0"}`. Step 3 checks them and which multipart
//! file parts they claim; step 4 decodes them after the other images, and every occurrence of a
//! placeholder inside strings of the state, instructions and descriptions becomes `[image K]`
//! ([`Replacer`]).

use super::images::{image_too_large, strict_b64, ImageBlob, MAX_IMAGES};
use super::Upload;
use crate::api::error::{ApiError, Loc};
use crate::decision::pyjson::py_len;
use serde_json::Value;

/// Longest asset placeholder, in characters (TypeSafe's are `<image:` + 32 hex digits + `>`, 39).
pub const MAX_PLACEHOLDER_CHARS: usize = 256;

/// One checked TypeSafe asset.
#[derive(Debug, Clone)]
pub(super) struct Asset {
    placeholder: String,
    part: Option<String>,
    data_base64: Option<String>,
}

/// Step 3: every file part of a multipart body belongs to an asset.
pub(super) fn check_parts_claimed(parts: &[Upload], assets: &[Asset], loc: Loc) -> Result<(), ApiError> {
    if let Some(p) =
        parts.iter().find(|p| p.is_file && !assets.iter().any(|a| a.part.as_deref() == Some(&p.name)))
    {
        return Err(ApiError::invalid(
            loc,
            format!("the multipart file part {:?} is not claimed by any asset: name it in 'assets' as {{\"type\": \"image\", \"part\": {:?}}} or leave it out", p.name, p.name),
            "value_error",
        ));
    }
    Ok(())
}

/// Step 4 for assets: their bytes, appended to `blobs` in `assets` order, and the replacement
/// of each placeholder by the `[image K]` of its place among all images.
pub(super) fn decode_assets(
    assets: &[Asset],
    parts: &[Upload],
    max_bytes: usize,
    root: &Loc,
    blobs: &mut Vec<ImageBlob>,
) -> Result<Replacer, ApiError> {
    let base = blobs.len();
    let mut placeholders = Vec::new();
    for (i, a) in assets.iter().enumerate() {
        let loc = root.at("assets").at(a.placeholder.as_str());
        let what = format!("asset {:?}", a.placeholder);
        let bytes = match (&a.part, &a.data_base64) {
            (Some(name), _) => {
                let part = parts.iter().find(|p| &p.name == name).expect("claimed parts exist");
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
    Ok(Replacer::new(placeholders))
}

pub(super) fn parse_assets(
    v: &Value,
    parts: &[Upload],
    multipart: bool,
    loc: &Loc,
) -> Result<Vec<Asset>, ApiError> {
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
    // Bounds first, before any placeholder is looked at or looked for: at most MAX_IMAGES
    // assets (the image count rule, answered here with its own message), each placeholder short.
    if map.len() > MAX_IMAGES {
        return Err(ApiError::bad_image(
            loc.clone(),
            format!("Provide at most two images (uploads, 'images', data URLs in the state and assets together); 'assets' alone has {}", map.len()),
        ));
    }
    if let Some((ph, _)) = map.iter().find(|(ph, _)| py_len(ph) > MAX_PLACEHOLDER_CHARS) {
        let shown: String = ph.chars().take(40).collect();
        return Err(ApiError::invalid(
            loc.clone(),
            format!(
                "asset placeholders may be at most {MAX_PLACEHOLDER_CHARS} characters; {shown:?}… has {}: use a short placeholder such as \"<image:0123abcd>\"",
                py_len(ph)
            ),
            "too_long",
        ));
    }
    let mut out: Vec<Asset> = Vec::with_capacity(map.len());
    for (ph, a) in map {
        let l = loc.at(ph.as_str());
        if ph.is_empty() {
            return Err(ApiError::invalid(l, "asset placeholders must be non-empty strings", "value_error"));
        }
        let Value::Object(a) = a else {
            return Err(ApiError::invalid(
                l,
                format!("asset {ph:?} must be an object with type 'image'"),
                "type_error",
            ));
        };
        if a.get("type") != Some(&Value::String("image".into())) {
            return Err(ApiError::invalid(
                l.at("type"),
                format!("asset {ph:?} must have type 'image'"),
                "value_error",
            ));
        }
        let format_ok = |required: bool| match a.get("format") {
            Some(Value::String(f)) => matches!(f.as_str(), "png" | "jpg" | "jpeg"),
            None | Some(Value::Null) => !required,
            Some(_) => false,
        };
        match a.get("part") {
            Some(Value::Null) | None => {
                if !format_ok(true) {
                    return Err(ApiError::invalid(
                        l.at("format"),
                        format!("asset {ph:?}: format must be png, jpg or jpeg"),
                        "value_error",
                    ));
                }
                match a.get("data_base64") {
                    Some(Value::String(d)) => {
                        out.push(Asset { placeholder: ph.clone(), part: None, data_base64: Some(d.clone()) })
                    }
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
                    return Err(ApiError::invalid(
                        l.at("format"),
                        format!("asset {ph:?}: format must be png, jpg or jpeg"),
                        "value_error",
                    ));
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
                return Err(ApiError::invalid(
                    l.at("part"),
                    format!("asset {ph:?}: part must be a string"),
                    "type_error",
                ));
            }
        }
    }
    Ok(out)
}

/// Replaces asset placeholders inside strings (object values and array items, recursively;
/// keys untouched) in one left-to-right pass, longest placeholder first at each position.
///
/// One Aho–Corasick automaton (leftmost-longest) finds every placeholder in one pass: time linear
/// in the text, whatever the placeholders look like (trying each placeholder at each position
/// cost ~L² byte comparisons for a key of L bytes found near the end of a text of 2L).
pub struct Replacer {
    /// None without placeholders.
    automaton: Option<aho_corasick::AhoCorasick>,
    replacements: Vec<String>,
}

impl Replacer {
    pub fn new(pairs: Vec<(String, String)>) -> Self {
        let (patterns, replacements): (Vec<String>, Vec<String>) =
            pairs.into_iter().filter(|p| !p.0.is_empty()).unzip();
        let automaton = (!patterns.is_empty()).then(|| {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&patterns)
                .expect("placeholders are bounded (MAX_PLACEHOLDER_CHARS, MAX_IMAGES)")
        });
        Replacer { automaton, replacements }
    }

    pub fn text(&self, s: &str) -> String {
        match &self.automaton {
            Some(ac) => ac.replace_all(s, &self.replacements),
            None => s.to_string(),
        }
    }

    pub fn value(&self, v: &Value) -> Value {
        if self.automaton.is_none() {
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
    use crate::api::parse::test_support::*;
    use crate::api::parse::{check_request, MultipartFiles, Upload};
    use crate::decision::{ContractMode, QuestionKind};
    use serde_json::json;

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
            QuestionKind::Noul {
                question: "ask: Is [image 1] like [image 2]?".into(),
                yes: Some("[image 1]".into()),
                no: None
            }
        );
        // Option values are keys: untouched; descriptions are replaced.
        assert_eq!(
            r.questions[1].kind,
            QuestionKind::Choice {
                question: "Which?".into(),
                options: vec![(ph1.into(), Some("same as [image 2]".into())), ("b".into(), None)]
            }
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
            parts: vec![
                files.parts[0].clone(),
                Upload { name: "asset-9".into(), is_file: true, bytes: png.clone() },
            ],
        };
        assert!(check_request(body2.clone(), Some(extra), &c).unwrap_err().summary().contains("not claimed"));
        let mut twice = body2.clone();
        twice["assets"][ph1] = json!({"type": "image", "part": "asset-0"});
        assert!(check_request(twice, Some(files2.clone()), &c)
            .unwrap_err()
            .summary()
            .contains("more than one asset"));
        assert!(check_request(body2.clone(), Some(MultipartFiles::default()), &c)
            .unwrap_err()
            .summary()
            .contains("does not have"));
        // Unclaimed text parts are ignored.
        let text = MultipartFiles {
            images: vec![],
            parts: vec![
                files.parts[0].clone(),
                Upload { name: "note".into(), is_file: false, bytes: b"hi".to_vec() },
            ],
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

    /// Issue 16, item 3: a placeholder of L bytes found near the end of a 2L-byte state used to
    /// cost ~L² byte comparisons (512 KB keys: ~8 s of a core) before any limit applied. Long
    /// placeholders and more assets than images are refused before any replacement, and the
    /// replacement is linear.
    #[test]
    fn placeholders_are_bounded_and_replaced_in_linear_time() {
        let c = ctx(ContractMode::Typesafe);
        let q = json!({"q": noul(json!("?"))});
        let png = png();
        let asset = json!({"type": "image", "format": "png", "data_base64": b64(&png)});
        let long = format!("{}b", "a".repeat(512 << 10));
        let t0 = std::time::Instant::now();
        let e = check_request(
            json!({"state": format!("{}{long}", "a".repeat(512 << 10)), "questions": q, "assets": {long.clone(): asset}}),
            None,
            &c,
        )
        .unwrap_err();
        assert_eq!((e.status, e.code), (422, "invalid_request"), "{}", e.summary());
        assert!(e.summary().contains("at most 256 characters"), "{}", e.summary());
        assert!(t0.elapsed() < std::time::Duration::from_millis(500), "{:?}", t0.elapsed());
        let ok = "é".repeat(MAX_PLACEHOLDER_CHARS);
        let r = check_request(
            json!({"state": {"s": ok.clone()}, "questions": q, "assets": {ok.clone(): asset}}),
            None,
            &c,
        )
        .unwrap();
        assert_eq!(r.state, json!({"s": "[image 1]"}));
        // Three assets: refused before any is decoded.
        let three: serde_json::Map<String, Value> = (0..3)
            .map(|i| (format!("<p{i}>"), json!({"type": "image", "format": "png", "data_base64": "*"})))
            .collect();
        let e = check_request(json!({"state": "", "questions": q, "assets": three}), None, &c).unwrap_err();
        assert_eq!(e.code, "bad_image");
        // The longest allowed placeholder against 8 MB of its own prefix: linear (the old scan
        // made ~2·10⁹ byte comparisons here).
        let key = format!("{}b", "a".repeat(MAX_PLACEHOLDER_CHARS - 1));
        let text = format!("{}{key}", "a".repeat(8 << 20));
        let r = Replacer::new(vec![(key.clone(), "[image 1]".into())]);
        let t0 = std::time::Instant::now();
        let out = r.text(&text);
        assert!(t0.elapsed() < std::time::Duration::from_millis(300), "{:?}", t0.elapsed());
        assert!(out.ends_with("a[image 1]") && out.len() == (8 << 20) + 9);
    }
}
