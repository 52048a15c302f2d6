//! `imajev-serve verify`: the command line of [`super::verify`] and [`super::pin`], and the
//! message every command gives when the release is not where it was told to look.

use super::{pin, verify, Lock, Manifest, ReleaseDirs};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Checks a downloaded release against the manifest and its hash lock; prints a table.
#[derive(clap::Args, Debug, Clone)]
pub struct VerifyArgs {
    /// Folder holding the two parts of the release under the names the download commands give
    /// them (MODELS/Qwen3.5-4B, MODELS/imajev-4b); takes precedence over --model and --adapter.
    pub models: Option<PathBuf>,
    /// The base model folder (without MODELS).
    #[arg(long, env = "IMAJEV_MODEL")]
    pub model: Option<PathBuf>,
    /// The adapter folder (without MODELS).
    #[arg(long, env = "IMAJEV_ADAPTER")]
    pub adapter: Option<PathBuf>,
    /// The hash lock to check against; with --pin, where to write it. Without a lock only the
    /// contents are checked and the table lists the files as unpinned.
    #[arg(long, env = "IMAJEV_LOCK")]
    pub lock: Option<PathBuf>,
    /// Check the contents, then hash every file into --lock: for a download you trust. Nothing
    /// is written when a check fails.
    #[arg(long)]
    pub pin: bool,
    /// Check against this manifest instead of the one built in (adapter/manifest.json).
    #[arg(long, env = "IMAJEV_MANIFEST")]
    pub manifest: Option<PathBuf>,
}

/// The manifest given on the command line, else the built-in one.
pub fn manifest(path: Option<&Path>) -> Result<Manifest> {
    match path {
        Some(p) => Manifest::load(p),
        None => Ok(Manifest::builtin().clone()),
    }
}

/// A release folder that does not exist or is empty.
pub fn is_missing(dir: &Path) -> bool {
    std::fs::read_dir(dir).map_or(true, |mut entries| entries.next().is_none())
}

/// How to get the release and serve it: the download commands, the flags that point at the
/// folders they write, and the demo.
pub fn download_help(m: &Manifest) -> String {
    let downloads: Vec<String> = m.download_commands("models").iter().map(|c| format!("  {c}")).collect();
    format!(
        "Download the release {} into a folder models/ (pip install -U huggingface_hub for `hf`):\n{}\n\
         then pass --model models/{} --adapter models/{} (Docker: -v \"$PWD/models:/models:ro\").\n\
         To try the API without it: imajev-serve serve --demo (random weights, meaningless answers).",
        m.release.name,
        downloads.join("\n"),
        m.base.folder,
        m.adapter.folder
    )
}

/// What to do when `path` (the base model or adapter folder) is missing or empty.
pub fn missing_release_help(m: &Manifest, what: &str, path: &Path) -> String {
    format!("the {what} folder {} does not exist or is empty.\n{}", path.display(), download_help(m))
}

/// Runs `verify`; `Ok(())` only when every check passed (the table is on stdout either way).
pub fn run(args: &VerifyArgs) -> Result<()> {
    let m = manifest(args.manifest.as_deref())?;
    let dirs = match (&args.models, &args.model, &args.adapter) {
        (Some(root), _, _) => ReleaseDirs::under(root, &m),
        (None, Some(model), Some(adapter)) => ReleaseDirs { model: model.clone(), adapter: adapter.clone() },
        _ => bail!("say where the release is: a MODELS folder, or --model and --adapter (IMAJEV_MODEL, IMAJEV_ADAPTER)"),
    };
    for (what, dir) in [("base model", &dirs.model), ("adapter", &dirs.adapter)] {
        if is_missing(dir) {
            bail!("{}", missing_release_help(&m, what, dir));
        }
    }
    println!(
        "release {} — base {}, adapter {}",
        m.release.name,
        dirs.model.display(),
        dirs.adapter.display()
    );
    if args.pin {
        let Some(lock_path) = &args.lock else { bail!("--pin needs --lock PATH: where to write the hashes") };
        let (report, lock) = pin(&m, &dirs);
        print!("{report}");
        let Some(lock) = lock else {
            bail!(
                "not pinned: the release fails the checks above, so {} was not written",
                lock_path.display()
            )
        };
        lock.write(lock_path)?;
        let files = lock.base.files.len() + lock.adapter.files.len();
        println!("wrote the lock {} ({files} files)", lock_path.display());
        return Ok(());
    }
    let lock = match &args.lock {
        Some(p) if !p.exists() => {
            bail!("the lock {} does not exist; `imajev-serve verify --pin --lock {}` writes it from a download you trust", p.display(), p.display())
        }
        Some(p) => Some((p.as_path(), Lock::read(p).with_context(|| format!("the lock {}", p.display()))?)),
        None => None,
    };
    let report = verify(&m, &dirs, lock.as_ref().map(|(p, l)| (*p, l)));
    print!("{report}");
    if !report.passed() {
        let mut files: Vec<&str> = Vec::new();
        for r in report.failures() {
            if !files.contains(&r.file.as_str()) {
                files.push(&r.file);
            }
        }
        bail!(
            "the release does not match the manifest{}: {}",
            if lock.is_some() { " and the lock" } else { "" },
            files.join(", ")
        );
    }
    Ok(())
}
