//! Request bodies on the wire: media type, `Content-Encoding` (zstd / gzip, decoded with a
//! size cap against decompression bombs), the size limit, and `multipart/form-data`. Every
//! buffer a body fills is reserved first from the in-flight memory budget ([`super::budget`]),
//! when the caller passes one.

use super::budget::{MemoryBudget, Reservation};
use super::error::{ApiError, Loc};
use super::parse::{MultipartFiles, Upload, IMAGE_KEYS};
use actix_web::http::header::HeaderMap;
use actix_web::web::{Bytes, Payload};
use futures_util::StreamExt;
use std::io::Read;
use std::sync::Arc;

/// What the body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    Json,
    Multipart,
}

/// `Content-Type` → body kind. `application/json` (charset, if given, must be UTF-8) and
/// `multipart/form-data`; anything else (or nothing) is 415.
pub fn body_kind(content_type: Option<&str>) -> Result<BodyKind, ApiError> {
    let usage =
        "send Content-Type: application/json, or multipart/form-data with a 'request' part (+ image files)";
    let Some(ct) = content_type else {
        return Err(ApiError::unsupported_media(format!("the request has no Content-Type: {usage}")));
    };
    let mut parts = ct.split(';');
    let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
    match media.as_str() {
        "application/json" => {
            for p in parts {
                if let Some((k, v)) = p.split_once('=') {
                    let v = v.trim().trim_matches('"').to_ascii_lowercase();
                    if k.trim().eq_ignore_ascii_case("charset") && v != "utf-8" && v != "utf8" {
                        return Err(ApiError::unsupported_media(format!(
                            "charset {v} is not supported: send UTF-8 JSON"
                        )));
                    }
                }
            }
            Ok(BodyKind::Json)
        }
        "multipart/form-data" => Ok(BodyKind::Multipart),
        other => Err(ApiError::unsupported_media(format!("Content-Type {other} is not supported: {usage}"))),
    }
}

/// One `Content-Encoding` coding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Zstd,
    Gzip,
}

/// `Content-Encoding` → the codings in the order the sender applied them (identity dropped).
pub fn codings(header: Option<&str>) -> Result<Vec<Coding>, ApiError> {
    let Some(h) = header else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for c in h.split(',').map(|c| c.trim().to_ascii_lowercase()).filter(|c| !c.is_empty()) {
        match c.as_str() {
            "identity" => {}
            "zstd" => out.push(Coding::Zstd),
            "gzip" | "x-gzip" => out.push(Coding::Gzip),
            other => {
                return Err(ApiError::unsupported_media(format!(
                    "Content-Encoding {other} is not supported: send zstd, gzip or an uncompressed body"
                )))
            }
        }
    }
    Ok(out)
}

fn too_large(cap: usize, what: &str) -> ApiError {
    ApiError::too_large(format!(
        "the {what} exceeds {cap} bytes ({} MiB): send less (e.g. smaller images)",
        cap >> 20
    ))
}

/// How much decoded output is read (and reserved) at a time.
const DECODE_CHUNK: usize = 256 << 10;

/// Undoes the codings (last applied first), never producing more than `cap` bytes.
pub fn decode(body: Vec<u8>, codings: &[Coding], cap: usize) -> Result<Vec<u8>, ApiError> {
    decode_within(body, Reservation::none(), codings, cap).map(|(b, _)| b)
}

/// [`decode`], reserving every decoded chunk from `held`'s budget before it is kept (`held` is
/// what the encoded body holds; it is given back once that layer is decoded). Returns the decoded
/// body and what it holds.
pub fn decode_within(
    mut body: Vec<u8>,
    mut held: Reservation,
    codings: &[Coding],
    cap: usize,
) -> Result<(Vec<u8>, Reservation), ApiError> {
    for &c in codings.iter().rev() {
        let name = match c {
            Coding::Zstd => "zstd",
            Coding::Gzip => "gzip",
        };
        let invalid = |e: std::io::Error| {
            ApiError::bad_request(
                Loc::body(),
                format!("the body is not valid {name} data (Content-Encoding: {name}): {e}"),
                "encoding_invalid",
            )
        };
        let mut reader: Box<dyn Read> = match c {
            Coding::Zstd => Box::new(zstd::stream::read::Decoder::new(&body[..]).map_err(invalid)?),
            Coding::Gzip => Box::new(flate2::read::MultiGzDecoder::new(&body[..])),
        };
        let mut out: Vec<u8> = Vec::new();
        let mut out_held = held.sibling();
        loop {
            if out.len() > cap {
                return Err(too_large(cap, &format!("{name}-decoded body")));
            }
            let want = DECODE_CHUNK.min(cap + 1 - out.len());
            out_held.grow(want, held.bytes(), "the decoded body")?;
            let start = out.len();
            out.resize(start + want, 0);
            let mut filled = start;
            let mut eof = false;
            while filled < out.len() {
                match reader.read(&mut out[filled..]) {
                    Ok(0) => {
                        eof = true;
                        break;
                    }
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(invalid(e)),
                }
            }
            out.truncate(filled);
            if eof {
                break;
            }
        }
        if out.len() > cap {
            return Err(too_large(cap, &format!("{name}-decoded body")));
        }
        drop(reader);
        body = out;
        held = out_held;
    }
    Ok((body, held))
}

/// Reads the whole body, refusing more than `cap` bytes.
pub async fn read_payload(payload: Payload, cap: usize) -> Result<Vec<u8>, ApiError> {
    read_payload_within(payload, cap, None).await.map(|(b, _)| b)
}

/// [`read_payload`], reserving every chunk from `budget` before it is kept.
pub async fn read_payload_within(
    mut payload: Payload,
    cap: usize,
    budget: Option<&Arc<MemoryBudget>>,
) -> Result<(Vec<u8>, Reservation), ApiError> {
    let mut buf = Vec::new();
    let mut held = budget.map(|b| b.empty()).unwrap_or_default();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::bad_request(Loc::body(), format!("reading the body failed: {e}"), "body_invalid")
        })?;
        if buf.len() + chunk.len() > cap {
            return Err(too_large(cap, "request body"));
        }
        held.grow(chunk.len(), 0, "the request body")?;
        buf.extend_from_slice(&chunk);
    }
    Ok((buf, held))
}

/// Splits a decoded `multipart/form-data` body into the `request` JSON bytes and the other parts.
pub async fn read_multipart(
    headers: &HeaderMap,
    body: Vec<u8>,
) -> Result<(Vec<u8>, MultipartFiles), ApiError> {
    split_multipart(headers, body, Reservation::none()).map(|(j, f, _)| (j, f))
}

/// [`read_multipart`], reserving the parts' bytes from `held`'s budget as they are copied out;
/// `held` (what `body` holds) is given back when the body is freed. Returns what the parts hold.
///
/// The body is complete in memory, so every step of the parser must be ready at once: a step
/// that would wait (actix-multipart waits for more data when a body ends without its closing
/// boundary) means the body is truncated, and is refused instead of waited for.
pub fn split_multipart(
    headers: &HeaderMap,
    body: Vec<u8>,
    held: Reservation,
) -> Result<(Vec<u8>, MultipartFiles, Reservation), ApiError> {
    use futures_util::FutureExt;
    let bad = |msg: String| ApiError::bad_request(Loc::body(), msg, "multipart_invalid");
    let truncated = || {
        bad("the multipart body ends before its closing boundary ('--' + boundary + '--' on its own line): send the whole body".into())
    };
    let stream =
        futures_util::stream::once(async move { Ok::<_, actix_web::error::PayloadError>(Bytes::from(body)) });
    let mut mp = actix_multipart::Multipart::new(headers, stream);
    let mut request: Option<Vec<u8>> = None;
    let mut images: Vec<Upload> = Vec::new();
    let mut parts: Vec<Upload> = Vec::new();
    let mut parts_held = held.sibling();
    while let Some(field) = mp.next().now_or_never().ok_or_else(truncated)? {
        let mut field = field.map_err(|e| bad(format!("malformed multipart body: {e}")))?;
        let name =
            field.name().map(str::to_string).ok_or_else(|| bad("a multipart part has no name".into()))?;
        let is_file = field.content_disposition().and_then(|cd| cd.get_filename()).is_some();
        let mut bytes = Vec::new();
        while let Some(chunk) = field.next().now_or_never().ok_or_else(truncated)? {
            let chunk = chunk.map_err(|e| bad(format!("malformed multipart part {name:?}: {e}")))?;
            parts_held.grow(chunk.len(), held.bytes(), "the multipart parts")?;
            bytes.extend_from_slice(&chunk);
        }
        if name == "request" {
            if request.is_some() {
                return Err(bad("the multipart body has more than one 'request' part".into()));
            }
            request = Some(bytes);
        } else if IMAGE_KEYS.contains(&name.as_str()) {
            images.push(Upload { name, is_file, bytes });
        } else {
            parts.push(Upload { name, is_file, bytes });
        }
    }
    drop(mp);
    drop(held);
    let Some(request) = request else {
        return Err(ApiError::bad_request(
            Loc::body().at("request"),
            "the multipart body has no 'request' part: send the JSON request as a part named 'request' (images as files named 'image')",
            "missing",
        ));
    };
    // Uploads in key order (image, images, image[]), then in order of appearance.
    images.sort_by_key(|u| IMAGE_KEYS.iter().position(|k| *k == u.name).unwrap_or(usize::MAX));
    Ok((request, MultipartFiles { images, parts }, parts_held))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn media_types() {
        assert_eq!(body_kind(Some("application/json")).unwrap(), BodyKind::Json);
        assert_eq!(body_kind(Some("Application/JSON; charset=UTF-8")).unwrap(), BodyKind::Json);
        assert_eq!(body_kind(Some("multipart/form-data; boundary=x")).unwrap(), BodyKind::Multipart);
        for bad in [
            None,
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("application/json; charset=latin-1"),
        ] {
            assert_eq!(body_kind(bad).unwrap_err().status, 415, "{bad:?}");
        }
    }

    #[test]
    fn encodings_and_bombs() {
        assert_eq!(codings(None).unwrap(), vec![]);
        assert_eq!(codings(Some("identity")).unwrap(), vec![]);
        assert_eq!(codings(Some("gzip, zstd")).unwrap(), vec![Coding::Gzip, Coding::Zstd]);
        assert_eq!(codings(Some("br")).unwrap_err().status, 415);
        let data = b"{\"a\": 1}".repeat(100);
        let z = zstd::encode_all(&data[..], 3).unwrap();
        let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        g.write_all(&z).unwrap();
        let gz = g.finish().unwrap();
        assert_eq!(decode(gz, &[Coding::Zstd, Coding::Gzip], 1 << 20).unwrap(), data);
        // A bomb: 64 MiB of zeros in a few KB, against a 1 MiB cap.
        let bomb = zstd::encode_all(std::io::repeat(0).take(64 << 20), 19).unwrap();
        assert!(bomb.len() < 64 << 10);
        assert_eq!(decode(bomb, &[Coding::Zstd], 1 << 20).unwrap_err().status, 413);
        let e = decode(b"not zstd".to_vec(), &[Coding::Zstd], 1 << 20).unwrap_err();
        assert_eq!((e.status, e.code), (422, "bad_request"));
        // Exactly at the cap is fine.
        let z = zstd::encode_all(&vec![7u8; 1000][..], 3).unwrap();
        assert_eq!(decode(z.clone(), &[Coding::Zstd], 1000).unwrap().len(), 1000);
        assert_eq!(decode(z, &[Coding::Zstd], 999).unwrap_err().status, 413);
    }

    fn multipart(parts: &[(&str, Option<&str>, &[u8])]) -> (HeaderMap, Vec<u8>) {
        let boundary = "XyZ123";
        let mut body = Vec::new();
        for (name, filename, data) in parts {
            body.extend_from_slice(
                format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"").as_bytes(),
            );
            if let Some(f) = filename {
                body.extend_from_slice(format!("; filename=\"{f}\"").as_bytes());
            }
            body.extend_from_slice(b"\r\nContent-Type: application/octet-stream\r\n\r\n");
            body.extend_from_slice(data);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        let mut h = HeaderMap::new();
        h.insert(
            actix_web::http::header::CONTENT_TYPE,
            format!("multipart/form-data; boundary={boundary}").parse().unwrap(),
        );
        (h, body)
    }

    #[actix_web::test]
    async fn multipart_parts() {
        let (h, body) = multipart(&[
            ("images", Some("b.png"), b"B"),
            ("request", None, b"{}"),
            ("asset-0", Some("asset-0"), b"C"),
            ("image", Some("a.png"), b"A"),
            ("image[]", Some("d.png"), b"D"),
        ]);
        let (req, files) = read_multipart(&h, body).await.unwrap();
        assert_eq!(req, b"{}");
        let order: Vec<&[u8]> = files.images.iter().map(|u| u.bytes.as_slice()).collect();
        assert_eq!(order, [b"A", b"B", b"D"]);
        assert_eq!(files.parts.len(), 1);
        assert!(files.parts[0].is_file);
        let (h, body) = multipart(&[("image", Some("a.png"), b"A")]);
        let e = read_multipart(&h, body).await.unwrap_err();
        assert_eq!((e.status, e.code), (422, "bad_request"));
        let (h, _) = multipart(&[]);
        let e = read_multipart(&h, b"garbage".to_vec()).await.unwrap_err();
        assert_eq!(e.status, 422);
    }

    /// Issue 16, item 1: a body whose last part is not closed by `--boundary--` used to leave
    /// the handler waiting forever; it is refused at once.
    #[actix_web::test]
    async fn multipart_without_its_closing_boundary_is_refused_at_once() {
        let (h, body) = multipart(&[("request", None, b"{}"), ("image", Some("a.png"), b"A")]);
        let closing = b"--XyZ123--\r\n";
        assert!(body.ends_with(closing));
        let open = &body[..body.len() - closing.len()];
        assert!(open.ends_with(b"A\r\n"));
        for cut in
            [open.to_vec(), open[..open.len() - 1].to_vec(), [open, b"-"].concat(), [open, b"--XyZ"].concat()]
        {
            let shown = String::from_utf8_lossy(&cut[cut.len() - 6..]).into_owned();
            let t0 = std::time::Instant::now();
            let r = tokio::time::timeout(std::time::Duration::from_secs(5), read_multipart(&h, cut)).await;
            let e =
                r.unwrap_or_else(|_| panic!("a body ending in {shown:?} was never answered")).unwrap_err();
            assert_eq!((e.status, e.code), (422, "bad_request"), "{shown:?}: {}", e.summary());
            assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        }
    }

    #[test]
    fn budgets_cover_reading_decoding_and_parts() {
        use crate::api::budget::MemoryBudget;
        let data = vec![b'x'; 3 << 20];
        let z = zstd::encode_all(&data[..], 3).unwrap();
        // Room for the encoded body and the decoded one: decoded; the encoded one is given back.
        let b = MemoryBudget::new(4 << 20);
        let mut held = b.empty();
        held.grow(z.len(), 0, "the request body").unwrap();
        let (out, held) = decode_within(z.clone(), held, &[Coding::Zstd], 8 << 20).unwrap();
        assert_eq!(out, data);
        assert!(held.bytes() >= data.len() && b.used() == held.bytes(), "{} {}", held.bytes(), b.used());
        drop(held);
        assert_eq!(b.used(), 0);
        // A budget too small for this one request: 413; taken by others: 529.
        let small = MemoryBudget::new(2 << 20);
        let e = decode_within(z.clone(), small.empty(), &[Coding::Zstd], 8 << 20).unwrap_err();
        assert_eq!(e.status, 413, "{}", e.summary());
        assert_eq!(small.used(), 0);
        let other = b.reserve(3 << 20, 0, "another request").unwrap();
        let e = decode_within(z, b.empty(), &[Coding::Zstd], 8 << 20).unwrap_err();
        assert_eq!((e.status, e.code), (529, "overloaded"));
        drop(other);
        assert_eq!(b.used(), 0);
        // Multipart parts are reserved as they are copied.
        let (h, body) = multipart(&[("request", None, b"{}"), ("image", Some("a.png"), &[7u8; 5000])]);
        let held = b.reserve(body.len(), 0, "body").unwrap();
        let (_, files, parts) = split_multipart(&h, body, held).unwrap();
        assert_eq!(files.images[0].bytes.len(), 5000);
        assert_eq!(parts.bytes(), 5002);
        assert_eq!(b.used(), 5002);
    }
}
