//! The request's images, in the order the prompt numbers them: multipart uploads, the `images`
//! list, data URLs embedded in state strings (imajev's `server.extract_state_images`), then
//! assets ([`super::assets`]). Steps 1–4 of the wire rules only check and base64-decode them;
//! step 7 ([`decode_images`]) decodes and preprocesses the pixels, the expensive part.
//!
//! [`strict_b64_decode`] checks CPython's `b64decode(validate=True)` alphabet and padding rules by
//! hand and lets the `base64` crate decode: no padding mode of the crate accepts exactly CPython's
//! set (CPython tolerates `=` after a complete quantum, `QUJD=`, and refuses a missing one).

use super::{MultipartFiles, ParseContext, Upload};
use crate::api::error::{ApiError, Loc};
use crate::decision::pyjson::{py_len, py_strip};
use crate::decision::RequestImage;
use crate::image::{load_and_preprocess, PatchedImage};
use base64::engine::general_purpose::GeneralPurpose;
use base64::engine::{DecodePaddingMode, GeneralPurposeConfig};
use base64::Engine;
use serde_json::Value;

pub const MAX_IMAGES: usize = 2;
/// Multipart keys that hold image uploads, in the order their files are taken.
pub const IMAGE_KEYS: [&str; 3] = ["image", "images", "image[]"];

/// Encoded bytes of one image and where they came from (for error messages).
#[derive(Debug, Clone)]
pub struct ImageBlob {
    pub bytes: Vec<u8>,
    pub loc: Loc,
    pub what: String,
}

/// Step 1: `images`, when present, must be a list.
pub(super) fn explicit_images(v: Option<&Value>, root: &Loc) -> Result<Vec<Value>, ApiError> {
    match v {
        None => Ok(Vec::new()),
        Some(Value::Array(a)) => Ok(a.clone()),
        Some(_) => Err(ApiError::bad_image(root.at("images"), "'images' must be a list of data URL strings")),
    }
}

/// Step 3, before the assets: image parts of a multipart body must be file uploads.
pub(super) fn check_uploads(files: &MultipartFiles, root: &Loc) -> Result<(), ApiError> {
    for u in &files.images {
        if !u.is_file {
            return Err(ApiError::bad_image(
                root.at(u.name.as_str()),
                format!("form field {:?} must be an uploaded file", u.name),
            ));
        }
    }
    Ok(())
}

/// Step 3, after the assets: at most [`MAX_IMAGES`] images from all sources together.
pub(super) fn check_image_count(total: usize, root: &Loc) -> Result<(), ApiError> {
    if total > MAX_IMAGES {
        return Err(ApiError::bad_image(
            root.at("images"),
            format!("Provide at most two images (uploads, 'images', data URLs in the state and assets together); got {total}"),
        ));
    }
    Ok(())
}

/// Step 4 for uploads, the `images` list and the embedded data URLs, in that order.
pub(super) fn encoded_images(
    uploads: &[Upload],
    explicit: &[Value],
    embedded: &[String],
    max_bytes: usize,
    root: &Loc,
) -> Result<Vec<ImageBlob>, ApiError> {
    let mut blobs = Vec::with_capacity(uploads.len() + explicit.len() + embedded.len());
    for u in uploads {
        if u.bytes.len() > max_bytes {
            return Err(image_too_large(
                &format!("the uploaded file {:?}", u.name),
                u.bytes.len(),
                max_bytes,
            ));
        }
        blobs.push(ImageBlob {
            bytes: u.bytes.clone(),
            loc: root.at(u.name.as_str()),
            what: format!("uploaded image {}", blobs.len() + 1),
        });
    }
    for (i, v) in explicit.iter().enumerate() {
        let loc = root.at("images").at(i);
        let what = format!("images[{i}]");
        blobs.push(ImageBlob { bytes: decode_data_url(v, &loc, &what, max_bytes)?, loc, what });
    }
    for (i, url) in embedded.iter().enumerate() {
        let loc = root.at("state");
        let what = format!("the data URL image {} embedded in the state", i + 1);
        blobs.push(ImageBlob {
            bytes: decode_data_url(&Value::String(url.clone()), &loc, &what, max_bytes)?,
            loc,
            what,
        });
    }
    Ok(blobs)
}

/// The rayon pool images are decoded and preprocessed on, as many threads as the global pool.
/// Inflating one allowed 20-million-pixel PNG takes seconds in one task; on the global pool every
/// other request's parallel work (tokenizing its prompts) would wait behind it, so one client's
/// big images would stall every other client. Their own pool leaves them to the OS scheduler.
fn image_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(rayon::current_num_threads())
            .thread_name(|i| format!("images-{i}"))
            .build()
            .map_err(|e| tracing::warn!("no image thread pool ({e}): images decode on the global one"))
            .ok()
    })
    .as_ref()
}

/// Step 7: decodes and preprocesses every image (the expensive step; run it off the async
/// threads), the images in parallel on their own pool ([`image_pool`]): what the decision layer
/// needs of each, and its pixels. A bad image is reported as the first bad one in request order.
pub fn decode_images(
    blobs: &[ImageBlob],
    ctx: &ParseContext,
) -> Result<(Vec<RequestImage>, Vec<PatchedImage>), ApiError> {
    if blobs.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    match image_pool() {
        Some(pool) => pool.install(|| decode_each(blobs, ctx)),
        None => decode_each(blobs, ctx),
    }
}

fn decode_each(
    blobs: &[ImageBlob],
    ctx: &ParseContext,
) -> Result<(Vec<RequestImage>, Vec<PatchedImage>), ApiError> {
    use rayon::prelude::*;
    let each: Vec<Result<(RequestImage, PatchedImage), ApiError>> = blobs
        .par_iter()
        .map(|b| {
            let (img, patched) = load_and_preprocess(&b.bytes, &ctx.image_limits, &ctx.image_config)
                .map_err(|e| image_error(e, b))?;
            let tokens = patched.merged_tokens();
            Ok((
                RequestImage {
                    sha256: hex::encode(img.sha256),
                    width: img.width,
                    height: img.height,
                    tokens,
                },
                patched,
            ))
        })
        .collect();
    let each: Vec<(RequestImage, PatchedImage)> = each.into_iter().collect::<Result<_, _>>()?;
    Ok(each.into_iter().unzip())
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
        Value::Object(m) => {
            Value::Object(m.into_iter().map(|(k, x)| (k, extract_embedded(x, found))).collect())
        }
        other => other,
    }
}

/// The longest base64 payload whose decoded size can stay within `max_bytes`: 4·⌈max/3⌉.
pub fn max_b64_len(max_bytes: usize) -> usize {
    4 * max_bytes.div_ceil(3)
}

pub(super) fn image_too_large(what: &str, bytes: usize, max_bytes: usize) -> ApiError {
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
        GeneralPurposeConfig::new()
            .with_decode_padding_mode(DecodePaddingMode::RequireNone)
            .with_decode_allow_trailing_bits(true),
    );
    ENGINE.decode(data).map_err(|_| "not valid base64")
}

pub(super) fn strict_b64(
    payload: &str,
    loc: &Loc,
    what: &str,
    max_bytes: usize,
) -> Result<Vec<u8>, ApiError> {
    let n = py_len(payload);
    if n > max_b64_len(max_bytes) {
        return Err(ApiError::message(
            413,
            "image_too_large",
            format!("{what}: its base64 is {n} characters, more than 20 MiB of image ({} characters): downscale or recompress it", max_b64_len(max_bytes)),
        ));
    }
    strict_b64_decode(payload)
        .map_err(|why| ApiError::bad_image(loc.clone(), format!("{what} is not valid base64: {why}")))
}

/// `server.decode_data_url`: `^data:(mime)?(;base64)?,(payload)$` on the stripped string,
/// `;base64` required, then a strict base64 decode.
pub fn decode_data_url(v: &Value, loc: &Loc, what: &str, max_bytes: usize) -> Result<Vec<u8>, ApiError> {
    let s = match v {
        Value::String(s) if !s.is_empty() => py_strip(s),
        _ => {
            return Err(ApiError::bad_image(
                loc.clone(),
                format!("{what} must be a data URL string (data:image/png;base64,...)"),
            ))
        }
    };
    let not_url = || {
        ApiError::bad_image(
            loc.clone(),
            format!("{what} is not a data: URL (send data:image/png;base64,...)"),
        )
    };
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
        return Err(ApiError::bad_image(
            loc.clone(),
            format!("{what} must be base64-encoded (data:...;base64,...)"),
        ));
    }
    strict_b64(payload, loc, what, max_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::parse::check_request;
    use crate::api::parse::test_support::*;
    use crate::decision::ContractMode;
    use serde_json::json;

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
        assert_eq!(
            v,
            json!({"a": "see [image 1] and data:image/x;base64,!! then [image 2].", "k": ["[image 3]"], "n": 1})
        );
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
        let r = check(json!({"images": [format!("data:image/png;base64,{}", b64(&png))], "questions": q}))
            .unwrap();
        let (imgs, _) = decode_images(&r.images, &ctx(ContractMode::Imajev)).unwrap();
        use sha2::Digest;
        assert_eq!(imgs[0].sha256, hex::encode(sha2::Sha256::digest(&png)));
        assert_eq!((imgs[0].width, imgs[0].height), (8, 6));
    }

    #[test]
    fn multipart_uploads() {
        let png = png();
        let q = json!({"q": noul(json!("?"))});
        let up = |name: &str, is_file: bool, bytes: Vec<u8>| Upload { name: name.into(), is_file, bytes };
        let files = MultipartFiles {
            images: vec![up("image", true, png.clone()), up("images", true, png.clone())],
            parts: vec![],
        };
        let r = check_request(json!({"questions": q}), Some(files), &ctx(ContractMode::Imajev)).unwrap();
        assert_eq!(r.images.len(), 2);
        let files = MultipartFiles { images: vec![up("image", false, png.clone())], parts: vec![] };
        assert_eq!(
            check_request(json!({"questions": q}), Some(files), &ctx(ContractMode::Imajev)).unwrap_err().code,
            "bad_image"
        );
        let big = MultipartFiles { images: vec![up("image", true, vec![0; (20 << 20) + 1])], parts: vec![] };
        let e = check_request(json!({"questions": q}), Some(big), &ctx(ContractMode::Imajev)).unwrap_err();
        assert_eq!((e.status, e.code), (413, "image_too_large"));
    }
}
