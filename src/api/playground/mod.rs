//! The playground: a page at `/` where a person tries questions on a state and up to two images
//! in a browser, without writing JSON by hand.
//!
//! The page (`index.html`, `playground.css`, `playground.js`, an icon and the two photos of the
//! "photo comparison" example, drawn by `tools/playground_example_images.py`) is compiled into the
//! binary with `include_str!`/`include_bytes!`: it works on a machine with no network and needs
//! no build step. Six fixed files are all it serves, so no embedding or static-files crate is
//! needed: a table of (path, media type, bytes) is the whole store.
//!
//! The page talks to nothing but this server (`GET /v1/models`, `POST /v1/systemone`). Every
//! response of this module carries a strict Content-Security-Policy ([`CONTENT_SECURITY_POLICY`]):
//! scripts, styles, images and fetches from this origin only (image previews also from `blob:`),
//! no inline code, no `eval`, no frames, no form posts, Trusted Types required (the script builds
//! its DOM with `textContent`, never `innerHTML`), so a state or an answer shown on the page
//! cannot run code. An API key typed into the page stays in the page's memory: it is sent as
//! `Authorization: Bearer` to this server and never stored.
//!
//! This module knows nothing about models, answers or the contract modes: the page builds
//! requests that are valid in both modes (it always sends `state` and `instructions`) and reads
//! both the plain and the `x_` names of imajev's extra answer fields. `--no-playground`
//! (`ServerConfig::playground = false`) leaves these routes out; `/` is then a 404 like any
//! unknown path.

use super::error::ApiError;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{web, HttpRequest, HttpResponse};

/// The policy every playground response carries.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
img-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'; \
require-trusted-types-for 'script'; trusted-types 'none'";

/// One file of the page.
#[derive(Debug, Clone, Copy)]
pub struct Asset {
    /// The URL path it is served at.
    pub path: &'static str,
    pub content_type: &'static str,
    pub body: &'static [u8],
}

/// Everything the playground serves.
pub const ASSETS: &[Asset] = &[
    Asset {
        path: "/",
        content_type: "text/html; charset=utf-8",
        body: include_str!("index.html").as_bytes(),
    },
    Asset {
        path: "/playground/playground.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("playground.js").as_bytes(),
    },
    Asset {
        path: "/playground/playground.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("playground.css").as_bytes(),
    },
    Asset {
        path: "/playground/favicon.svg",
        content_type: "image/svg+xml",
        body: include_str!("favicon.svg").as_bytes(),
    },
    Asset {
        path: "/playground/examples/reference.png",
        content_type: "image/png",
        body: include_bytes!("examples/reference.png"),
    },
    Asset {
        path: "/playground/examples/target.png",
        content_type: "image/png",
        body: include_bytes!("examples/target.png"),
    },
];

/// Adds the playground's routes (GET and HEAD of each [`ASSETS`] path; any other method is 405).
/// Register it before the app's default service.
pub fn register(cfg: &mut web::ServiceConfig) {
    for asset in ASSETS {
        let a = *asset;
        cfg.service(
            web::resource(a.path)
                .route(web::get().to(move || async move { respond(a) }))
                .route(web::head().to(move || async move { respond(a) }))
                .default_service(web::to(method_not_allowed)),
        );
    }
}

fn respond(a: Asset) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, a.content_type))
        .insert_header((header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"))
        .insert_header((header::X_FRAME_OPTIONS, "DENY"))
        .insert_header(("cross-origin-opener-policy", "same-origin"))
        .insert_header(("cross-origin-resource-policy", "same-origin"))
        // The files change with the binary; revalidating costs little (the page is ~60 KB).
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(a.body)
}

async fn method_not_allowed(req: HttpRequest) -> HttpResponse {
    let e = ApiError::message(
        405,
        "method_not_allowed",
        format!("{} {} is not allowed; the playground is read with GET", req.method(), req.path()),
    );
    let mut r = actix_web::ResponseError::error_response(&e);
    r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::{Method, StatusCode};
    use actix_web::test as http;
    use actix_web::App;

    fn directives() -> Vec<(String, Vec<String>)> {
        CONTENT_SECURITY_POLICY
            .split(';')
            .map(|d| {
                let mut w = d.split_whitespace().map(String::from);
                (w.next().unwrap(), w.collect())
            })
            .collect()
    }

    #[test]
    fn the_policy_allows_only_this_origin_and_no_inline_code() {
        let d = directives();
        let get = |name: &str| {
            d.iter().find(|(n, _)| n == name).map(|(_, v)| v.join(" ")).unwrap_or_else(|| panic!("{name}"))
        };
        assert_eq!(get("default-src"), "'none'");
        assert_eq!(get("script-src"), "'self'");
        assert_eq!(get("style-src"), "'self'");
        assert_eq!(get("connect-src"), "'self'");
        assert_eq!(get("img-src"), "'self' blob:");
        assert_eq!(get("frame-ancestors"), "'none'");
        assert_eq!(get("form-action"), "'none'");
        assert_eq!(get("require-trusted-types-for"), "'script'");
        for (_, v) in &d {
            for source in v {
                assert!(
                    !source.contains("unsafe")
                        && !source.contains("http")
                        && source != "*"
                        && source != "data:",
                    "{source}"
                );
            }
        }
    }

    #[test]
    fn the_page_references_only_files_it_serves_and_has_no_inline_code() {
        let html = std::str::from_utf8(ASSETS[0].body).unwrap();
        // Every src/href of the page is one of the assets (no CDN, nothing outside this server).
        for attr in ["src=\"", "href=\""] {
            for part in html.split(attr).skip(1) {
                let url = &part[..part.find('"').unwrap()];
                assert!(ASSETS.iter().any(|a| a.path == url), "{attr}{url} is not served by the playground");
            }
        }
        // The policy forbids inline scripts, inline styles and handlers: the page has none.
        assert!(!html.contains("<style"), "inline <style>");
        assert!(!html.contains(" style="), "inline style attribute");
        assert_eq!(
            html.matches("<script").count(),
            html.matches("<script src=\"/playground/playground.js\"").count()
        );
        let lower = html.to_ascii_lowercase();
        for part in lower.split(" on").skip(1) {
            let name_len = part.bytes().take_while(u8::is_ascii_alphabetic).count();
            assert!(!part[name_len..].starts_with('='), "an inline event handler: on{}", &part[..name_len]);
        }
        let js = std::str::from_utf8(ASSETS[1].body).unwrap();
        for banned in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            "new Function",
            "localStorage",
            "sessionStorage",
            "document.cookie",
        ] {
            assert!(!js.contains(banned), "playground.js uses {banned}");
        }
        // The script fetches only paths of this server, and names no other.
        for part in js.split("fetch(").skip(1) {
            assert!(part.starts_with("\"/"), "fetch({})", &part[..part.len().min(40)]);
        }
        assert!(
            !js.contains("http://") && !js.contains("https://") && !js.contains("//cdn"),
            "an absolute URL in playground.js"
        );
    }

    #[actix_web::test]
    async fn serves_every_asset_with_its_type_and_the_policy() {
        let app = http::init_service(App::new().configure(register)).await;
        for a in ASSETS {
            let res = http::call_service(&app, http::TestRequest::get().uri(a.path).to_request()).await;
            assert_eq!(res.status(), StatusCode::OK, "{}", a.path);
            let h = res.headers();
            assert_eq!(h.get(header::CONTENT_TYPE).unwrap(), a.content_type, "{}", a.path);
            assert_eq!(
                h.get(header::CONTENT_SECURITY_POLICY).unwrap(),
                CONTENT_SECURITY_POLICY,
                "{}",
                a.path
            );
            assert_eq!(h.get(header::X_CONTENT_TYPE_OPTIONS).unwrap(), "nosniff");
            assert_eq!(h.get(header::X_FRAME_OPTIONS).unwrap(), "DENY");
            let body = http::read_body(res).await;
            assert_eq!(&body[..], a.body, "{}", a.path);
        }
        let res =
            http::call_service(&app, http::TestRequest::default().method(Method::HEAD).uri("/").to_request())
                .await;
        assert_eq!(res.status(), StatusCode::OK);
        let res = http::call_service(&app, http::TestRequest::post().uri("/").to_request()).await;
        assert_eq!(res.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(res.headers().get(header::ALLOW).unwrap(), "GET, HEAD");
        let v: serde_json::Value = serde_json::from_slice(&http::read_body(res).await).unwrap();
        assert_eq!(v["error"], "method_not_allowed");
        // The example photos are the PNGs the page says they are.
        for a in ASSETS.iter().filter(|a| a.content_type == "image/png") {
            assert!(a.body.starts_with(b"\x89PNG\r\n\x1a\n"), "{}", a.path);
        }
    }
}
