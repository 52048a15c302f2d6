//! `schemas/*.json` are generated from the Rust wire types (`imajev_serve::api::schema`) and must
//! stay current. `IMAJEV_UPDATE_SCHEMAS=1 cargo test --test api_schemas` rewrites them.

use imajev_serve::api::schema;
use serde_json::{json, Value};
use std::path::Path;

#[test]
fn committed_schemas_are_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas");
    let update = std::env::var_os("IMAJEV_UPDATE_SCHEMAS").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for (name, text) in schema::schema_files() {
        let path = dir.join(name);
        if update {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(current) if current == text => {}
            Ok(_) => stale.push(format!("schemas/{name} differs from what the Rust types generate")),
            Err(e) => stale.push(format!("schemas/{name}: {e}")),
        }
    }
    assert!(
        stale.is_empty(),
        "{}\nrun `IMAJEV_UPDATE_SCHEMAS=1 cargo test --test api_schemas` to refresh, and review the diff",
        stale.join("\n")
    );
}

#[test]
fn schemas_describe_the_contract() {
    let req = schema::request_schema();
    assert_eq!(req["$schema"], "https://json-schema.org/draft/2020-12/schema");
    assert_eq!(req["required"], json!(["questions"]));
    for key in ["model", "state", "questions", "images", "assets"] {
        assert!(req["properties"].get(key).is_some(), "request property {key}");
    }
    let text = serde_json::to_string(&req).unwrap();
    for t in ["noul", "choice", "score", "multi"] {
        assert!(text.contains(&format!("\"const\":\"{t}\"")), "question type {t}");
    }
    let res = schema::response_schema();
    assert_eq!(res["required"], json!(["model", "answers", "usage"]));
    let api = schema::openapi();
    assert_eq!(api["openapi"], "3.1.0");
    let post = &api["paths"]["/v1/systemone"]["post"];
    assert!(post["requestBody"]["content"]["application/json"].is_object());
    assert!(post["requestBody"]["content"]["multipart/form-data"].is_object());
    for code in ["200", "401", "413", "415", "422", "500", "503", "504", "529"] {
        assert!(post["responses"].get(code).is_some(), "response {code}");
    }
    for path in ["/v1/models", "/healthz", "/livez", "/metrics", "/openapi.json"] {
        assert!(api["paths"][path]["get"]["responses"]["200"].is_object(), "GET {path}");
    }
    assert!(api["paths"]["/livez"]["get"]["responses"]["503"].is_object());
    // Every $ref resolves inside the document.
    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    out.push(r.clone());
                }
                m.values().for_each(|x| refs(x, out));
            }
            Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&api, &mut all);
    assert!(all.len() > 10);
    for r in all {
        let ptr = r.strip_prefix('#').expect("local ref");
        assert!(api.pointer(ptr).is_some(), "dangling {r}");
    }
}

#[test]
fn example_requests_fit_the_request_types() {
    // The shapes the TypeSafe SDK and imajev clients send deserialize into the wire types.
    let examples = [
        json!({"model": "jev-latest", "state": "text", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}),
        json!({"state": {"a": [1, 2]}, "images": ["data:image/png;base64,QUJD"], "questions": {
            "c": {"type": "choice", "instructions": {"task": "route"}, "criteria": {"a": null, "b": ["x"], "c": {"k": 1}}},
            "s": {"type": "score", "instructions": ["rate"], "criteria": ["low", {"label": "high"}]},
            "m": {"type": "multi", "instructions": "tags", "criteria": {"x": null}, "threshold": 0.3},
            "n": {"type": "noul", "criteria": {"true": "yes"}}
        }}),
        json!({"model": "jev-latest", "state": "<image:0123456789abcdef0123456789abcdef>", "questions": {"q": {"type": "noul", "instructions": "?"}},
               "assets": {"<image:0123456789abcdef0123456789abcdef>": {"type": "image", "part": "asset-0"}}}),
    ];
    for e in examples {
        let typed: schema::SystemOneRequest =
            serde_json::from_value(e.clone()).unwrap_or_else(|err| panic!("{err}: {e}"));
        let back = serde_json::to_value(typed).unwrap();
        assert_eq!(back, e);
    }
}
