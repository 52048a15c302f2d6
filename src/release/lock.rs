//! The hash lock of a release: the size and sha256 of every file the server reads, as found in a
//! download someone trusted (`imajev-serve verify --pin`). The manifest says what the files must
//! hold; only the lock says which bytes they are, so nothing here is ever written by hand.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lock {
    pub lock_version: u32,
    /// `release.name` of the manifest it was pinned for.
    pub release: String,
    pub base: ComponentLock,
    pub adapter: ComponentLock,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComponentLock {
    pub repo: String,
    pub revision: String,
    /// Path inside the component's folder → its size and hash.
    pub files: BTreeMap<String, FileHash>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileHash {
    pub bytes: u64,
    /// Lower-case hex.
    pub sha256: String,
}

impl Lock {
    pub fn read(path: &Path) -> Result<Lock> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading the lock {}", path.display()))?;
        let lock: Lock =
            serde_json::from_str(&text).with_context(|| format!("parsing the lock {}", path.display()))?;
        if lock.lock_version != 1 {
            bail!(
                "{}: lock_version {} is not supported (this binary reads 1)",
                path.display(),
                lock.lock_version
            );
        }
        for c in [&lock.base, &lock.adapter] {
            for (f, h) in &c.files {
                if h.sha256.len() != 64 || !h.sha256.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                    bail!("{}: the sha256 of {f} is not 64 lower-case hex digits", path.display());
                }
            }
        }
        Ok(lock)
    }

    /// Writes the lock as indented JSON with a trailing newline (stable, diff-friendly).
    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let text = serde_json::to_string_pretty(self)? + "\n";
        std::fs::write(path, text).with_context(|| format!("writing the lock {}", path.display()))
    }
}

/// Size and sha256 of a file, read in 4 MiB pieces.
pub fn hash_file(path: &Path) -> Result<FileHash> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileHash { bytes, sha256: hex::encode(hasher.finalize()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_match_a_known_digest_and_the_lock_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x");
        std::fs::write(&p, b"abc").unwrap();
        let h = hash_file(&p).unwrap();
        // FIPS 180-2, appendix B.1.
        assert_eq!(
            h,
            FileHash {
                bytes: 3,
                sha256: "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad".into()
            }
        );
        let c = ComponentLock {
            repo: "r".into(),
            revision: "0".repeat(40),
            files: [("x".to_string(), h)].into(),
        };
        let lock = Lock { lock_version: 1, release: "t".into(), base: c.clone(), adapter: c };
        let path = dir.path().join("sub/lock.json");
        lock.write(&path).unwrap();
        assert_eq!(Lock::read(&path).unwrap(), lock);
        let text = std::fs::read_to_string(&path).unwrap().replace("ba7816bf", "BA7816BF");
        std::fs::write(&path, text).unwrap();
        assert!(format!("{:#}", Lock::read(&path).unwrap_err()).contains("lower-case hex"));
    }
}
