//! Request bodies on the wire: media type, `Content-Encoding` (zstd / gzip, decoded with a
//! size cap against decompression bombs), the size limit, and `multipart/form-data`.

use super::error::{ApiError, Loc};
use super::parse::{MultipartFiles, Upload, IMAGE_KEYS};
use actix_web::http::header::HeaderMap;
use actix_web::web::{Bytes, Payload};
use futures_util::StreamExt;
use std::io::Read;

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

/// Undoes the codings (last applied first), never producing more than `cap` bytes.
pub fn decode(mut body: Vec<u8>, codings: &[Coding], cap: usize) -> Result<Vec<u8>, ApiError> {
    for &c in codings.iter().rev() {
        let mut out = Vec::new();
        let res = match c {
            Coding::Zstd => zstd::stream::read::Decoder::new(&body[..])
                .and_then(|d| d.take(cap as u64 + 1).read_to_end(&mut out)),
            Coding::Gzip => {
                flate2::read::MultiGzDecoder::new(&body[..]).take(cap as u64 + 1).read_to_end(&mut out)
            }
        };
        let name = match c {
            Coding::Zstd => "zstd",
            Coding::Gzip => "gzip",
        };
        if let Err(e) = res {
            return Err(ApiError::bad_request(
                Loc::body(),
                format!("the body is not valid {name} data (Content-Encoding: {name}): {e}"),
                "encoding_invalid",
            ));
        }
        if out.len() > cap {
            return Err(too_large(cap, &format!("{name}-decoded body")));
        }
        body = out;
    }
    Ok(body)
}

/// Reads the whole body, refusing more than `cap` bytes.
pub async fn read_payload(mut payload: Payload, cap: usize) -> Result<Vec<u8>, ApiError> {
    let mut buf = Vec::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::bad_request(Loc::body(), format!("reading the body failed: {e}"), "body_invalid")
        })?;
        if buf.len() + chunk.len() > cap {
            return Err(too_large(cap, "request body"));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf)
}

/// Splits a decoded `multipart/form-data` body into the `request` JSON bytes and the other parts.
pub async fn read_multipart(
    headers: &HeaderMap,
    body: Vec<u8>,
) -> Result<(Vec<u8>, MultipartFiles), ApiError> {
    let bad = |msg: String| ApiError::bad_request(Loc::body(), msg, "multipart_invalid");
    let stream =
        futures_util::stream::once(async move { Ok::<_, actix_web::error::PayloadError>(Bytes::from(body)) });
    let mut mp = actix_multipart::Multipart::new(headers, stream);
    let mut request: Option<Vec<u8>> = None;
    let mut images: Vec<Upload> = Vec::new();
    let mut parts: Vec<Upload> = Vec::new();
    while let Some(field) = mp.next().await {
        let mut field = field.map_err(|e| bad(format!("malformed multipart body: {e}")))?;
        let name =
            field.name().map(str::to_string).ok_or_else(|| bad("a multipart part has no name".into()))?;
        let is_file = field.content_disposition().and_then(|cd| cd.get_filename()).is_some();
        let mut bytes = Vec::new();
        while let Some(chunk) = field.next().await {
            bytes.extend_from_slice(
                &chunk.map_err(|e| bad(format!("malformed multipart part {name:?}: {e}")))?,
            );
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
    let Some(request) = request else {
        return Err(ApiError::bad_request(
            Loc::body().at("request"),
            "the multipart body has no 'request' part: send the JSON request as a part named 'request' (images as files named 'image')",
            "missing",
        ));
    };
    // Uploads in key order (image, images, image[]), then in order of appearance.
    images.sort_by_key(|u| IMAGE_KEYS.iter().position(|k| *k == u.name).unwrap_or(usize::MAX));
    Ok((request, MultipartFiles { images, parts }))
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
}
