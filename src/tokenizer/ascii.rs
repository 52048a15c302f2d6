//! A fast path for plain text of ASCII (and the em dash): the same ids as the HF pipeline, without
//! its per-token allocations.
//!
//! Why this exists: HF `tokenizers` builds a `NormalizedString` with per-byte alignments for the
//! text and again for every pre-token, then an `Encoding` with strings, offsets and masks; on a
//! request's state and passes that is ~1 µs per token of allocation and copying (a 16K-token state
//! is ~9 ms of two cores before the first launch), while the ids only need the split, the
//! byte-level mapping and one vocabulary look-up per pre-token. For text made only of ASCII and
//! U+2014 (the em dash of the prompt layout's option lines) every step of that pipeline is simple
//! enough to do exactly by hand:
//!
//! * NFC changes nothing (no character of that alphabet decomposes or composes with another);
//! * the Qwen3.5 split regex ([`super::QWEN_SPLIT`]) is emulated alternative by alternative, in
//!   its order and with onig's backtracking, over five classes: letters `[A-Za-z]` (`\p{L}`),
//!   digits (`\p{N}`), `\r`/`\n`, other white space (`\t \v \f` and space: onig's `\s`), and
//!   everything else (`[^\s\p{L}\p{M}\p{N}]`: punctuation, control characters, DEL, the em dash);
//!   no character of the alphabet is a mark (`\p{M}`);
//! * each pre-token's bytes are mapped through GPT-2's byte-to-unicode table (the ByteLevel
//!   pre-tokenizer without prefix space), then looked up whole in the vocabulary (BPE with
//!   `ignore_merges`), and only when absent handed to the HF BPE model itself.
//!
//! Text with any other character is left to HF (see [`fast_segments`]), and the tokenizer uses
//! this path only for a `tokenizer.json` of exactly that layout (see `QwenTokenizer::fast`).
//! Tests compare the ids with the HF pipeline's on the parity corpus, every ASCII character in
//! every context class, and random strings of the awkward characters.

use anyhow::{anyhow, Result};
use std::ops::Range;
use tokenizers::Model;

/// U+2014 EM DASH in UTF-8: the one non-ASCII character of the prompt layout (`with_detail`, the
/// unknown option's text).
const EM_DASH: &[u8] = "\u{2014}".as_bytes();

/// The split regex's view of a character.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// `\p{L}`: `[A-Za-z]`.
    Letter,
    /// `\p{N}`: `[0-9]`.
    Digit,
    /// `\r` or `\n` (also white space).
    Newline,
    /// `\t`, `\v`, `\f`, space: the rest of `\s`.
    Space,
    /// Everything else: not white space, not a letter, mark or digit.
    Other,
}

/// Class and byte length of the character at `i` (`i` < `b.len()`, a character of the
/// alphabet).
fn class_at(b: &[u8], i: usize) -> (Class, usize) {
    match b[i] {
        b'A'..=b'Z' | b'a'..=b'z' => (Class::Letter, 1),
        b'0'..=b'9' => (Class::Digit, 1),
        b'\r' | b'\n' => (Class::Newline, 1),
        b'\t' | 0x0b | 0x0c | b' ' => (Class::Space, 1),
        c if c < 0x80 => (Class::Other, 1),
        _ => {
            debug_assert!(b[i..].starts_with(EM_DASH));
            (Class::Other, EM_DASH.len())
        }
    }
}

fn class(b: &[u8], i: usize) -> Option<Class> {
    (i < b.len()).then(|| class_at(b, i).0)
}

/// The end of the run of characters from `i` whose class satisfies `keep`.
fn run_end(b: &[u8], mut i: usize, keep: impl Fn(Class) -> bool) -> usize {
    while i < b.len() {
        let (c, len) = class_at(b, i);
        if !keep(c) {
            break;
        }
        i += len;
    }
    i
}

fn is_white(c: Class) -> bool {
    matches!(c, Class::Newline | Class::Space)
}

/// The end of the split regex's match at `i` (every character starts a match, so the matches
/// tile the text). The alternatives, in the regex's order:
/// 1. `(?i:'s|'t|'re|'ve|'m|'ll|'d)`;
/// 2. `[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+`;
/// 3. `\p{N}`;
/// 4. ` ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*`;
/// 5. `\s*[\r\n]+` (the white-space run up to its last newline);
/// 6. `\s+(?!\S)` (the run, less its last character unless the text ends there);
/// 7. `\s+`.
fn match_end(b: &[u8], i: usize) -> usize {
    let lower = |k: usize| b.get(k).map(u8::to_ascii_lowercase);
    if b[i] == b'\'' {
        match (lower(i + 1), lower(i + 2)) {
            (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
            (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return i + 3,
            _ => {}
        }
    }
    let (c, len) = class_at(b, i);
    if !matches!(c, Class::Newline | Class::Letter | Class::Digit) && class(b, i + len) == Some(Class::Letter)
    {
        return run_end(b, i + len, |c| c == Class::Letter);
    }
    match c {
        Class::Letter => run_end(b, i, |c| c == Class::Letter),
        Class::Digit => i + 1,
        Class::Other => run_end(b, run_end(b, i, |c| c == Class::Other), |c| c == Class::Newline),
        Class::Space if b[i] == b' ' && class(b, i + 1) == Some(Class::Other) => {
            run_end(b, run_end(b, i + 1, |c| c == Class::Other), |c| c == Class::Newline)
        }
        Class::Space | Class::Newline => {
            // White space is one byte a character.
            let end = run_end(b, i, is_white);
            if let Some(last_newline) = (i..end).rev().find(|&k| matches!(b[k], b'\r' | b'\n')) {
                last_newline + 1
            } else if end == b.len() || end - i == 1 {
                end
            } else {
                end - 1
            }
        }
    }
}

/// Calls `f` with the split regex's matches of `text`, in order.
fn for_each_pretoken(text: &str, mut f: impl FnMut(Range<usize>) -> Result<()>) -> Result<()> {
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let end = match_end(b, i);
        f(i..end)?;
        i = end;
    }
    Ok(())
}

/// The byte length of the character at `i` (`i` < `b.len()`) when it is in the fast path's
/// alphabet.
fn alphabet_char_len(b: &[u8], i: usize) -> Option<usize> {
    if b[i] < 0x80 {
        Some(1)
    } else if b[i..].starts_with(EM_DASH) {
        Some(EM_DASH.len())
    } else {
        None
    }
}

/// Whether every character of `text` is in the fast path's alphabet.
pub(super) fn in_alphabet(text: &str) -> bool {
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match alphabet_char_len(b, i) {
            Some(len) => i += len,
            None => return false,
        }
    }
    true
}

/// `text` cut into maximal stretches that are, or are not, in the fast path's alphabet (`true`:
/// in it), cut only where [`super::cut_points`] may cut (a space between two ASCII letters), so
/// that encoding the stretches one by one gives the ids of the whole.
pub(super) fn fast_segments(text: &str) -> Vec<(Range<usize>, bool)> {
    let b = text.as_bytes();
    let mut out: Vec<(Range<usize>, bool)> = Vec::new();
    let mut push = |r: Range<usize>, fast: bool| match out.last_mut() {
        Some((last, f)) if *f == fast => last.end = r.end,
        _ => out.push((r, fast)),
    };
    let (mut start, mut fast, mut i) = (0, true, 0);
    while i < b.len() {
        if super::cuts_here(b, i) {
            push(start..i, fast);
            (start, fast) = (i, true);
        }
        match alphabet_char_len(b, i) {
            Some(len) => i += len,
            None => {
                fast = false;
                i += 1;
            }
        }
    }
    if start < b.len() {
        push(start..b.len(), fast);
    }
    out
}

/// GPT-2's `bytes_to_unicode`: the printable bytes `!`..=`~`, `¡`..=`¬`, `®`..=`ÿ` stand for
/// themselves; the others, in byte order, for U+0100, U+0101, ….
pub(super) fn byte_level_table() -> [char; 256] {
    let printable =
        |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        table[b as usize] = if printable(b) {
            char::from_u32(b).expect("a Latin-1 code point")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("a code point below U+0200")
        };
    }
    table
}

/// The ids of `text` (every character in the alphabet: [`in_alphabet`]) appended to `ids`, as
/// the HF pipeline of `plain` gives them.
pub(super) fn encode(
    plain: &tokenizers::Tokenizer,
    table: &[char; 256],
    ignore_merges: bool,
    text: &str,
    ids: &mut Vec<u32>,
) -> Result<()> {
    debug_assert!(in_alphabet(text));
    let model = plain.get_model();
    let mut word = String::new();
    for_each_pretoken(text, |r| {
        word.clear();
        word.extend(text.as_bytes()[r].iter().map(|&b| table[b as usize]));
        match ignore_merges.then(|| model.token_to_id(&word)).flatten() {
            Some(id) => ids.push(id),
            None => ids.extend(model.tokenize(&word).map_err(|e| anyhow!(e))?.iter().map(|t| t.id)),
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pretokens(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        for_each_pretoken(text, |r| {
            out.push(&text[r]);
            Ok(())
        })
        .unwrap();
        out
    }

    /// The split, alternative by alternative, on hand-worked cases.
    #[test]
    fn split_follows_the_regex() {
        assert_eq!(pretokens("Hello world"), ["Hello", " world"]);
        assert_eq!(
            pretokens("it's I'LL they'Re 'sam ''s"),
            ["it", "'s", " I", "'LL", " they", "'Re", " '", "sam", " ''", "s"]
        );
        assert_eq!(pretokens("x123 4"), ["x", "1", "2", "3", " ", "4"]);
        assert_eq!(pretokens("{\"case\": \"a\"}\n"), ["{\"", "case", "\":", " \"", "a", "\"}\n"]);
        assert_eq!(pretokens("a  \n \n  b\t\tc  "), ["a", "  \n \n", " ", " b", "\t", "\tc", "  "]);
        assert_eq!(pretokens("a \u{2014} b\u{2014}c"), ["a", " \u{2014}", " b", "\u{2014}c"]);
        assert_eq!(pretokens("\r\n\x0bx\x00y!!\r\r z"), ["\r\n", "\x0bx", "\x00y", "!!\r\r", " z"]);
        assert_eq!(pretokens(""), Vec::<&str>::new());
    }

    #[test]
    fn segments_cut_only_between_ascii_letters() {
        let text = "abc d\u{e9}f ghi jkl \u{2014} mno p\u{65e5} q r";
        let segs = fast_segments(text);
        assert_eq!(segs.iter().map(|(r, _)| r.end - r.start).sum::<usize>(), text.len());
        let parts: Vec<(&str, bool)> = segs.iter().map(|(r, f)| (&text[r.clone()], *f)).collect();
        assert_eq!(
            parts,
            [
                ("abc", true),
                (" d\u{e9}f", false),
                (" ghi jkl \u{2014} mno", true),
                (" p\u{65e5} q", false),
                (" r", true)
            ]
        );
        for (r, _) in &segs[1..] {
            assert!(super::super::cuts_here(text.as_bytes(), r.start), "cut at {}", r.start);
        }
        assert!(fast_segments("").is_empty());
        assert_eq!(fast_segments("\u{e9}"), [(0..2, false)]);
    }
}
