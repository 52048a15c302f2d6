#!/usr/bin/env python3
"""Golden outputs of Hugging Face transformers (+ PEFT) for the engine's parity tests.

What it does
  1. Writes small deterministic test images to tests/fixtures/golden/images/ (PNG).
  2. For each model variant below, runs `imajev-serve synth` to write a random-weight Qwen3.5
     checkpoint + imajev-style adapter (the Rust tests re-create the same files from the same
     seeds, so no weights are committed).
  3. Loads each checkpoint with `Qwen3_5ForConditionalGeneration.from_pretrained(dtype=float32,
     attn_implementation="eager")` and the adapter with `PeftModel.from_pretrained`, tokenizes the
     prompts with the checkpoint's tokenizer.json, preprocesses images with the real
     `Qwen2VLImageProcessor`, expands each <|image_pad|> as the Qwen3-VL processor does, and runs
     one forward. Records the final-normed hidden state of the last token and the f32 readout.
  4. Writes tests/fixtures/golden/cases.json.

Rerun (from the repository root, in a venv with torch 2.11, torchvision 0.26, transformers 5.17,
peft, pillow):
    cargo build --release
    python tools/golden.py --bin target/release/imajev-serve
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "golden"
IMAGE_PAD = 248056

ALT_CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056, "video_token_id": 248057,
    "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 96, "intermediate_size": 160,
        "num_hidden_layers": 5, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64,
        "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 24,
        "linear_num_key_heads": 2, "linear_num_value_heads": 6,
        "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        "tie_word_embeddings": True,
    },
    "vision_config": {
        "model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 48, "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 96, "num_heads": 3, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "out_hidden_size": 96, "num_position_embeddings": 144,
    },
}

ADAPTER = {"rank": 4, "alpha": 8.0, "readout_rows": 12}

MODELS = [
    {"name": "tiny-f32", "config": "tiny", "dtype": "f32", "seed": 11, "adapter": ADAPTER},
    {"name": "tiny-bf16", "config": "tiny", "dtype": "bf16", "seed": 12, "adapter": ADAPTER},
    {"name": "tiny-fp8", "config": "tiny", "dtype": "fp8", "seed": 13, "adapter": ADAPTER},
    {"name": "alt-f32", "config": "alt_config.json", "dtype": "f32", "seed": 14, "adapter": {"rank": 3, "alpha": 12.0, "readout_rows": 7}},
]

LONG_TEXT = (
    "Inspect the available evidence and answer the question using the stated criteria. "
    "State: {\"ticket\": \"Printer on floor 3 shows error E-204 after the firmware update\", "
    "\"priority_hint\": null, \"reporter\": \"Zoë Müller\", \"attachments\": 2, \"tags\": [\"hardware\", \"office\"]}\n"
    "Question: Which team should handle this ticket? Consider that network problems go to infra, "
    "broken devices go to facilities, and account issues go to identity. 日本語の説明も含めます：プリンターが動きません。"
    " 한국어 설명: 프린터가 작동하지 않습니다. Emoji check 🖨️❌ and numbers 3.14159, 2026-12-02, 1e-05.\n"
    "A: infra — network and connectivity problems\nB: facilities — physical devices and rooms\n"
    "C: identity — accounts, passwords and access\nD: unknown — cannot be determined from the available evidence"
)


def prompt(n_images: int, text: str) -> str:
    return (
        "<|im_start|>user\n"
        + "<|vision_start|><|image_pad|><|vision_end|>" * n_images
        + text
        + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


CASES = [
    # (model, adapter?, images, text)
    ("tiny-f32", False, [], LONG_TEXT + "\n" + LONG_TEXT),
    ("tiny-f32", True, [], LONG_TEXT + "\n" + LONG_TEXT),
    ("tiny-f32", True, ["wide.png"], "Does the first photo show a printer?"),
    ("tiny-f32", False, ["wide.png", "tall.png"], "Compare the two photos. " + LONG_TEXT),
    ("tiny-f32", True, ["wide.png", "tall.png"], "Compare the two photos. " + LONG_TEXT),
    ("tiny-f32", True, ["small.png"], "x"),
    ("tiny-bf16", True, [], LONG_TEXT),
    ("tiny-bf16", True, ["tall.png"], "Is the device damaged?"),
    ("tiny-fp8", False, [], LONG_TEXT),
    ("tiny-fp8", True, ["wide.png", "small.png"], "Same device in both photos? " + LONG_TEXT),
    ("alt-f32", True, [], LONG_TEXT + " " + LONG_TEXT),
    ("alt-f32", False, ["tall.png", "wide.png"], "Describe. " + LONG_TEXT),
]


def make_images(dst: Path):
    dst.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261202)
    specs = {"wide.png": (150, 61), "tall.png": (70, 190), "small.png": (23, 31)}
    for name, (w, h) in specs.items():
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack(
            [
                127 + 120 * np.sin(xx / (7 + w / 30)),
                127 + 120 * np.cos(yy / 9.0),
                (xx * 3 + yy * 2) % 256,
            ],
            axis=-1,
        )
        noise = rng.normal(0, 25, size=base.shape)
        img = np.clip(base + noise, 0, 255).astype(np.uint8)
        Image.fromarray(img, "RGB").save(dst / name, optimize=False)


def synth(binary: str, model: dict, work: Path) -> tuple[Path, Path]:
    mdir = work / model["name"]
    adir = work / (model["name"] + "-adapter")
    cfg = model["config"]
    if cfg.endswith(".json"):
        cfg = str(OUT / cfg)
    a = model["adapter"]
    cmd = [
        binary, "synth", "--config", cfg, "--dtype", model["dtype"], "--seed", str(model["seed"]),
        "--out", str(mdir), "--adapter-out", str(adir), "--lora-rank", str(a["rank"]),
        "--lora-alpha", str(a["alpha"]), "--readout-rows", str(a["readout_rows"]),
    ]
    subprocess.run(cmd, check=True)
    return mdir, adir


def run_case(model_dir: Path, adapter_dir: Path | None, images: list[str], text: str):
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.image_utils import load_image
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
        core = model.base_model.model.model
    else:
        core = model.model
    model.eval()
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(prompt(len(images), text), add_special_tokens=False).ids
    kwargs = {}
    if images:
        pcfg = json.loads((model_dir / "preprocessor_config.json").read_text())
        proc = Qwen2VLImageProcessor(**{k: v for k, v in pcfg.items() if k not in ("image_processor_type", "processor_class")})
        pil = [load_image(str(OUT / "images" / n)) for n in images]
        feats = proc(images=pil, return_tensors="pt")
        grids = feats["image_grid_thw"].tolist()
        expanded = []
        gi = 0
        for t in ids:
            if t == IMAGE_PAD:
                gt, gh, gw = grids[gi]
                expanded += [IMAGE_PAD] * (gt * gh * gw // 4)
                gi += 1
            else:
                expanded.append(t)
        ids = expanded
        kwargs = {
            "pixel_values": feats["pixel_values"],
            "image_grid_thw": feats["image_grid_thw"],
            "mm_token_type_ids": torch.tensor([[1 if t == IMAGE_PAD else 0 for t in ids]]),
        }
    with torch.no_grad():
        out = core(input_ids=torch.tensor([ids]), use_cache=False, **kwargs)
    hidden = out.last_hidden_state[0, -1].float()
    result = {"input_ids": ids, "hidden_last": hidden.tolist()}
    if adapter_dir is not None:
        w = load_file(str(adapter_dir / "decision_readout.safetensors"))["weight"].float()
        result["readout_logits"] = (w @ hidden).tolist()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "imajev-serve"))
    args = ap.parse_args()
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "alt_config.json").write_text(json.dumps(ALT_CONFIG, indent=2) + "\n")
    make_images(OUT / "images")
    import transformers, peft

    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dirs = {m["name"]: synth(args.bin, m, work) for m in MODELS}
        for name, use_adapter, images, text in CASES:
            mdir, adir = dirs[name]
            r = run_case(mdir, adir if use_adapter else None, images, text)
            r.update({"model": name, "adapter": use_adapter, "images": images, "prompt": prompt(len(images), text)})
            cases.append(r)
            print(f"{name} adapter={use_adapter} images={images}: {len(r['input_ids'])} tokens", file=sys.stderr)
    doc = {
        "generator": "tools/golden.py",
        "reference": {
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "torch": torch.__version__,
            "dtype": "float32",
            "attn_implementation": "eager",
        },
        "models": MODELS,
        "cases": cases,
    }
    (OUT / "cases.json").write_text(json.dumps(doc, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {OUT / 'cases.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
