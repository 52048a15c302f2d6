#!/usr/bin/env python3
"""Where do our engine and transformers part? Per-layer hidden states of one prompt, side by side.

    imajev-serve forward --model M [--adapter A] --input in.json --dump-layers D [--device cuda --quantize fp8]
    python3 tools/first_divergence.py --model M [--adapter A] --dump D [--images img.png ...] \
        [--dtype float32|bfloat16] [--device cpu|cuda] [--threshold 1e-2]

`forward --dump-layers D` writes D/hidden_states.safetensors: `hidden_states.{i}` [tokens, hidden]
(0 = the decoder's input: token embeddings with the image features in place; i = the residual
stream after decoder layer i-1), `final_norm` (the final norm's output) and `input_ids` (image
pads expanded). This script runs transformers (+ PEFT when --adapter is given) on the same ids
and images with output_hidden_states=True and prints, per layer, max|Δ| and the relative error
max_t ‖Δ_t‖ / ‖ref_t‖ (per token; ref = transformers), over all tokens and for the last token
(the one decisions read), then the first layer whose relative error is over --threshold. transformers' last hidden_states entry
is the final norm's output (checked here against last_hidden_state), so our last layer's
residual is compared with the pre-norm residual transformers records for that layer only when
it has one; the final norm is compared with last_hidden_state.

--images must be the files `forward`'s input named, in order (pixel values come from
transformers' own image processor, configured by the model's preprocessor_config.json).
Writes the table as JSON too with --json.
"""
import argparse
import json
import sys
from pathlib import Path


def load_dump(path):
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())
        ours = {n: f.get_tensor(n) for n in names}
        meta = f.metadata() or {}
    n_hidden = sum(1 for n in names if n.startswith("hidden_states."))
    hidden = [ours[f"hidden_states.{i}"].double() for i in range(n_hidden)]
    return ours["input_ids"].tolist(), hidden, ours["final_norm"].double(), meta


def load_peer(model_dir, adapter, dtype, device):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration
    m = Qwen3_5ForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    if adapter:
        from peft import PeftModel
        m = PeftModel.from_pretrained(m, str(adapter)).eval()
        return m, m.base_model.model.model
    return m, m.model


def peer_inputs(model_dir, ids, images, device, dtype):
    """Token ids (pads already expanded) plus pixel values for transformers."""
    import torch
    kw = {}
    if images:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
        from transformers.image_utils import load_image
        cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        proc = Qwen2VLImageProcessor(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})
        feats = proc(images=[load_image(str(p)) for p in images], return_tensors="pt")
        kw = {"pixel_values": feats["pixel_values"].to(device, dtype), "image_grid_thw": feats["image_grid_thw"].to(device),
              "mm_token_type_ids": torch.tensor([[1 if t == 248056 else 0 for t in ids]], device=device)}
    return torch.tensor([ids], device=device), kw


def compare(ours, theirs):
    """max|Δ|, and the relative error max over tokens of ‖Δ_t‖ / ‖ref_t‖ (per token, so the
    massive-activation rows do not hide the others), also for the last token alone."""
    d = ours - theirs
    rel_rows = d.norm(dim=-1) / theirs.norm(dim=-1).clamp_min(1e-30)
    return {"max_abs": d.abs().max().item(), "rel": rel_rows.max().item(),
            "last_max_abs": d[-1].abs().max().item(), "last_rel": rel_rows[-1].item()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter")
    ap.add_argument("--dump", required=True, help="the --dump-layers folder (or its hidden_states.safetensors)")
    ap.add_argument("--images", nargs="*", default=[])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threshold", type=float, default=1e-2, help="relative error (max over tokens of ‖Δ‖/‖ref‖) that counts as parted")
    ap.add_argument("--json", help="also write the table here")
    args = ap.parse_args()
    import torch
    dump = Path(args.dump)
    if dump.is_dir():
        dump = dump / "hidden_states.safetensors"
    ids, ours, ours_final, meta = load_dump(dump)
    kinds = meta.get("layer_types", "").split(",")
    dtype = getattr(torch, args.dtype)
    model, core = load_peer(args.model, args.adapter, dtype, args.device)
    x, kw = peer_inputs(args.model, ids, args.images, args.device, dtype)
    with torch.inference_mode():
        out = core(input_ids=x, use_cache=False, output_hidden_states=True, **kw)
    theirs = [h[0].double().cpu() for h in out.hidden_states]
    final = out.last_hidden_state[0].double().cpu()
    # transformers records one entry per decoder layer plus the input; its last entry is the
    # final norm's output (it equals last_hidden_state), not the last layer's residual.
    last_is_normed = torch.equal(out.hidden_states[-1], out.last_hidden_state)
    rows = []
    n_layers = len(ours) - 1
    for i in range(len(ours)):
        if i >= len(theirs) or (i == len(theirs) - 1 and last_is_normed and i == n_layers):
            continue  # no pre-norm residual of the last layer on their side
        name = "embeddings" if i == 0 else f"layer {i - 1} ({kinds[i - 1] if i - 1 < len(kinds) else '?'})"
        rows.append({"index": i, "what": name, **compare(ours[i], theirs[i])})
    rows.append({"index": len(ours), "what": "final norm", **compare(ours_final, final)})
    first = next((r for r in rows if r["rel"] > args.threshold), None)
    print(f"{len(ids)} tokens, {n_layers} layers; transformers {args.dtype} on {args.device}"
          f"{' + PEFT' if args.adapter else ''}; ref = transformers")
    print(f"{'':>4} {'where':<28} {'max|Δ|':>10} {'rel':>10} {'last max|Δ|':>12} {'last rel':>10}")
    for r in rows:
        flag = "  <- first over threshold" if r is first else ""
        print(f"{r['index']:>4} {r['what']:<28} {r['max_abs']:>10.3e} {r['rel']:>10.3e} {r['last_max_abs']:>12.3e} {r['last_rel']:>10.3e}{flag}")
    print(f"first layer over {args.threshold:g}: {first['what'] if first else 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": len(ids), "threshold": args.threshold, "rows": rows,
                                               "first_over_threshold": first}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
