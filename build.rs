//! Sets `IMAJEV_GIT_COMMIT` for `--version` and the build-info metric: the short commit of the
//! source tree, `$IMAJEV_GIT_COMMIT` when the builder passes one (a Docker build has no `.git`),
//! or `unknown` when neither git nor a repository is there. Also warns when `nasm` is missing on
//! x86-64 with `exact-jpeg`: mozjpeg then leaves libjpeg-turbo's SIMD decoders out without a word
//! in the build output (a dependency's warnings are hidden), and every JPEG decodes slower.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=IMAJEV_GIT_COMMIT");
    let given =
        std::env::var("IMAJEV_GIT_COMMIT").ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    let commit = given.or_else(|| {
        let sha = git(&["rev-parse", "--short=12", "HEAD"])?;
        // Rebuild when HEAD moves: HEAD itself, the branch it points to, and packed refs. Only
        // existing files are named (cargo re-runs on every build for a path that does not exist).
        let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch.push(branch);
        }
        for w in watch {
            if let Some(p) = git(&["rev-parse", "--git-path", &w]).map(PathBuf::from).filter(|p| p.exists()) {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
        Some(sha)
    });
    println!("cargo:rustc-env=IMAJEV_GIT_COMMIT={}", commit.as_deref().unwrap_or("unknown"));

    let x86_64 = std::env::var("CARGO_CFG_TARGET_ARCH").is_ok_and(|a| a == "x86_64");
    let exact_jpeg = std::env::var_os("CARGO_FEATURE_EXACT_JPEG").is_some();
    if x86_64 && exact_jpeg && !Command::new("nasm").arg("-v").output().is_ok_and(|o| o.status.success()) {
        println!(
            "cargo:warning=nasm not found: libjpeg-turbo's SIMD JPEG decoders are left out (JPEG decodes \
             slower, the answers are the same); install nasm and run `cargo clean -p mozjpeg-sys`"
        );
    }
}
