//! The README says what a user types, so it is checked against what answers: its "Serving the
//! real model" commands are the manifest's downloads and the released recipe of
//! `runtime/serve.env`, and run here on a synthetic release in the same layout; its Docker
//! commands are the Dockerfile's and fit the image (port, mounts, cache, stop timeout, build
//! context); its flag
//! table is `serve --help`'s (every flag, its environment variable, its default); every flag of
//! every command has a description; and its error table is every (status, `error` code) the
//! source builds, no more and no fewer.

mod common;

use clap::CommandFactory;
use common::fixtures;
use imajev_serve::release::Manifest;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn readme() -> String {
    std::fs::read_to_string(repo().join("README.md")).unwrap()
}

/// The text of the README section under `## {title}`, up to the next `## ` heading.
fn section(title: &str) -> String {
    let text = readme();
    let start = text.find(&format!("\n## {title}\n")).unwrap_or_else(|| panic!("no section ## {title}"));
    let body = &text[start + title.len() + 5..];
    body[..body.find("\n## ").unwrap_or(body.len())].to_string()
}

/// The commands of the first ```sh block of `text`, backslash continuations joined and runs of
/// blanks collapsed.
fn sh_commands(text: &str) -> Vec<String> {
    let start = text.find("```sh\n").expect("a ```sh block") + 6;
    let block = &text[start..start + text[start..].find("```").expect("the block's end")];
    commands(block.lines())
}

fn commands<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in lines {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                out.push(current.split_whitespace().collect::<Vec<_>>().join(" "));
                current.clear();
            }
        }
    }
    assert!(current.is_empty(), "a command ends with a backslash: {current}");
    out
}

/// runtime/serve.env as name → value.
fn serve_env() -> BTreeMap<String, String> {
    std::fs::read_to_string(repo().join("runtime/serve.env"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// `imajev-serve <name>` as clap defines it.
fn subcommand(name: &str) -> clap::Command {
    imajev_serve::cli::Cli::command()
        .find_subcommand(name)
        .unwrap_or_else(|| panic!("no subcommand {name}"))
        .clone()
}

/// The `--flag` whose environment variable is `var`.
fn flag_of_env(cmd: &clap::Command, var: &str) -> String {
    let arg = cmd
        .get_arguments()
        .find(|a| a.get_env().is_some_and(|e| e == var))
        .unwrap_or_else(|| panic!("no flag reads {var}"));
    format!("--{}", arg.get_long().unwrap())
}

fn gpu_present() -> bool {
    Path::new("/dev/nvidiactl").exists()
}

#[test]
fn serving_the_real_model_is_the_manifest_and_the_recipe_and_runs_as_written() {
    let m = Manifest::builtin();
    let cmds = sh_commands(&section("Serving the real model"));
    // The downloads: the manifest's pinned revisions into models/.
    let downloads: Vec<&String> = cmds.iter().filter(|c| c.starts_with("hf download ")).collect();
    assert_eq!(downloads, m.download_commands("models").iter().collect::<Vec<_>>());
    let bin_prefix = "./target/release/imajev-serve ";
    assert!(cmds.contains(&"cargo build --release".to_string()), "{cmds:?}");

    // The serve command passes exactly the released flags of serve.env (models/ for /models/).
    let serve = cmds.iter().find(|c| c.starts_with(&format!("{bin_prefix}serve "))).expect("a serve command");
    let words: Vec<&str> = serve.split_whitespace().skip(2).collect();
    let flags: BTreeMap<&str, &str> =
        words.chunks(2).map(|p| (p[0], p.get(1).copied().unwrap_or(""))).collect();
    let serve_cmd = subcommand("serve");
    for (var, value) in serve_env() {
        let flag = flag_of_env(&serve_cmd, &var);
        let want = value.strip_prefix('/').unwrap_or(&value);
        assert_eq!(
            flags.get(flag.as_str()).copied(),
            Some(want),
            "{flag} ({var}={value} in serve.env): {serve}"
        );
    }

    // Run the README's commands, as written, on a synthetic release in the layout the downloads
    // give (the tiny model fails verify's shape checks and needs no GPU to be refused).
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    let (base, adapter) = (models.join(&m.base.folder), models.join(&m.adapter.folder));
    let st = Command::new(env!("CARGO_BIN_EXE_imajev-serve"))
        .args(["synth", "--config", "tiny", "--seed", "3", "--out"])
        .arg(&base)
        .arg("--adapter-out")
        .arg(&adapter)
        .args(["--lora-rank", "4", "--lora-alpha", "8"])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::copy(fixtures().join("release/calibration-rot4.json"), adapter.join(&m.recipe.calibration))
        .unwrap();
    let bin_dir = tmp.path().join("target/release");
    std::fs::create_dir_all(&bin_dir).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_imajev-serve"), bin_dir.join("imajev-serve")).unwrap();
    let run = |cmd: &str| {
        let mut c = Command::new("sh");
        c.arg("-c").arg(cmd).current_dir(tmp.path()).env("NO_COLOR", "1");
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("IMAJEV_")) {
            c.env_remove(k);
        }
        let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let started = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("{cmd}: still running after 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = child.wait_with_output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let verify =
        cmds.iter().find(|c| c.starts_with(&format!("{bin_prefix}verify "))).expect("a verify command");
    let (code, out, err) = run(verify);
    assert_eq!(code, Some(1), "{verify}: the synthetic model is not the release\n{out}{err}");
    assert!(out.contains(&format!("release {}", m.release.name)), "{out}");
    assert!(out.contains(&format!("{}/config.json", m.base.folder)) && out.contains("REFUSED"), "{out}");

    if gpu_present() {
        eprintln!("a GPU is present: the README's serve command would serve; its flags were checked above");
        return;
    }
    // Everything up to the device: flags parse, folders and files are found, the calibration
    // reads, no flag is off the recipe; then no GPU → exit 1 with the fix. The port is the one
    // thing changed (8765 may be taken here).
    let port = format!("--port {}", flags["--port"]);
    assert!(serve.ends_with(&port), "{serve}");
    let (code, _, err) = run(&serve.replace(&port, "--port 0"));
    assert_eq!(code, Some(1), "{err}");
    assert!(!err.contains("off its released recipe"), "{err}");
    assert!(err.contains("listening on http://0.0.0.0:"), "{err}");
    let last = err.lines().last().unwrap_or("");
    assert!(last.contains("no usable GPU") && last.contains("--device cpu"), "{err}");
}

/// The `-flag VALUE` of a normalised command.
fn option<'a>(cmd: &'a str, flag: &str) -> Vec<&'a str> {
    let words: Vec<&str> = cmd.split_whitespace().collect();
    words.windows(2).filter(|w| w[0] == flag).map(|w| w[1]).collect()
}

#[test]
fn the_docker_commands_are_the_dockerfiles_and_fit_the_image() {
    let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).unwrap();
    let readme_cmds = sh_commands(&section("Docker"));
    // The Dockerfile's header repeats them (its comment lines that start a docker command).
    let header: Vec<&str> = dockerfile
        .lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| l.trim_start_matches('#'))
        .skip_while(|l| !l.trim_start().starts_with("docker "))
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(commands(header.into_iter()), readme_cmds);

    let instr = |name: &str| -> Vec<String> {
        dockerfile
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{name} ")).map(|r| r.trim().to_string()))
            .collect()
    };
    let env: BTreeMap<String, String> = {
        // ENV A=1 \ B=2 ... as one instruction.
        let start = dockerfile.find("\nENV ").unwrap() + 5;
        commands(dockerfile[start..].lines().take_while(|l| !l.is_empty() && !l.starts_with('#')).take(20))[0]
            .split_whitespace()
            .take_while(|w| w.contains('='))
            .map(|w| {
                let (k, v) = w.split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect()
    };
    let run = readme_cmds.iter().find(|c| c.starts_with("docker run --gpus all")).expect("the GPU run");
    // Port: published = EXPOSE = the server's port in the image.
    assert_eq!(option(run, "-p"), [format!("{0}:{0}", env["IMAJEV_PORT"])]);
    assert_eq!(instr("EXPOSE"), [env["IMAJEV_PORT"].clone()]);
    assert_eq!(env["IMAJEV_HOST"], "0.0.0.0");
    // Mounts: the models where serve.env looks, read-only; the cache in the user's home.
    let mounts = option(run, "-v");
    assert!(mounts.contains(&"\"$PWD/models:/models:ro\""), "{mounts:?}");
    for (var, path) in serve_env() {
        if var == "IMAJEV_MODEL" || var == "IMAJEV_ADAPTER" || var == "IMAJEV_CALIBRATION" {
            assert!(path.starts_with("/models/"), "{var}={path}");
        }
    }
    assert!(mounts.contains(&format!("imajev-cache:{}/.cache", env["HOME"]).as_str()), "{mounts:?}");
    // docker stop must outlast the drain: --shutdown-grace's default (+ 5 s to exit).
    let stop: u64 = option(run, "--stop-timeout")[0].parse().unwrap();
    let timeout: u64 = subcommand("serve")
        .get_arguments()
        .find(|a| a.get_long() == Some("shutdown-grace"))
        .unwrap()
        .get_default_values()[0]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(stop >= timeout + 5, "--stop-timeout {stop} < the drain of {timeout} + 5 s");
    // The start logic and files are where the image puts them: the entrypoint's default lock
    // (../adapter/release.lock.json beside runtime/) is in the copied adapter/ folder.
    assert_eq!(instr("ENTRYPOINT"), [r#"["/opt/imajev-serve/runtime/entrypoint.sh"]"#]);
    assert!(instr("COPY").contains(&"runtime/ /opt/imajev-serve/runtime/".to_string()));
    assert!(instr("COPY").contains(&"adapter/ /opt/imajev-serve/adapter/".to_string()));
    let entrypoint = std::fs::read_to_string(repo().join("runtime/entrypoint.sh")).unwrap();
    assert!(entrypoint.contains("lock=${IMAJEV_LOCK:-$here/../adapter/release.lock.json}"));
    assert!(instr("HEALTHCHECK")[0].ends_with(r#"CMD ["/opt/imajev-serve/runtime/healthcheck.sh"]"#));
    // Not root; bases pinned by digest.
    let user = instr("USER");
    assert!(user.len() == 1 && !user[0].starts_with("root") && !user[0].starts_with("0"), "{user:?}");
    for from in instr("FROM") {
        assert!(from.contains("@sha256:"), "FROM {from} is not pinned by digest");
    }
    // The build: nasm for mozjpeg's SIMD decoders; no build outputs or models in the context.
    let build_stage = &dockerfile[..dockerfile.rfind("\nFROM ").unwrap()];
    assert!(build_stage.contains("nasm="), "the build stage installs no (pinned) nasm");
    let ignored = std::fs::read_to_string(repo().join(".dockerignore")).unwrap();
    for dir in ["target/", "models/", ".git/"] {
        assert!(ignored.lines().any(|l| l.trim() == dir), ".dockerignore lacks {dir}");
    }
    // The demo: an explicit --demo.
    assert!(readme_cmds.iter().any(|c| c.ends_with("imajev-serve serve --demo")), "{readme_cmds:?}");
}

/// The README's `serve` flag table: `--flag` → (environment cell, default cell).
fn readme_flag_table() -> BTreeMap<String, (String, String)> {
    let text = section("Flags");
    let start = text.find("| flag | environment | default |").expect("the serve flag table");
    text[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            let flag = cells[0].trim_matches('`').split(' ').next().unwrap().to_string();
            (flag, (cells[1].trim_matches('`').to_string(), cells[2].to_string()))
        })
        .collect()
}

#[test]
fn the_flag_table_is_serve_help_with_every_environment_variable_and_default() {
    let table = readme_flag_table();
    let serve = subcommand("serve");
    let mut seen = Vec::new();
    for arg in serve.get_arguments().filter(|a| a.get_id() != "help") {
        let flag = format!("--{}", arg.get_long().unwrap());
        let (env_cell, default_cell) =
            table.get(&flag).unwrap_or_else(|| panic!("{flag} is not in the README's flag table"));
        seen.push(flag.clone());
        assert!(arg.get_help().is_some_and(|h| !h.to_string().is_empty()), "{flag} has no description");
        // Every flag but --demo has its environment variable (--demo: the command line only).
        match arg.get_env() {
            Some(var) => assert_eq!(env_cell, var.to_str().unwrap(), "{flag}"),
            None => {
                assert_eq!(flag, "--demo", "{flag} has no environment variable");
                assert_eq!(env_cell, "(command line only)");
            }
        }
        // Defaults: shown by --help, and the same in the table.
        assert!(!arg.is_hide_default_value_set(), "{flag} hides its default");
        let defaults: Vec<String> =
            arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        let want = match (flag.as_str(), defaults.as_slice()) {
            (_, _) if !arg.get_action().takes_values() => "off".to_string(),
            ("--http-workers", [d]) => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                assert_eq!(d, &cores.min(4).to_string());
                "min(cores, 4)".to_string()
            }
            (_, [d]) => d.clone(),
            ("--model-name", []) => Manifest::builtin().release.name.clone(),
            ("--manifest", []) => "built in".to_string(),
            (_, []) => "none".to_string(),
            (_, d) => panic!("{flag}: defaults {d:?}"),
        };
        assert_eq!(default_cell, &want, "{flag}: the README's default");
    }
    let extra: Vec<&String> = table.keys().filter(|f| !seen.contains(f)).collect();
    assert!(extra.is_empty(), "the README lists flags serve does not have: {extra:?}");
}

#[test]
fn every_flag_of_every_command_has_a_description() {
    let cli = imajev_serve::cli::Cli::command();
    let mut missing = Vec::new();
    for cmd in cli.get_subcommands() {
        assert!(cmd.get_about().is_some(), "{} has no description", cmd.get_name());
        for arg in cmd.get_arguments().filter(|a| a.get_id() != "help") {
            if arg.get_help().is_none_or(|h| h.to_string().trim().is_empty()) {
                missing.push(format!("{} {}", cmd.get_name(), arg.get_id()));
            }
        }
    }
    assert!(missing.is_empty(), "no description: {missing:?}");
}

/// The README's error table: every (status, `error` code) it lists, from rows like
/// `| 404 / 405 | \`not_found\` / \`method_not_allowed\` | … |` (pairs in order).
fn readme_error_table() -> BTreeSet<(u16, String)> {
    let text = section("API");
    let start = text.find("| status | error | when |").expect("the error table");
    let mut out = BTreeSet::new();
    for row in text[start..].lines().skip(2).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.trim_matches('|').split(" | ").map(str::trim).collect();
        let statuses: Vec<u16> = cells[0].split(" / ").map(|s| s.parse().unwrap()).collect();
        let codes: Vec<&str> = cells[1].split(" / ").map(|c| c.trim_matches('`')).collect();
        let pairs: Vec<(u16, &str)> = match (statuses.as_slice(), codes.as_slice()) {
            ([s], codes) => codes.iter().map(|c| (*s, *c)).collect(),
            (s, c) if s.len() == c.len() => s.iter().copied().zip(c.iter().copied()).collect(),
            _ => panic!("an error table row pairs no statuses with codes: {row}"),
        };
        out.extend(pairs.into_iter().map(|(s, c)| (s, c.to_string())));
    }
    out
}

/// Every `.rs` file under `dir`, recursively.
fn rust_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every (status, `error` code) of an error the server's source builds: a 4xx/5xx literal
/// followed by a code literal (`ApiError::message(503, "loading", …)`, `(529, "overloaded")`,
/// across rustfmt's line breaks), every 422 helper (`Self::validation("bad_json", …)`), and the
/// image errors, whose pair comes from `ImageError`'s own mapping.
fn emitted_errors() -> BTreeSet<(u16, String)> {
    let mut files = Vec::new();
    rust_sources(&repo().join("src"), &mut files);
    let mut out = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let b = text.as_bytes();
        for (i, _) in text.match_indices(", \"") {
            let code: String =
                text[i + 3..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
            let closed = b.get(i + 3 + code.len()) == Some(&b'"');
            let status = i.checked_sub(3).and_then(|s| text.get(s..i)).and_then(|s| s.parse::<u16>().ok());
            let alone = i < 4 || !b[i - 4].is_ascii_alphanumeric();
            if let (Some(status @ 400..=599), true, true, false) = (status, closed, alone, code.is_empty()) {
                out.insert((status, code));
            }
        }
        for (i, _) in text.match_indices("validation(\"") {
            let code: String = text[i + 12..].chars().take_while(|c| *c != '"').collect();
            out.insert((422, code));
        }
    }
    use imajev_serve::image::ImageError;
    for e in [
        ImageError::TooLarge { bytes: 2, limit: 1 },
        ImageError::TooManyPixels { width: 2, height: 1, pixels: 2, limit: 1 },
        ImageError::Corrupt("x".into()),
    ] {
        out.insert((e.http_status(), e.error_code().to_string()));
    }
    out
}

/// The README's error table lists every status and `error` code a client can receive — the
/// HTTP layer's own (400, 408 head and body timeouts, 431, 503 `too_many_connections`)
/// included — and nothing the server never sends; the OpenAPI document names each of them for
/// `POST /v1/systemone`. A status the source starts emitting fails here until the table says
/// when it happens.
#[test]
fn the_error_table_lists_every_error_the_server_sends() {
    let table = readme_error_table();
    let emitted = emitted_errors();
    // The scan finds what it should (else it would pass on nothing).
    for must in
        [(408, "request_timeout"), (503, "too_many_connections"), (504, "timeout"), (413, "bad_image")]
    {
        assert!(
            emitted.contains(&(must.0, must.1.to_string())),
            "the source scan missed {must:?}: {emitted:?}"
        );
    }
    let missing: Vec<_> = emitted.difference(&table).collect();
    assert!(missing.is_empty(), "errors the server sends that the README's error table lacks: {missing:?}");
    let extra: Vec<_> = table.difference(&emitted).collect();
    assert!(extra.is_empty(), "errors the README's table lists that the server never sends: {extra:?}");
    // The OpenAPI document's POST /v1/systemone lists each status too, but 499 (logged only,
    // never received) and 404/405 (another route or method).
    let api = imajev_serve::api::schema::openapi();
    let responses = &api["paths"]["/v1/systemone"]["post"]["responses"];
    for (status, code) in &table {
        if [404, 405, 499].contains(status) {
            continue;
        }
        let desc = responses[status.to_string()]["description"].as_str().unwrap_or_default();
        assert!(desc.contains(code.as_str()), "OpenAPI's {status} response does not name {code}: {desc:?}");
    }
}
