#!/usr/bin/env python3
"""Golden `/v1/systemone` decisions for imajev-serve, from the Python reference `tools/reference_decide.py`.

Rerun (from the repository root; deterministic, overwrites tests/fixtures/decisions/):

    cargo build --release        # the synth subcommand writes the two random-weight models
    /work/venv/bin/python tools/decision_cases.py --bin target/release/imajev-serve

(torch 2.11, torchvision 0.26, transformers 5.17, peft, pillow, tokenizers; CPU is enough, it takes a
few minutes). `--only NAME_SUBSTRING` regenerates nothing but prints the matching cases' answers;
`--skip-self-check` skips the unit checks of the reference against hand-computed values.

What it writes, all under tests/fixtures/decisions/:
  * calibration-1.0.json  schema 1.0, one temperature (1.3051569717552742) in all 15 buckets
  * calibration-1.1.json  schema 1.1, per-bucket temperatures with `unknown_offsets` (text-only requests),
                          two buckets left out (answers there carry no calibration_version)
  * calibration-1.2.json  schema 1.2, `photo_only_temperatures` for requests with >= 1 image and an empty state
  * cases.json            {"generator", "reference", "models", "cases": [...]}; every case is
        {"name", "category", "model": {"seed", "dtype", "lora_rank", "lora_alpha", "readout_rows"},
         "server": {"rotations", "calibration" (a file name above, or null), "contract" ("imajev"|"typesafe"),
                    "max_input_tokens", "model_name"},
         "request": {...the JSON body...},
         "expected": the response {"model", "answers", "usage"} or {"rejected": 422|413},
         "trace" (answered cases only, for debugging a mismatch): {"fields": [per internal field, multi labels
                  fanned out: {"prompt": the chat-rendered first-pass prompt (before image-pad expansion),
                  "passes": [{"offset", "input_tokens", "logits": the fp32 readout logits of that pass}]}],
                  "min_margin": the smallest top-1/top-2 (or |p - threshold|) gap behind a discrete output}}
    The models are `imajev-serve synth --config tiny --dtype <dtype> --seed <seed> --lora-rank <r>
    --lora-alpha <alpha> --readout-rows <rows>` (the Rust test re-creates them; no weights are stored).
    Some request numbers are written with their literal JSON spelling (`1e2`, `-0`, `1E-7`, ...): the
    server must print them the way Python does after json.loads (100.0, 0, 1e-07).
    Compare every number of `expected` within 1e-4 (usage.input_tokens exactly); `usage` has no timing.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "decisions"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_decide as ref  # noqa: E402

MODELS = {
    "m31": {"seed": 31, "dtype": "bf16", "lora_rank": 8, "lora_alpha": 16.0, "readout_rows": 256},
    "m32": {"seed": 32, "dtype": "bf16", "lora_rank": 4, "lora_alpha": 12.0, "readout_rows": 256},
}

# ----------------------------------------------------------------------------------- calibration files

BUCKETS = [f"{t}:{b}" for t in ("boolean", "choice", "ordinal") for b in ("2", "3-5", "6-10", "11-25", "26-254")]
CALIBRATIONS = {
    "calibration-1.0.json": {
        "schema_version": "1.0",
        "calibration_version": "test-cal-1.0",
        "temperatures": {b: 1.3051569717552742 for b in BUCKETS},
        "counts": {b: 150 for b in BUCKETS},
        "fit": {"note": "extra keys are ignored"},
    },
    "calibration-1.1.json": {
        "schema_version": "1.1",
        "calibration_version": "test-cal-1.1-offsets",
        # ordinal:6-10 and choice:26-254 are missing: those answers stay uncalibrated (no calibration_version)
        "temperatures": {"boolean:2": 0.37, "choice:2": 1.9, "choice:3-5": 0.45, "choice:6-10": 2.75,
                         "choice:11-25": 1.2, "ordinal:2": 0.8, "ordinal:3-5": 0.3, "ordinal:11-25": 1.0,
                         "ordinal:26-254": 1.0, "boolean:3-5": 1.0},
        "counts": {"boolean:2": 40, "choice:2": 12, "choice:3-5": 77, "choice:6-10": 9, "choice:11-25": 3,
                   "ordinal:2": 5, "ordinal:3-5": 31, "ordinal:11-25": 1, "ordinal:26-254": 1, "boolean:3-5": 1},
        "unknown_offsets": {"boolean:2": 0.35, "choice:3-5": -0.6, "ordinal:3-5": 0.9, "choice:2": 0.0,
                            "choice:6-10": -1.5},
    },
    "calibration-1.2.json": {
        "schema_version": "1.2",
        "calibration_version": "test-cal-1.2-modality",
        "temperatures": {b: (1.25 if b.startswith("boolean") else 1.6 if b.startswith("choice") else 0.7)
                         for b in BUCKETS},
        "counts": {b: 100 for b in BUCKETS},
        # the photo table has only some buckets: the others fall back to `temperatures`
        "photo_only_temperatures": {"boolean:2": 1.028, "choice:3-5": 0.42, "ordinal:6-10": 2.2},
        "photo_only_counts": {"boolean:2": 823, "choice:3-5": 211, "ordinal:6-10": 57},
    },
}

# ----------------------------------------------------------------------------------- images


def _pattern(w, h, seed):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([127 + 110 * np.sin(xx / 5.0 + seed), 127 + 110 * np.cos(yy / 4.0), (xx * 5 + yy * 3) % 256], -1)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def make_images():
    out = {}
    buf = io.BytesIO()
    Image.fromarray(_pattern(48, 40, 1), "RGB").save(buf, "PNG")
    out["png"] = buf.getvalue()
    # JPEG with EXIF orientation 6: 64x40 stored, 40x64 after exif_transpose
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(_pattern(64, 40, 2), "RGB").save(buf, "JPEG", quality=85, exif=exif.tobytes())
    out["jpeg_exif6"] = buf.getvalue()
    buf = io.BytesIO()
    Image.fromarray(_pattern(30, 34, 3), "RGB").save(buf, "JPEG", quality=90, subsampling=0)
    out["jpeg"] = buf.getvalue()
    buf = io.BytesIO()
    rgba = np.concatenate([_pattern(36, 52, 4), np.full((52, 36, 1), 180, np.uint8)], -1)
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    out["png_rgba"] = buf.getvalue()
    buf = io.BytesIO()
    Image.fromarray(_pattern(8, 8, 5), "RGB").save(buf, "GIF")
    out["gif"] = buf.getvalue()
    return out


IMAGES = make_images()
NONCANONICAL = next(n for n in ("jpeg", "jpeg_exif6", "png", "png_rgba") if len(IMAGES[n]) % 3)


def b64(name):
    return base64.b64encode(IMAGES[name]).decode("ascii")


def data_url(name, mime=None):
    mime = mime or {"png": "image/png", "png_rgba": "image/png", "gif": "image/gif"}.get(name, "image/jpeg")
    return f"data:{mime};base64,{b64(name)}"


def noncanonical_b64(name):
    """Base64 of an image with the unused low bits of the last character set: Python's
    b64decode(validate=True) accepts it and decodes the same bytes."""
    data = IMAGES[name]
    assert len(data) % 3, "needs padding"
    text = base64.b64encode(data).decode("ascii")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    body = text.rstrip("=")
    last = alphabet[alphabet.index(body[-1]) | 1]
    out = body[:-1] + last + text[len(body):]
    assert out != text and base64.b64decode(out, validate=True) == data
    return out


PH1 = "<image:0f3c9a7be21d4c5e8a6b9d0e1f2a3b4c>"
PH2 = "{{photo-of-the-shelf}}"

# ----------------------------------------------------------------------------------- raw JSON numbers

RAW = "\u0000raw:"


def raw(literal: str) -> str:
    """A number written with its literal JSON spelling in cases.json (the reference sees json.loads of it)."""
    json.loads(literal)
    return RAW + literal + "\u0000"


def materialize(value):
    if isinstance(value, str) and value.startswith(RAW):
        return json.loads(value[len(RAW):-1])
    if isinstance(value, list):
        return [materialize(v) for v in value]
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    return value


def dump_with_raw(doc) -> str:
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    out, i = [], 0
    marker = json.dumps(RAW, ensure_ascii=False)[:-1]          # '"\u0000raw:'
    while True:
        j = text.find(marker, i)
        if j < 0:
            out.append(text[i:])
            break
        end = text.find("\\u0000\"", j + len(marker))
        out.append(text[i:j])
        out.append(text[j + len(marker):end])
        i = end + len("\\u0000\"")
    return "".join(out)


# ----------------------------------------------------------------------------------- cases

def noul(instr, criteria=..., **extra):
    q = {"type": "noul", "instructions": instr}
    if criteria is not ...:
        q["criteria"] = criteria
    q.update(extra)
    return q


def choice(instr, criteria):
    return {"type": "choice", "instructions": instr, "criteria": criteria}


def score(instr, levels):
    return {"type": "score", "instructions": instr, "criteria": levels}


def multi(instr, labels, threshold=None):
    q = {"type": "multi", "instructions": instr, "criteria": labels}
    if threshold is not None:
        q["threshold"] = threshold
    return q


TICKET = {"ticket": "Printer on floor 3 shows error E-204 after the firmware update", "priority_hint": None,
          "reporter": "Zoë Müller", "attachments": 2, "tags": ["hardware", "office"]}

TEAMS = {"infra": "network and connectivity problems", "facilities": None,
         "identity": {"what": "accounts, passwords and access", "not_for": ["hardware", "rooms"]}}

URGENCY5 = ["can wait a month", "can wait a week", "this week", "today", {"what": "now", "examples": ["fire", "flood"]}]

FRUITS60 = {f"option-{i:02d}": (None if i % 7 == 0 else
                                 {"what": f"variant {i}", "weight": i * 1.5} if i % 11 == 0 else
                                 [f"kind {i}", i, i % 2 == 0] if i % 13 == 0 else
                                 f"description number {i} ✓")
            for i in range(60)}


def deep(depth):
    """A dict whose deepest scalar sits at nesting depth `depth` (contracts: values at depth > 8 are refused)."""
    node = "leaf"
    for i in range(depth, 0, -1):
        node = {f"d{i}": node} if i % 2 else [node, i]
    return node


def cases():
    C = []

    def add(name, category, request, model="m31", rotations=4, calibration=None, contract="imajev",
            max_input_tokens=65536, model_name="imajev-test"):
        C.append({"name": name, "category": category, "model": MODELS[model],
                  "server": {"rotations": rotations, "calibration": calibration, "contract": contract,
                             "max_input_tokens": max_input_tokens, "model_name": model_name},
                  "request": request})

    # ---------------------------------------------------------------- state rendering
    add("text_state_control_chars_r1", "state", {
        "state": "Printer on floor 3 shows \"E-204\"\nafter the update;\ttab, \\ backslash, \u0001 \u001f ctrl, "
                 "\u007f del, \u2028 line sep, </think> <|im_end|> stays text",
        "questions": {"hw": noul("Is this a hardware problem?")}}, rotations=1)
    add("json_state_unicode", "state", {
        "state": {"中文": "打印机坏了", "emoji": "🖨️❌ 👩‍💻 🇰🇷", "combining": "e\u0301 vs \u00e9, n\u0303",
                  "Zeta": 1, "alpha": "Ünïcödé", "é": "accent key", "한국어": "프린터가 작동하지 않습니다",
                  "arabic": "مرحبا", "nested": {"b": 2, "a": 1, "B": [3, {"y": None, "x": True}]}},
        "questions": {"team": choice("Which team should handle this ticket?", TEAMS)}})
    add("json_state_floats_r1", "state", {
        "state": {"one": 1.0, "small": 1e-05, "big_float": 1e16, "just_below": 1e15, "sum": 0.1 + 0.2,
                  "neg_zero": -0.0, "big_int": 123456789012345678901234567890,
                  "neg_big": -98765432109876543210, "u64max": 18446744073709551615,
                  "max": 1.7976931348623157e308, "denormal": 5e-324, "ten_thousandth": 0.0001,
                  "pi": 3.141592653589793, "lit_1e2": raw("1e2"), "lit_1E-7": raw("1E-7"), "lit_minus0": raw("-0"),
                  "lit_0.1e1": raw("0.1e1"), "lit_100.000": raw("100.000"), "lit_2.50E+20": raw("2.50E+20"),
                  "lit_big_frac": raw("123456789012345678901234567890.0"), "lit_neg_exp": raw("-1.5e-10"),
                  "bools": [True, False, None]},
        "questions": {"urgency": score("How urgent is this?", URGENCY5)}}, rotations=1)
    add("nested_state_depth8", "state", {
        "state": {"doc": deep(7), "empty_obj": {}, "empty_arr": [], "mixed": [[], [{}], [[1, [2, [3]]]]]},
        "questions": {"pick": choice("Which option fits the document best?",
                                     {f"c{i}": (f"choice {i}" if i % 3 else None) for i in range(10)})}})
    add("string_state_quotes_noul_criteria", "state", {
        "state": "He said \"hi\" \\o/\r\nthen left.\n\n\tIndented line with trailing spaces   ",
        "questions": {"left": noul("Did he leave?", {"true": "he is gone", "false": "he is still here"})}},
        model="m32")
    add("missing_state_imajev", "state", {"questions": {"q": noul("Is the sky blue?")}}, rotations=2)
    add("array_state_wrapped_imajev", "state", {
        "state": [1, "two", None, {"three": 3.0}], "questions": {"q": noul("Is there a three?")}})
    add("null_state_imajev", "state", {"state": None, "questions": {"q": noul("Anything known?")}}, rotations=1)
    add("number_state_typesafe", "state", {
        "model": "jev-latest", "state": 42, "questions": {"q": noul("Is the number even?")}},
        contract="typesafe", rotations=1)
    add("array_state_typesafe", "state", {
        "model": "jev-latest", "state": ["a", ["b", "c"]], "questions": {"q": choice("Which letter comes first?",
                                                                                    {"a": None, "b": None, "c": None})}},
        contract="typesafe")
    add("empty_string_state", "state", {"state": "", "questions": {"q": noul("Is anything stated?")}}, rotations=1,
        model="m32")

    # ---------------------------------------------------------------- images
    add("image_png_explicit", "images", {
        "images": [data_url("png")],
        "questions": {"printer": noul("Does the photo show a printer?"),
                      "color": choice("Dominant colour?", {"red": None, "green": "grass-like", "blue": None})}},
        rotations=1)
    add("image_jpeg_embedded_in_state", "images", {
        "state": {"photo": data_url("jpeg_exif6"), "note": "customer photo attached"},
        "questions": {"damaged": noul("Is the device in [image 1] damaged?", {"true": "visible cracks"})}})
    add("two_images_explicit_and_embedded", "images", {
        "images": [data_url("png")],
        "state": f"Compare with this one: {data_url('jpeg')} and say if they match.",
        "questions": {"same": noul("Do the two photos show the same object?"),
                      "which": choice("Which photo is brighter?", {"first": None, "second": None})}}, rotations=2)
    add("typesafe_asset_placeholder", "images", {
        "model": "jev-latest",
        "state": {"photo": PH1, "caption": f"shelf photo {PH1} taken today", "n": 3},
        "questions": {"stocked": noul(f"Is the shelf in {PH1} fully stocked?",
                                      {"true": f"every slot in {PH1} holds a product"}),
                      "zone": choice("Which zone is shown?", {"dairy": f"cold shelves as in {PH1}",
                                                              "bakery": None, "produce": ["fruit", PH1]})},
        "assets": {PH1: {"type": "image", "format": "png", "data_base64": b64("png_rgba")}}},
        contract="typesafe", rotations=1)
    add("typesafe_explicit_plus_asset", "images", {
        "model": "jev-latest",
        "images": [data_url("jpeg_exif6")],
        "state": {"shelf": PH2},
        "questions": {"fill": score(f"How full is the shelf in {PH2}?",
                                    ["empty", f"half full like {PH2}", {"what": "full", "see": PH2}])},
        "assets": {PH2: {"type": "image", "format": "jpg", "data_base64": b64("jpeg")}}},
        contract="typesafe", model="m32")
    add("imajev_embedded_plus_asset", "images", {
        "state": {"before": data_url("png"), "after": PH2},
        "questions": {"changed": noul(["Compare the before and after photos.", f"After: {PH2}"])},
        "assets": {PH2: {"type": "image", "format": "jpeg", "data_base64": b64("jpeg_exif6")}}}, rotations=2)
    add("image_base64_noncanonical_trailing_bits", "images", {
        "images": [f"data:image/jpeg;base64,{noncanonical_b64(NONCANONICAL)}"],
        "state": {"k": "v"}, "questions": {"q": noul("Is there a face?")}}, rotations=1)
    add("image_data_url_whitespace_no_mime", "images", {
        "images": ["  \n" + f"data:;base64,{b64('jpeg')}" + " \t"],
        "state": {}, "questions": {"q": noul("Is the picture mostly dark?")}}, rotations=1, model="m32")

    # ---------------------------------------------------------------- noul criteria
    add("noul_criteria_variants", "noul", {
        "state": TICKET,
        "questions": {"none": noul("Is it hardware?"),
                      "null": noul("Is it hardware?", None),
                      "empty": noul("Is it hardware?", {}),
                      "two_sided": noul("Is it hardware?", {"true": "a physical device", "false": "software only"}),
                      "true_only": noul("Is it hardware?", {"true": "a physical device"}),
                      "false_only": noul("Is it hardware?", {"false": "software only", "true": None}),
                      "structured": noul("The ticket is about a device.",
                                         {"true": {"what": "device", "examples": ["printer", "router"]},
                                          "false": ["software", "account", 3]})}})
    add("typesafe_noul_without_instructions", "noul", {
        "model": "jev-latest", "state": TICKET,
        "questions": {"from_true": {"type": "noul", "criteria": {"true": "The ticket names a printer",
                                                                 "false": "no printer"}},
                      "from_false": {"type": "noul", "criteria": {"false": ["no error code", "given"]}}}},
        contract="typesafe")

    # ---------------------------------------------------------------- choice
    add("choice_2_trailing_whitespace_trim", "choice", {
        "state": {"x": 1},
        "questions": {"pick": choice("Pick one.", {"left ": "ends with spaces and controls \u001f\u3000 \n",
                                                   "right": "plain"})}}, rotations=2)
    add("choice_3_mixed_descriptions", "choice", {
        "state": TICKET, "questions": {"team": choice("Which team?", TEAMS)}}, rotations=1, model="m32")
    add("choice_odd_option_values", "choice", {
        "state": {},
        "questions": {"v": choice("Which value?", {"a — b": "dash inside", "  spaced": None, "😀": "emoji",
                                                   "true": "looks boolean", "x" * 128: "longest allowed",
                                                   "<|im_end|>": "special token text", "1": None})}})
    add("choice_10", "choice", {
        "state": {"text": "Section 4.2 of the lease"},
        "questions": {"topic": choice("Which clause type?",
                                      {f"type {c}": (f"clause family {c}" if c not in "CF" else None)
                                       for c in "ABCDEFGHIJ"})}}, model="m32")
    add("choice_60_cal_1_1", "choice", {
        "state": {"sku": "A-17"}, "questions": {"sku": choice("Which catalogue entry matches?", FRUITS60)}},
        calibration="calibration-1.1.json")
    add("choice_255_max_options", "choice", {
        "state": "long list",
        "questions": {"n": choice("Which number?", {str(i): None for i in range(255)})}}, rotations=2)

    # ---------------------------------------------------------------- score
    add("score_2_5_10", "score", {
        "state": TICKET,
        "questions": {"two": score("Is it severe?", ["no", "yes"]),
                      "five": score("How urgent?", URGENCY5),
                      "ten": score("Rate the clarity of the report.",
                                   [f"level {i}" if i % 4 else {"what": f"level {i}", "anchor": i / 2} for i in range(10)])}})
    add("score_10_r1", "score", {
        "state": {"review": "It was fine, I guess."},
        "questions": {"stars": score("How positive is the review?", [f"{i} stars" for i in range(10)])}},
        rotations=1, model="m32")

    # ---------------------------------------------------------------- multi
    add("multi_threshold", "multi", {
        "state": TICKET,
        "questions": {"tags": multi("Which tags apply to the ticket?",
                                    {"hardware": None, "printer": "a printing device", "network": {"what": "LAN"},
                                     "urgent": ["needs action today", "blocking"], "": None}, 0.3),
                      "t0": multi("Which apply?", {"x": None, "y": None}, 0),
                      "t1": multi("Which apply?", {"x": None}, 1)}})
    add("multi_32_labels_r1", "multi", {
        "state": {"text": "mixed bag"},
        "questions": {"labels": multi("Which labels apply?", {f"label {i}": (None if i % 2 else f"desc {i}")
                                                             for i in range(32)}, 0.5)}}, rotations=1, model="m32")
    add("multi_typesafe", "multi", {
        "model": "jev-latest", "state": TICKET,
        "questions": {"tags": multi("Which apply?", {"hardware": None, "software": None}, 0.45)}},
        contract="typesafe", rotations=2)

    # ---------------------------------------------------------------- several questions, odd ids, structure
    add("mixed_types_odd_ids", "questions", {
        "state": TICKET,
        "questions": {"q-1": noul("Is it hardware?"),
                      "a.b.c": choice("Team?", TEAMS),
                      "with space": score("Urgency?", ["low", "mid", "high"]),
                      "한국어": noul("프린터 문제입니까?"),
                      "🚀 launch": multi("Tags?", {"hw": None, "sw": None}),
                      "__unknown__": noul("Does the reporter have an umlaut?"),
                      "x" * 200: noul("Is there an attachment?")}})
    add("structured_instructions_object", "questions", {
        "state": TICKET,
        "questions": {"obj": noul({"question": "Is `ticket` about the `reporter`'s own device?", "today": "2026-12-02",
                                   "limits": {"max": 3, "ratio": 0.5, "tags": ["a", "b"]}, "n": 1e-05,
                                   "flag": True, "none": None}),
                      "arr": choice(["Line one of the question.", {"k": "v", "z": [1, 2.5]}, 3.0, True, None,
                                     "Pick the team."], TEAMS)}}, model="m32")
    add("instructions_exactly_2000_chars", "questions", {
        "state": {}, "questions": {"long": noul("Is it long? " + "abcdefghij" * 198 + "ééééé✓✓😀")}},
        rotations=1)

    # ---------------------------------------------------------------- rotations
    rot_request = {"state": TICKET, "questions": {"team": choice("Which team?", TEAMS),
                                                  "hw": noul("Is it hardware?"),
                                                  "u": score("Urgency?", URGENCY5)}}
    for r in (1, 2, 3, 4):
        add(f"rotations_{r}", "rotations", rot_request, rotations=r)

    # ---------------------------------------------------------------- calibration
    cal_request = {"state": TICKET,
                   "questions": {"hw": noul("Is it hardware?"), "team": choice("Which team?", TEAMS),
                                 "two": choice("Reply needed?", {"yes": None, "no": None}),
                                 "u": score("Urgency?", URGENCY5),
                                 "u3": score("Severity?", ["low", "mid", "high"]),
                                 "c7": choice("Day?", {d: None for d in ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")}),
                                 "lv8": score("Level?", [f"L{i}" for i in range(8)]),
                                 "tags": multi("Tags?", {"hw": None, "sw": None})}}
    add("calibration_1_0_r4", "calibration", cal_request, calibration="calibration-1.0.json")
    add("calibration_1_0_r1", "calibration", cal_request, calibration="calibration-1.0.json", rotations=1)
    add("calibration_1_1_offsets_text_only_r1", "calibration", cal_request, calibration="calibration-1.1.json",
        rotations=1)
    add("calibration_1_1_offsets_text_only_r4", "calibration", cal_request, calibration="calibration-1.1.json",
        model="m32")
    add("calibration_1_1_with_image_no_offsets", "calibration", {**cal_request, "images": [data_url("png")]},
        calibration="calibration-1.1.json", rotations=1)
    add("calibration_1_2_text_only", "calibration", cal_request, calibration="calibration-1.2.json", rotations=1)
    photo_q = {"hw": noul("Is it a printer?"), "team": choice("Which team?", TEAMS),
               "u": score("Urgency?", URGENCY5), "lv8": score("Level?", [f"L{i}" for i in range(8)])}
    add("calibration_1_2_photo_only", "calibration", {"images": [data_url("png")], "state": {}, "questions": photo_q},
        calibration="calibration-1.2.json", rotations=1)
    add("calibration_1_2_photo_empty_string_state", "calibration",
        {"images": [data_url("jpeg")], "state": "", "questions": photo_q},
        calibration="calibration-1.2.json", rotations=2, model="m32")
    add("calibration_1_2_photo_with_state", "calibration",
        {"images": [data_url("png")], "state": {"shop": "north"}, "questions": photo_q},
        calibration="calibration-1.2.json", rotations=1)
    add("calibration_1_2_photo_only_missing_state", "calibration",
        {"images": [data_url("png")], "questions": {"hw": noul("Is it a printer?")}},
        calibration="calibration-1.2.json")

    # ---------------------------------------------------------------- typesafe contract
    add("typesafe_mixed", "typesafe", {
        "model": "jev-latest", "state": TICKET,
        "questions": {"hw": noul("Is it hardware?", {"true": "a device"}), "team": choice("Which team?", TEAMS),
                      "u": score("Urgency?", URGENCY5), "two": score("Severe?", ["no", "yes"])},
        "unknown_top_level": {"ignored": True}}, contract="typesafe", model_name="jev-1.14.0")
    add("typesafe_calibrated_r1", "typesafe", {
        "model": "jev-latest", "state": "plain text state",
        "questions": {"team": choice("Which team?", TEAMS), "u": score("Urgency?", URGENCY5),
                      "hw": noul("Is it hardware?")}},
        contract="typesafe", calibration="calibration-1.1.json", rotations=1, model="m32")

    # ---------------------------------------------------------------- rejections
    q1 = {"q": noul("Is it?")}
    rej = [
        ("three_images", {"images": [data_url("png"), data_url("jpeg")], "state": {"p": data_url("png")},
                          "questions": q1}, {}),
        ("three_images_with_asset", {"images": [data_url("png"), data_url("jpeg")], "state": {"p": PH1},
                                     "questions": q1,
                                     "assets": {PH1: {"type": "image", "format": "png", "data_base64": b64("png")}}},
         {"contract": "typesafe"}),
        ("choice_256_options", {"state": {}, "questions": {"n": choice("Which?", {str(i): None for i in range(256)})}},
         {}),
        ("choice_1_option", {"state": {}, "questions": {"n": choice("Which?", {"only": None})}}, {}),
        ("choice_reserved_unknown", {"state": {}, "questions": {"n": choice("Which?", {"a": None, "__unknown__": None})}},
         {}),
        ("choice_empty_option_value", {"state": {}, "questions": {"n": choice("Which?", {"a": None, "": None})}}, {}),
        ("choice_option_129_chars", {"state": {}, "questions": {"n": choice("Which?", {"a": None, "y" * 129: None})}},
         {}),
        ("choice_description_number", {"state": {}, "questions": {"n": choice("Which?", {"a": 5, "b": None})}}, {}),
        ("choice_description_2001_chars", {"state": {}, "questions": {"n": choice("Which?",
                                                                                  {"a": "d" * 2001, "b": None})}}, {}),
        ("score_11_levels", {"state": {}, "questions": {"s": score("How much?", [str(i) for i in range(11)])}}, {}),
        ("score_1_level", {"state": {}, "questions": {"s": score("How much?", ["only"])}}, {}),
        ("score_map_criteria", {"state": {}, "questions": {"s": score("How much?", {"0": "low", "1": "high"})}}, {}),
        ("score_null_level", {"state": {}, "questions": {"s": score("How much?", ["low", None])}}, {}),
        ("score_empty_level", {"state": {}, "questions": {"s": score("How much?", ["low", ""])}}, {}),
        ("empty_questions", {"state": {}, "questions": {}}, {}),
        ("questions_missing", {"state": {}}, {}),
        ("questions_65", {"state": {}, "questions": {f"q{i}": noul("Is it?") for i in range(65)}}, {}),
        ("empty_question_id", {"state": {}, "questions": {"": noul("Is it?")}}, {}),
        ("missing_instructions_imajev", {"state": {}, "questions": {"q": {"type": "noul",
                                                                          "criteria": {"true": "yes it is"}}}}, {}),
        ("null_instructions_imajev", {"state": {}, "questions": {"q": noul(None)}}, {}),
        ("missing_instructions_typesafe_choice", {"state": {}, "questions": {
            "q": {"type": "choice", "criteria": {"a": None, "b": None}}}}, {"contract": "typesafe"}),
        ("typesafe_noul_no_instructions_no_criteria", {"state": {}, "questions": {"q": {"type": "noul"}}},
         {"contract": "typesafe"}),
        ("typesafe_noul_null_instructions", {"state": {}, "questions": {
            "q": {"type": "noul", "instructions": None, "criteria": {"true": "x"}}}}, {"contract": "typesafe"}),
        ("empty_instructions", {"state": {}, "questions": {"q": noul("")}}, {}),
        ("instructions_2001_chars", {"state": {}, "questions": {"q": noul("i" * 2001)}}, {}),
        ("instructions_number", {"state": {}, "questions": {"q": noul(7)}}, {}),
        ("unknown_type_boolean", {"state": {}, "questions": {"q": {"type": "boolean", "instructions": "Is it?"}}}, {}),
        ("missing_type", {"state": {}, "questions": {"q": {"instructions": "Is it?"}}}, {}),
        ("question_not_object", {"state": {}, "questions": {"q": "Is it?"}}, {}),
        ("noul_criteria_string", {"state": {}, "questions": {"q": noul("Is it?", "yes")}}, {}),
        ("multi_33_labels", {"state": {}, "questions": {"m": multi("Which?", {f"l{i}": None for i in range(33)})}}, {}),
        ("multi_empty_labels", {"state": {}, "questions": {"m": multi("Which?", {})}}, {}),
        ("multi_threshold_1_5", {"state": {}, "questions": {"m": multi("Which?", {"a": None}, 1.5)}}, {}),
        ("multi_threshold_bool", {"state": {}, "questions": {"m": multi("Which?", {"a": None}, True)}}, {}),
        ("multi_threshold_null", {"state": {}, "questions": {"m": {"type": "multi", "instructions": "Which?",
                                                                   "criteria": {"a": None}, "threshold": None}}}, {}),
        ("multi_label_question_over_2000", {"state": {}, "questions": {"m": multi("w" * 1990, {"label": "abc"})}}, {}),
        ("typesafe_missing_state", {"questions": q1}, {"contract": "typesafe"}),
        ("typesafe_null_state", {"state": None, "questions": q1}, {"contract": "typesafe"}),
        ("state_depth_9", {"state": {"doc": deep(8)}, "questions": q1}, {}),
        ("state_over_128k", {"state": {"blob": "z" * 131073}, "questions": q1}, {}),
        ("images_not_list", {"images": data_url("png"), "questions": q1}, {}),
        ("images_null", {"images": None, "questions": q1}, {}),
        ("image_not_data_url", {"images": ["https://example.com/a.png"], "questions": q1}, {}),
        ("image_not_base64_flag", {"images": ["data:image/png," + b64("png")], "questions": q1}, {}),
        ("image_bad_base64", {"images": ["data:image/png;base64,iVBORw0KGgo*AAAA"], "questions": q1}, {}),
        ("image_gif", {"images": [data_url("gif")], "questions": q1}, {}),
        ("image_not_an_image", {"images": ["data:image/png;base64," + base64.b64encode(b"hello").decode()],
                                "questions": q1}, {}),
        ("assets_empty", {"state": {}, "questions": q1, "assets": {}}, {"contract": "typesafe"}),
        ("asset_bad_format", {"state": {}, "questions": q1,
                              "assets": {PH1: {"type": "image", "format": "gif", "data_base64": b64("png")}}},
         {"contract": "typesafe"}),
        ("asset_part_reference", {"state": {}, "questions": q1,
                                  "assets": {PH1: {"type": "image", "part": "asset-0"}}}, {"contract": "typesafe"}),
        ("over_token_limit", {"state": TICKET, "questions": {"team": choice("Which team?", TEAMS)}},
         {"max_input_tokens": 150}),
        ("over_token_limit_with_image", {"images": [data_url("png")], "state": {},
                                         "questions": {"q": noul("Is it a printer?")}}, {"max_input_tokens": 120}),
    ]
    for name, request, server in rej:
        add("reject_" + name, "rejected", request, **server)
    return C


# ----------------------------------------------------------------------------------- self checks

def self_check(model_dir, adapter_dir):
    """Unit checks of the reference against values computed by hand / independently."""
    import torch
    # json.dumps as the state line (sort_keys, ensure_ascii=False, Python float repr, escapes)
    assert ref.render_state({"b": 1.0, "a": [1e-05, 1e16, -0.0, 0.1 + 0.2, 10 ** 30], "é": "x\"\n\u0001\u007f",
                             "Z": None, "中": True}) == (
        '{"Z": null, "a": [1e-05, 1e+16, -0.0, 0.30000000000000004, 1000000000000000000000000000000], '
        '"b": 1.0, "é": "x\\"\\n\\u0001\u007f", "中": true}')
    assert ref.render_state("a\"b\\c\n") == '"a\\"b\\\\c\\n"'
    assert ref.render_state({}) == "{}"
    assert json.loads("-0") == 0 and ref.render_state(json.loads("[1e2, 1E-7, -0, 0.1e1]")) == "[100.0, 1e-07, 0, 1.0]"
    # flattening
    assert ref.flatten_instructions({"q": "Is it?", "n": [1, 2.0], "o": {"k": None}}) == 'q: Is it?\nn: [1, 2.0]\no: {"k": null}'
    assert ref.flatten_instructions(["a", 1, None, "é"]) == "a\n1\nnull\né"
    assert ref.flatten_description({"what": "x", "n": 1}) == "what: x; n: 1"
    assert ref.flatten_description(["a", ["b"]]) == 'a; ["b"]'
    assert ref.flatten_description("") is None and ref.flatten_description([]) is None and ref.flatten_description({}) is None
    # cyclic offsets (spec examples)
    assert ref.cyclic_offsets(3, 4) == [0, 1, 2] and ref.cyclic_offsets(4, 4) == [0, 1, 2, 3]
    assert ref.cyclic_offsets(5, 4) == [0, 1, 2, 3] and ref.cyclic_offsets(10, 4) == [0, 2, 5, 7]
    assert ref.cyclic_offsets(256, 4) == [0, 64, 128, 192] and ref.cyclic_offsets(11, 2) == [0, 5]
    # combine_rotations == mean of log_softmax mapped back through the rotation (torch, independently)
    rng = np.random.default_rng(0)
    for n, k in ((3, 3), (4, 4), (11, 4), (7, 2)):
        per = [(o, list(rng.normal(0, 2, n))) for o in ref.cyclic_offsets(n, k)]
        res = ref.combine_rotations(per, n)
        acc = torch.zeros(n, dtype=torch.float64)
        for o, lg in per:
            ls = torch.log_softmax(torch.tensor(lg, dtype=torch.float64), 0)
            acc += torch.roll(ls, o)          # position p holds candidate (p + o) % n
        acc /= len(per)
        assert max(abs(a - b) for a, b in zip(res["raw"], acc.tolist())) < 1e-12
        p = torch.softmax(acc, 0).tolist()
        assert max(abs(a - b) for a, b in zip(res["scores"], p)) < 1e-12
        assert res["selected"] == int(torch.argmax(acc))
    # ties: token id in a single pass, candidate index after combining
    assert ref.result_from_logits([1.0, 1.0, 0.0], token_ids=[40, 35, 36])["selected"] == 1
    assert ref.result_from_logits([1.0, 1.0, 0.0])["selected"] == 0
    # confidence formulas
    assert abs(ref.concentration([0.5, 0.25, 0.25]) - 0.25) < 1e-15 and ref.concentration([1 / 3] * 3) < 1e-15
    assert abs(ref.typesafe_choice_confidence([0.88, 0.12, 0.0]) - 0.82) < 1e-12
    assert abs(ref.typesafe_score_confidence([0.0, 0.95, 0.05]) - 0.925) < 1e-12
    assert abs(ref.typesafe_score_confidence([0.5, 0.0, 0.5]) - 0.0) < 1e-12   # mode 0, D = 2/3 -> max(0, 1 - 1.5)
    # calibration buckets
    assert [ref.Calibration.key("choice", n) for n in (2, 3, 5, 6, 10, 11, 25, 26, 254, 255)] == [
        "choice:2", "choice:3-5", "choice:3-5", "choice:6-10", "choice:6-10", "choice:11-25", "choice:11-25",
        "choice:26-254", "choice:26-254", "choice:26-254"]
    # placeholders: leftmost-longest, not re-scanned
    rep = ref.placeholder_replacer({"<a>": "[image 1]", "<a>b": "[image 2]", "[image 1]": "[image 3]"})
    assert rep({"k<a>": ["<a>b <a> [image 1]"]}) == {"k<a>": ["[image 2] [image 1] [image 3]"]}
    # embedded data URLs
    st, found = ref.extract_state_images({"a": ["x data:image/png;base64,AAAA y", {"b": "data:image/jpeg;base64,BB=="}]})
    assert st == {"a": ["x [image 1] y", {"b": "[image 2]"}]} and len(found) == 2

    # the model side: codebook, chat template, processor, determinism
    m = ref.load_model(model_dir, adapter_dir)
    assert m.codes[:3] == ["A", "B", "C"] and m.codes[25] == "Z" and m.codes[254] == "JT" and m.codes[255] == "JU"
    assert m.render("x ", 0) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert m.render("t \u001f\u3000\n", 2) == ("<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>" * 2
                                             + "t<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    proc = Qwen3VLProcessor(image_processor=m.processor, tokenizer=m.tokenizer, video_processor=Qwen3VLVideoProcessor(),
                            chat_template=m.tokenizer.chat_template)
    pil = [ref.load_image_bytes(IMAGES["png"], 0)[0], ref.load_image_bytes(IMAGES["jpeg_exif6"], 1)[0]]
    assert pil[1].size == (40, 64)
    text = "Question: is it? é 😀"
    msgs = [{"role": "user", "content": [{"type": "image"}] * 2 + [{"type": "text", "text": text}]}]
    rendered = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert rendered == m.render(text, 2)
    real = proc(text=[rendered], images=pil, return_tensors="pt")
    vision = m.vision_inputs(pil)
    ids = m.expand(m.encode(rendered), vision)
    assert real["input_ids"][0].tolist() == ids
    assert torch.equal(real["pixel_values"], vision["pixel_values"])
    assert real["mm_token_type_ids"][0].tolist() == [1 if t == m.image_pad_id else 0 for t in ids]
    a, b = m.logits(ids, vision, 256), m.logits(ids, vision, 256)
    assert a == b, "fp32 forward is not deterministic"
    t_ids = m.encode(m.render("determinism " * 50, 0))
    assert m.logits(t_ids, None, 7) == m.logits(t_ids, None, 7)
    print("self-check: ok (json.dumps, flattening, offsets, combine_rotations, ties, confidences, buckets, "
          "placeholders, codebook JT/JU, template trim, Qwen3VLProcessor equality, deterministic forwards)",
          file=sys.stderr)


# ----------------------------------------------------------------------------------- main

def min_margin(response):
    """The smallest gap behind any discrete output of the response: top-1 minus top-2 of an answer's full
    distribution (abstained / selected), of a choice's renormalised options (choice when abstained), and
    |p - threshold| of a multi label."""
    gaps = []
    for a in response["answers"].values():
        u = a.get("unknown_probability", a.get("x_unknown_probability"))
        if a["type"] == "multi":
            gaps += [abs(p - a["threshold"]) for p in a["probabilities"].values()]
            continue
        if a["type"] == "noul":
            yes = a["noul"] - 0.5 * u
            full = [yes, 1 - u - yes, u]
        else:
            known = sorted(a["probabilities"].values(), reverse=True)
            gaps.append(known[0] - known[1])
            full = [p * (1 - u) for p in a["probabilities"].values()] + [u]
        full.sort(reverse=True)
        gaps.append(full[0] - full[1])
    return min(gaps)


def synth(binary, spec, work: Path):
    key = f"s{spec['seed']}-r{spec['lora_rank']}"
    mdir, adir = work / key / "model", work / key / "adapter"
    if not mdir.exists():
        subprocess.run([binary, "synth", "--config", "tiny", "--dtype", spec["dtype"], "--seed", str(spec["seed"]),
                        "--out", str(mdir), "--adapter-out", str(adir), "--lora-rank", str(spec["lora_rank"]),
                        "--lora-alpha", str(spec["lora_alpha"]), "--readout-rows", str(spec["readout_rows"])],
                       check=True, stdout=subprocess.DEVNULL)
    return mdir, adir


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "imajev-serve"))
    ap.add_argument("--only", help="print the answers of the cases whose name contains this; write nothing")
    ap.add_argument("--skip-self-check", action="store_true")
    args = ap.parse_args()
    import torch
    import transformers
    import peft
    import PIL
    torch.manual_seed(0)

    all_cases = cases()
    names = [c["name"] for c in all_cases]
    assert len(names) == len(set(names)), "duplicate case names"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cal_dir = work / "cal"
        cal_dir.mkdir()
        for fname, doc in CALIBRATIONS.items():
            (cal_dir / fname).write_text(json.dumps(doc, indent=2) + "\n")
        dirs = {json.dumps(spec, sort_keys=True): synth(args.bin, spec, work) for spec in MODELS.values()}
        if not args.skip_self_check and not args.only:
            self_check(*dirs[json.dumps(MODELS["m31"], sort_keys=True)])
        started = time.time()
        for case in all_cases:
            if args.only and args.only not in case["name"]:
                continue
            mdir, adir = dirs[json.dumps(case["model"], sort_keys=True)]
            s = case["server"]
            t0 = time.time()
            trace = {}
            try:
                expected = ref.decide(materialize(case["request"]), mdir, adir, rotations=s["rotations"],
                                      calibration=None if s["calibration"] is None else cal_dir / s["calibration"],
                                      contract=s["contract"], max_input_tokens=s["max_input_tokens"],
                                      model_name=s["model_name"], trace=trace)
                trace["min_margin"] = min_margin(expected)
                case["trace"] = trace
                note = (f"{len(expected['answers'])} answers, {expected['usage']['input_tokens']} tokens, "
                        f"margin {trace['min_margin']:.1e}")
            except ref.Rejected as exc:
                expected = {"rejected": exc.status}
                note = f"rejected {exc.status} {exc.code}: {exc.message[:90]}"
            case["expected"] = expected
            print(f"{case['name']:<48} {time.time() - t0:6.1f}s  {note}", file=sys.stderr)
            if args.only:
                print(json.dumps(expected, ensure_ascii=False, indent=1))
        if args.only:
            return
        elapsed = time.time() - started

    OUT.mkdir(parents=True, exist_ok=True)
    for fname, doc in CALIBRATIONS.items():
        (OUT / fname).write_text(json.dumps(doc, indent=2) + "\n")
    doc = {
        "generator": "tools/decision_cases.py (reference: tools/reference_decide.py)",
        "reference": {"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__,
                      "pillow": PIL.__version__, "dtype": "float32", "attn_implementation": "eager",
                      "synth_config": "tiny", "tolerance": 1e-4},
        "models": list(MODELS.values()),
        "cases": all_cases,
    }
    text = dump_with_raw(doc)
    reread = json.loads(text)["cases"]
    assert all(r["request"] == materialize(c["request"]) for r, c in zip(reread, all_cases))
    assert "raw:" not in text
    (OUT / "cases.json").write_text(text + "\n")

    # summary
    by_cat = Counter(c["category"] for c in all_cases)
    rejected = Counter(c["expected"]["rejected"] for c in all_cases if "rejected" in c["expected"])
    answered = [c for c in all_cases if "rejected" not in c["expected"]]
    types = Counter(a["type"] for c in answered for a in c["expected"]["answers"].values())
    flags = Counter()
    for c in answered:
        for a in c["expected"]["answers"].values():
            if a.get("abstained") or a.get("x_abstained"):
                flags["abstained"] += 1
            if "calibration_version" in a or "x_calibration_version" in a:
                flags["calibrated"] += 1
        flags[f"images={len(c['expected']['usage']['images'])}"] += 1
        flags[f"rotations={c['server']['rotations']}"] += 1
        flags[f"contract={c['server']['contract']}"] += 1
        flags[f"model=seed{c['model']['seed']}"] += 1
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"\nwrote {len(all_cases)} cases to {OUT / 'cases.json'} in {elapsed:.0f}s; fixtures folder {size / 1e6:.2f} MB")
    print("by category: " + ", ".join(f"{k} {v}" for k, v in sorted(by_cat.items())))
    print(f"answered {len(answered)}, rejected {sum(rejected.values())} ({dict(sorted(rejected.items()))})")
    print("answers by type: " + ", ".join(f"{k} {v}" for k, v in sorted(types.items())))
    print("answered cases: " + ", ".join(f"{k} {v}" for k, v in sorted(flags.items())))


if __name__ == "__main__":
    main()
