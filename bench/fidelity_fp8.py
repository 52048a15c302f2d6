#!/usr/bin/env python3
"""The FP8 bar of issue 12 on a trained-like checkpoint: is our FP8 path its recipe, within noise?

    OUT=$OUT python3 bench/fidelity_fp8.py --bin .gpu/imajev-serve --work /tmp/fid --out $OUT

One command, one H200, about 6 minutes with the defaults (torch 2.11, transformers 5.17, peft;
no network). Steps, each timed in the JSON:
1. `synth --profile trained-like` writes the Qwen3.5-4B shapes (BF16, seed 0) and an imajev-style
   adapter (LoRA r64/α128, 256-row readout): decisions follow the options' content, so the 4
   rotations of a question agree and the combined answer is peaked (src/synth/profile.rs).
2. Requests: --text-requests text requests of 3 questions (bench/gpu_bench.py's fidelity set)
   and --image-requests requests with one or two 256×256 images (64 visual tokens each; 256 is
   a multiple of 32, so neither side resamples and the pixels are identical), 4 rotations:
   ≥ 1,000 decisions with the defaults.
3. Ours: `decide --device cuda --rotations 4` with `--quantize fp8` and with `--quantize none`,
   writing every pass's token ids and readout logits.
4. transformers + PEFT on the same token ids (and image files), batched (passes right-padded;
   causal attention and the causal DeltaNet make a row's last real token independent of the
   padding after it; checked on the first batch against unbatched runs, `batching_check`):
   * bf16 — the reference for ours-bf16 and for what FP8 costs;
   * fp32 — on the first --floor-requests requests only: bf16 vs fp32 is the noise floor;
   * fp8 — our FP8 recipe emulated: every projection our loader makes FP8 (nn.Linear with both
     dims multiples of 128, text and vision, and the vision patch embedding; never in_proj_a/b,
     the embedding or the readout) gets RTN E4M3 128×128 weights from the same BF16 values
     (s = 448 / max|block|, src/weights/fp8.rs — the blocks `--quantize fp8` makes at load), and
     its BF16 input is quantised per token and 128 columns with the same rule as
     kernels/quant.cu (s = max|x| / 448, 1 for an all-zero block; q = e4m3(x / s), RNE), then an
     fp32 GEMM of the dequantised values, bias in fp32, result rounded to bf16. LoRA stays
     unquantised on the BF16 input, as ours.
5. Pairs, per decision (a question, 4 rotations combined as imajev combines them) and per pass:
   top agreement, median / p99 / max |Δp| over all candidates incl. unknown.
   The bar (issue 12): ours fp8 vs transformers fp8-emulated, top agreement ≥ 99.5% and median
   |Δp| ≤ 1e-3, with the floor (transformers bf16 vs fp32) beside it.
Writes OUT/fidelity_fp8.json: the object for bench/results/h200.json's `fidelity`.

`--device cpu` is a dry run of the plumbing on a small config (`--config mid`): there is no FP8
path on the CPU, so "ours fp8" is then our CPU engine (f32) and the JSON says so.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # noqa: E402

IMAGE_PAD = 248056
PAD = 248044
BAR = {"top_agreement_min": 0.995, "median_abs_dp_max": 1e-3}


# ---------------------------------------------------------------- the FP8 recipe in torch


def rtn_fp8_blocks(w):
    """RTN 128x128 E4M3, s = 448 / max|block| (1 for a zero block), dequantised back, fp32."""
    import torch
    o, i = w.shape
    x = w.float().reshape(o // 128, 128, i // 128, 128)
    amax = x.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    return ((x * s).to(torch.float8_e4m3fn).float() / s).reshape(o, i)


def quant_act_1x128(x):
    """Per token and 128 columns: s = max|x| / 448 (1 for an all-zero block), q = e4m3(x / s)."""
    import torch
    sh = x.shape
    g = x.float().reshape(*sh[:-1], sh[-1] // 128, 128)
    amax = g.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return ((g / s).to(torch.float8_e4m3fn).float() * s).reshape(sh)


def emulate_fp8(model):
    """Replaces the forward of every projection our loader stores as FP8 under --quantize fp8."""
    import torch
    names = []

    def fp8_linear(mod):
        w32 = rtn_fp8_blocks(mod.weight.data)
        b32 = None if mod.bias is None else mod.bias.data.float()

        def fwd(x, w32=w32, b32=b32):
            y = torch.nn.functional.linear(quant_act_1x128(x), w32)
            return (y if b32 is None else y + b32).to(x.dtype)
        mod.weight.data = w32.to(mod.weight.dtype)  # what a dequantising reader would see
        mod.forward = fwd

    for name, mod in model.named_modules():
        if "lm_head" in name:
            continue
        if isinstance(mod, torch.nn.Linear):
            o, i = mod.weight.shape
            if o % 128 == 0 and i % 128 == 0:
                fp8_linear(mod)
                names.append(name)
    # The vision patch embedding: a Conv3d whose kernel equals its stride, i.e. a linear map of
    # the flattened patch (our loader makes it a [hidden, C·T·P·P] projection).
    for name, mod in model.named_modules():
        if name.endswith("patch_embed") and hasattr(mod, "proj") and isinstance(mod.proj, torch.nn.Conv3d):
            conv = mod.proj
            o = conv.weight.shape[0]
            flat = conv.weight.data.reshape(o, -1)
            if o % 128 or flat.shape[1] % 128:
                continue
            w32 = rtn_fp8_blocks(flat)
            b32 = conv.bias.data.float()
            conv.weight.data = w32.reshape(conv.weight.shape).to(conv.weight.dtype)

            def pe(hidden_states, w32=w32, b32=b32, dtype=conv.weight.dtype, k=flat.shape[1]):
                x = hidden_states.reshape(-1, k).to(dtype)
                y = torch.nn.functional.linear(quant_act_1x128(x), w32) + b32
                return y.to(dtype)
            mod.forward = pe
            names.append(name + ".proj")
    return names


# ---------------------------------------------------------------- transformers, batched


class Peer:
    """transformers + PEFT on our passes' token ids, several passes per forward."""

    def __init__(self, model_dir, adapter_dir, dtype, device, fp8=False):
        import torch
        from transformers import Qwen3_5ForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
        from peft import PeftModel
        from safetensors.torch import load_file
        self.torch, self.device, self.dtype = torch, device, dtype
        t = time.perf_counter()
        m = Qwen3_5ForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.fp8_modules = emulate_fp8(m) if fp8 else []
        self.model = PeftModel.from_pretrained(m, str(adapter_dir)).eval()
        self.core = self.model.base_model.model.model
        self.readout = load_file(str(Path(adapter_dir) / "decision_readout.safetensors"))["weight"].float().to(device)
        cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        self.proc = Qwen2VLImageProcessor(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})
        self.pixels = {}
        self.load_s = time.perf_counter() - t

    def image_inputs(self, paths):
        key = tuple(map(str, paths))
        if key not in self.pixels:
            from transformers.image_utils import load_image
            f = self.proc(images=[load_image(p) for p in key], return_tensors="pt")
            self.pixels[key] = (f["pixel_values"], f["image_grid_thw"])
        return self.pixels[key]

    def expand(self, ids, grids):
        out, gi = [], 0
        for t in ids:
            if t == IMAGE_PAD:
                g = grids[gi]
                out += [IMAGE_PAD] * (g[0] * g[1] * g[2] // 4)
                gi += 1
            else:
                out.append(t)
        return out

    def forward_rows(self, rows, images):
        """rows: [(ids (pads expanded), n)] sharing the image list `images` → readout logits."""
        torch = self.torch
        lens = [len(r[0]) for r in rows]
        width = max(lens)
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        for i, (r, _) in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        kw = {}
        if images:
            pv, grid = self.image_inputs(images)
            kw = {"pixel_values": pv.repeat(len(rows), 1).to(self.device, self.dtype),
                  "image_grid_thw": grid.repeat(len(rows), 1).to(self.device),
                  "mm_token_type_ids": (ids == IMAGE_PAD).long().to(self.device)}
        with torch.inference_mode():
            h = self.core(input_ids=ids.to(self.device), use_cache=False, **kw).last_hidden_state
            last = h[torch.arange(len(rows), device=self.device), torch.tensor(lens, device=self.device) - 1].float()
            logits = last @ self.readout.T
        return [logits[i, :n].tolist() for i, (_, n) in enumerate(rows)]

    def run(self, passes, max_tokens, max_rows):
        """passes: dicts with input_ids, n, images → logits per pass, in order."""
        out = [None] * len(passes)
        groups = {}
        for k, p in enumerate(passes):
            groups.setdefault(tuple(map(str, p["images"])), []).append(k)
        for images, ks in groups.items():
            grids = self.image_inputs(images)[1].tolist() if images else []
            rows = sorted(((self.expand(passes[k]["input_ids"], grids), passes[k]["n"], k) for k in ks),
                          key=lambda r: len(r[0]))
            i = 0
            while i < len(rows):
                j = i + 1
                while j < len(rows) and j - i < max_rows and len(rows[j][0]) * (j + 1 - i) <= max_tokens:
                    j += 1
                res = self.forward_rows([(r[0], r[1]) for r in rows[i:j]], list(images))
                for r, l in zip(rows[i:j], res):
                    out[r[2]] = l
                i = j
        return out

    def batching_check(self, passes):
        """max |Δlogit| between batched and one-at-a-time runs of the same passes."""
        batched = self.run(passes, 1 << 30, len(passes))
        single = [self.run([p], 1 << 30, 1)[0] for p in passes]
        return max(abs(a - b) for x, y in zip(batched, single) for a, b in zip(x, y))


# ---------------------------------------------------------------- comparisons


def decisions(passes, logits):
    """Group per-pass logits into questions: [(offsets, [logits])] in a stable order."""
    q = {}
    for p, l in zip(passes, logits):
        q.setdefault((p["request"], p["field"]), []).append((p["offset"], l))
    return [q[k] for k in sorted(q)]


def argmax(xs):
    return max(range(len(xs)), key=lambda j: xs[j])


def compare(a_q, b_q):
    """Per decision (rotations combined) and per pass: top agreement and |Δp|."""
    res = {}
    for mode in ("combined", "per_pass"):
        agree, n, dps = 0, 0, []
        for qa, qb in zip(a_q, b_q):
            pairs = [(qa, qb)] if mode == "combined" else [([x], [y]) for x, y in zip(qa, qb)]
            for xa, xb in pairs:
                pa, pb = gb.combine(xa), gb.combine(xb)
                agree += argmax(pa) == argmax(pb)
                n += 1
                dps += [abs(u - v) for u, v in zip(pa, pb)]
        res[mode] = {"decisions": n, "top_agreement": agree / n, "median_abs_dp": statistics.median(dps),
                     "p99_abs_dp": gb.pct(dps, 0.99), "max_abs_dp": max(dps)}
    return res


def peakedness(qs):
    tops, agree = [], 0
    for q in qs:
        tops.append(max(gb.combine(q)))
        n = len(q[0][1])
        picks = {(argmax(gb.combine([(0, l)])) + off) % n for off, l in q}
        agree += len(picks) == 1
    return {"median_top_p": statistics.median(tops), "p10_top_p": gb.pct(tops, 0.1), "p90_top_p": gb.pct(tops, 0.9),
            "share_top_p_below_0.6": sum(t < 0.6 for t in tops) / len(tops),
            "rotations_pick_the_same_option": agree / len(qs)}


# ---------------------------------------------------------------- main


def image_request(seed, paths):
    r = gb.fidelity_requests(1, seed=seed)[0]
    r["images"] = [gb.data_url(p) for p in paths]
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="qwen3.5-4b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-requests", type=int, default=312)
    ap.add_argument("--image-requests", type=int, default=24, help="half with one image, half with two")
    ap.add_argument("--floor-requests", type=int, default=70, help="requests (3 decisions each) for bf16 vs fp32")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--batch-rows", type=int, default=64)
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--lora-alpha", type=float, default=128)
    args = ap.parse_args()
    import torch
    import transformers
    import peft
    t0 = time.perf_counter()
    timings = {}
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    model, adapter = work / f"model-{args.config}-tl", work / f"adapter-{args.config}-tl"
    if not (model / "config.json").exists():
        t = time.perf_counter()
        gb.run([args.bin, "synth", "--config", args.config, "--profile", "trained-like", "--dtype", "bf16",
                "--seed", str(args.seed), "--out", model, "--adapter-out", adapter, "--lora-rank", str(args.lora_rank),
                "--lora-alpha", str(args.lora_alpha), "--readout-rows", "256"])
        timings["synth_s"] = time.perf_counter() - t

    # Requests: text, then image requests (256×256 photos-like PNGs).
    imgs = [work / f"fid{i}.png" for i in range(2)]
    for i, p in enumerate(imgs):
        gb.make_image(p, 20 + i, size=256)
    reqs = gb.fidelity_requests(args.text_requests)
    req_images = [[] for _ in reqs]
    for k in range(args.image_requests):
        paths = imgs[: 1 + k % 2]
        reqs.append(image_request(5000 + k, paths))
        req_images.append(paths)
    req_path = work / "fidelity_fp8.jsonl"
    req_path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    n_cand = {(i, f): n for i, r in enumerate(reqs) for f, n in enumerate(gb.field_candidates(r))}

    # Ours.
    ours = {}
    legs = [("fp8", "fp8"), ("bf16", "none")] if args.device == "cuda" else [("fp8", None), ("bf16", None)]
    for name, q in legs:
        path = work / f"ours_{name}.jsonl"
        cmd = [args.bin, "decide", "--model", model, "--adapter", adapter, "--device", args.device, "--rotations", "4",
               "--request", req_path, "--out", work / f"ours_{name}_resp.jsonl", "--emit-passes", path]
        if q:
            cmd += ["--quantize", q]
        t = time.perf_counter()
        gb.run(cmd)
        timings[f"ours_{name}_s"] = time.perf_counter() - t
        key = lambda p: (p["request"], p["field"], p["pass"])
        ours[name] = sorted((json.loads(l) for l in open(path)), key=key)
    passes = ours["bf16"]
    assert [p["input_ids"] for p in passes] == [p["input_ids"] for p in ours["fp8"]], "the two runs planned differently"
    for p in passes:
        p["n"] = n_cand[(p["request"], p["field"])]
        p["images"] = req_images[p["request"]]
    logits = {f"ours_{k}": [p["logits"][: n_cand[(p["request"], p["field"])]] for p in v] for k, v in ours.items()}
    floor_passes = [p for p in passes if p["request"] < args.floor_requests]

    # transformers: bf16, fp32 (floor subset), fp8 emulated.
    dev = args.device
    check = {}
    for variant, dtype, subset in (("bf16", torch.bfloat16, passes), ("fp32", torch.float32, floor_passes),
                                   ("fp8", torch.bfloat16, passes)):
        t = time.perf_counter()
        peer = Peer(model, adapter, dtype, dev, fp8=variant == "fp8")
        if variant == "fp8":
            check["fp8_emulated_modules"] = len(peer.fp8_modules)
        if variant == "bf16":
            probe = passes[:4] + [p for p in passes if p["images"]][:3]
            check["batching_max_abs_dlogit_bf16"] = peer.batching_check(probe)
        logits[f"tf_{variant}"] = peer.run(subset, args.batch_tokens, args.batch_rows)
        timings[f"transformers_{variant}_s"] = time.perf_counter() - t
        print(f"transformers {variant}: {len(subset)} passes in {timings[f'transformers_{variant}_s']:.1f} s", file=sys.stderr, flush=True)
        del peer
        if dev == "cuda":
            torch.cuda.empty_cache()

    q = {k: decisions(passes if len(v) == len(passes) else floor_passes, v) for k, v in logits.items()}
    nf = len(q["tf_fp32"])
    pairs = {
        "floor: transformers bf16 vs fp32": compare(q["tf_bf16"][:nf], q["tf_fp32"]),
        "bar: ours fp8 vs transformers fp8-emulated": compare(q["ours_fp8"], q["tf_fp8"]),
        "ours fp8 vs transformers bf16": compare(q["ours_fp8"], q["tf_bf16"]),
        "ours bf16 vs transformers bf16": compare(q["ours_bf16"], q["tf_bf16"]),
        "transformers fp8-emulated vs bf16": compare(q["tf_fp8"], q["tf_bf16"]),
    }
    bar = pairs["bar: ours fp8 vs transformers fp8-emulated"]["combined"]
    timings["total_s"] = time.perf_counter() - t0
    result = {
        "profile": "trained-like",
        "config": args.config,
        "device": args.device,
        "dry_run": args.device != "cuda",
        "note": ("CPU dry run: no FP8 path on the CPU, 'ours fp8' is our f32 CPU engine" if args.device != "cuda" else
                 "decisions = questions with 4 rotations combined as imajev combines them; per_pass = one decision "
                 "per option order; |Δp| over all candidates incl. unknown; same token ids and image files on "
                 "both sides"),
        "requests": {"text": args.text_requests, "with_images": args.image_requests, "passes": len(passes),
                     "decisions": len(q["ours_bf16"]), "floor_decisions": nf},
        "bar": {**BAR, "met": bar["top_agreement"] >= BAR["top_agreement_min"] and bar["median_abs_dp"] <= BAR["median_abs_dp_max"]},
        "pairs": pairs,
        "decision_peakedness_transformers_bf16": peakedness(q["tf_bf16"]),
        "checks": check,
        "versions": f"torch {torch.__version__} transformers {transformers.__version__} peft {peft.__version__}",
        "timings_s": timings,
    }
    (out / "fidelity_fp8.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("bar", "requests", "decision_peakedness_transformers_bf16", "timings_s")}, indent=1))
    for k, v in pairs.items():
        c = v["combined"]
        print(f"{k:<46} top {c['top_agreement']:.4f}  median|Δp| {c['median_abs_dp']:.2e}  p99 {c['p99_abs_dp']:.2e}")


if __name__ == "__main__":
    main()
