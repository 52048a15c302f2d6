//! The readout codebook: which option code (`A`…`Z`, then `AA`…`ZZ`) each readout row answers to.
//!
//! imajev keeps a code only if, appended to the rendered decision prompt, it adds exactly one
//! token after the unchanged prompt tokens and that token was not already taken; the list is
//! prefix-stable (the first 255 of 256 codes are the 255-code list). `decision_readout.json`
//! records it as `{"version": 1, "codes": [{"code", "token_id"}, …]}` and is checked against the
//! tokenizer at start, so an adapter can never be served with a mismatched tokenizer.

use crate::tokenizer::QwenTokenizer;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The chat-rendered prompt with empty text and no images, at whose end the codes are tested.
pub const EMPTY_PROMPT: &str = "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Code {
    pub code: String,
    pub token_id: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Codebook {
    pub version: u32,
    pub codes: Vec<Code>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_layout: Option<String>,
}

/// `A`…`Z` then `AA`, `AB`, …, `ZZ`.
pub fn candidate_codes() -> impl Iterator<Item = String> {
    let letters = || (b'A'..=b'Z').map(|c| c as char);
    letters().map(String::from).chain(letters().flat_map(move |a| letters().map(move |b| format!("{a}{b}"))))
}

impl Codebook {
    /// Derives the first `count` codes from the tokenizer, the way imajev does.
    pub fn derive(tokenizer: &QwenTokenizer, count: usize) -> Result<Self> {
        let prefix = tokenizer.encode(EMPTY_PROMPT)?;
        let mut codes = Vec::with_capacity(count);
        let mut seen = std::collections::HashSet::new();
        for code in candidate_codes() {
            if codes.len() == count {
                break;
            }
            let ids = tokenizer.encode(&format!("{EMPTY_PROMPT}{code}"))?;
            if ids.len() == prefix.len() + 1
                && ids[..prefix.len()] == prefix[..]
                && seen.insert(ids[prefix.len()])
            {
                codes.push(Code { code, token_id: ids[prefix.len()] });
            }
        }
        if codes.len() < count {
            bail!(
                "the tokenizer exposes only {} single-token decision codes; {count} requested",
                codes.len()
            );
        }
        Ok(Codebook { version: 1, codes, prompt_layout: None })
    }

    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let cb: Codebook =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if cb.version != 1 {
            bail!("{}: unsupported codebook version {}", path.display(), cb.version);
        }
        Ok(cb)
    }

    /// Writes `decision_readout.json` (2-space indented, trailing newline, as imajev writes it).
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut out = Vec::new();
        let fmt = serde_json::ser::PrettyFormatter::with_indent(b"  ");
        let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
        self.serialize(&mut ser)?;
        out.push(b'\n');
        std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
    }

    /// The adapter's codebook checked against the tokenizer (derived when the file is absent).
    pub fn for_adapter(adapter_dir: &Path, tokenizer: &QwenTokenizer, rows: usize) -> Result<Self> {
        let derived = Self::derive(tokenizer, rows)?;
        let path = adapter_dir.join("decision_readout.json");
        if !path.exists() {
            tracing::info!("{} is absent; using the codebook derived from the tokenizer", path.display());
            return Ok(derived);
        }
        let file = Self::read(&path)?;
        if file.codes.len() != rows {
            bail!("{} lists {} codes but the readout has {rows} rows", path.display(), file.codes.len());
        }
        if let Some(i) = file.codes.iter().zip(&derived.codes).position(|(a, b)| a != b) {
            bail!(
                "{}: code #{i} is {:?} (token {}) but this tokenizer gives {:?} (token {}); the adapter does not match the tokenizer",
                path.display(),
                file.codes[i].code,
                file.codes[i].token_id,
                derived.codes[i].code,
                derived.codes[i].token_id
            );
        }
        if let Some(layout) = &file.prompt_layout {
            if layout != "standard" {
                bail!(
                    "{}: prompt_layout {layout:?} is not supported (only the standard layout shipped)",
                    path.display()
                );
            }
        }
        Ok(file)
    }

    pub fn len(&self) -> usize {
        self.codes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
    }

    pub fn labels(&self, n: usize) -> Vec<&str> {
        self.codes[..n].iter().map(|c| c.code.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen35_codebook_matches_imajev() {
        // imajev's tests/test_p3_readout256.py: code #255 is JT and #256 is JU, with 25 two-letter
        // codes skipped between AA and JU.
        let tok = QwenTokenizer::builtin().unwrap();
        let cb = Codebook::derive(&tok, 256).unwrap();
        assert_eq!(cb.codes[254].code, "JT");
        assert_eq!(cb.codes[255].code, "JU");
        assert_eq!(&cb.codes[0].code, "A");
        assert_eq!(&cb.codes[25].code, "Z");
        let two_letter_before_ju = candidate_codes().skip(26).position(|c| c == "JU").unwrap() + 1;
        assert_eq!(two_letter_before_ju - 230, 25);
        // Prefix-stable.
        assert_eq!(Codebook::derive(&tok, 255).unwrap().codes[..], cb.codes[..255]);
    }
}
