//! Answers are deterministic on a real server: the same request sent 50 times — alone, and
//! interleaved with other requests (text of other lengths, images, many questions) from
//! concurrent clients, so that it is queued behind them and packed into forwards with them in
//! varying company — gets byte-identical `answers` (and the same `usage`, its timings aside)
//! every time.
//!
//! The engine's batch invariance is checked at the logits level by tests/batch_invariance.rs;
//! this is the end-to-end promise a client sees: HTTP, parsing, queueing, packing, decisions and
//! the JSON rendering of the answer, on the built binary (`serve --demo`, CPU).

mod common;

use common::server::{http, Served};
use imajev_serve::api::parse::top_level_members;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// The raw bytes of each top-level member of a JSON object body, by key.
fn members(body: &str) -> Vec<(String, String)> {
    let b = body.as_bytes();
    top_level_members(b)
        .unwrap_or_else(|| panic!("not a JSON object: {body}"))
        .into_iter()
        .map(|m| {
            let key: String = serde_json::from_slice(&b[m.key.clone()]).expect("a JSON string key");
            (key, body[m.value].to_string())
        })
        .collect()
}

/// `usage` without its timings (`*_ms`), which measure this run.
fn usage_sans_timings(body: &str) -> Value {
    let mut v: Value = serde_json::from_str(body).unwrap();
    let usage = v["usage"].as_object_mut().expect("usage");
    usage.retain(|k, _| !k.ends_with("_ms"));
    Value::Object(usage.clone())
}

fn png(w: u32, h: u32, tint: u8) -> String {
    use base64::Engine;
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7) as u8, (y * 5) as u8, tint]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(out.into_inner()))
}

/// The request sent 50 times: an image, every question type.
fn the_request() -> Value {
    json!({
        "state": {"ticket": "The badge reader at the east door blinks red; photo attached.", "floor": 3},
        "images": [png(96, 64, 40)],
        "questions": {
            "hw": {"type": "noul", "instructions": "Is it a hardware problem?", "criteria": {"true": "a device is broken"}},
            "team": {"type": "choice", "instructions": "Which team?",
                     "criteria": {"facilities": "doors, badges", "infra": "servers", "identity": "accounts"}},
            "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]},
            "tags": {"type": "multi", "instructions": "Which apply?", "criteria": {"access": null, "safety": "people at risk", "billing": null}}
        }
    })
}

/// The other traffic, cycled through by the other clients.
fn others() -> Vec<Value> {
    let long = "The quarterly report lists every outage of the past months, with causes. ".repeat(12);
    let many: serde_json::Map<String, Value> = (0..12)
        .map(|i| (format!("q{i}"), json!({"type": "noul", "instructions": format!("Is point {i} true?")})))
        .collect();
    vec![
        json!({"state": {"note": "printer jammed"}, "questions": {"hw": {"type": "noul", "instructions": "Hardware?"}}}),
        json!({"state": long, "questions": {"team": {"type": "choice", "instructions": "Which team?",
                                                        "criteria": {"infra": null, "facilities": null}}}}),
        json!({"state": {"a": "two photos"}, "images": [png(120, 80, 200), png(64, 64, 9)],
               "questions": {"same": {"type": "noul", "instructions": "Same device?"}}}),
        json!({"state": "many questions", "questions": many}),
    ]
}

#[test]
fn the_same_request_gets_byte_identical_answers_interleaved_with_others() {
    let s = Served::demo(&[]);
    let port = s.port;
    let body = the_request();
    let ask = |body: &Value| -> String {
        let (status, text) = http(port, "POST", "/v1/systemone", Some(body)).expect("an answer");
        assert_eq!(status, 200, "{text}");
        text
    };

    // Alone first: the reference.
    let reference = ask(&body);
    let reference_members = members(&reference);
    let answers = |m: &[(String, String)]| m.iter().find(|(k, _)| k == "answers").map(|(_, v)| v.clone());
    let want = answers(&reference_members).expect("answers");
    assert!(want.contains("\"hw\"") && want.contains("\"tags\""), "{want}");
    let want_usage = usage_sans_timings(&reference);

    // Three other clients keep the server busy with other requests meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let others_served = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..3)
        .map(|c| {
            let (stop, served) = (stop.clone(), others_served.clone());
            std::thread::spawn(move || {
                let reqs = others();
                let mut i = c;
                while !stop.load(Ordering::Relaxed) {
                    let (status, text) =
                        http(port, "POST", "/v1/systemone", Some(&reqs[i % reqs.len()])).expect("an answer");
                    assert_eq!(status, 200, "other request {}: {text}", i % reqs.len());
                    served.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    // Two clients send the request itself (so it is also packed with a copy of itself), 25 each.
    let senders: Vec<_> = (0..2)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || {
                (0..25)
                    .map(|_| {
                        let (status, text) =
                            http(port, "POST", "/v1/systemone", Some(&body)).expect("an answer");
                        assert_eq!(status, 200, "{text}");
                        text
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let got: Vec<String> = senders.into_iter().flat_map(|t| t.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }

    assert_eq!(got.len(), 50);
    let interleaved = others_served.load(Ordering::Relaxed);
    assert!(interleaved >= 10, "only {interleaved} other requests ran alongside");
    for (i, text) in got.iter().enumerate() {
        let m = members(text);
        let keys: Vec<&str> = m.iter().map(|(k, _)| k.as_str()).collect();
        let want_keys: Vec<&str> = reference_members.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, want_keys, "answer {i}: other members");
        for ((k, v), (_, r)) in m.iter().zip(&reference_members) {
            if k != "usage" {
                assert_eq!(v, r, "answer {i}: `{k}` differs from the one answered alone");
            }
        }
        assert_eq!(usage_sans_timings(text), want_usage, "answer {i}: usage");
    }
    eprintln!("50 identical answers; {interleaved} other requests interleaved");
}
