#!/usr/bin/env python3
"""The FP8 bar of issue 12 on a trained-like checkpoint: is our FP8 path its recipe, within noise?

    source bench/device_env.sh
    python3 bench/fidelity_fp8.py --bin .gpu/imajev-serve --work /tmp/fid --out $OUT --budget 420
    # next call, with the first call's $OUT/parts carried as P:
    python3 bench/fidelity_fp8.py --bin .gpu/imajev-serve --work /tmp/fid --out $OUT --budget 420 --resume P

Two H200 calls (torch 2.11, transformers 5.17, peft; no network): the whole run does not fit the
time of one, so each call runs the phases below in order until --budget, skipping what the parts
already hold and resuming a transformers phase where it stopped; the parts (OUT/parts, 4 small
files) carry the plan and every leg's per-pass logits to the next call, and every call prints how
long each phase still needs at the rates it measured. The checkpoint is rebuilt in each call
(synth is deterministic; a fingerprint in the parts catches a different one). Steps:
1. `synth --profile trained-like` writes the Qwen3.5-4B shapes (BF16, seed 0) and an imajev-style
   adapter (LoRA r64/α128, 256-row readout): decisions follow the options' content, so the
   combined answer is peaked (how much: src/synth/profile.rs's module doc; printed after `ours`).
2. Requests: --text-requests text requests of 3 questions (bench/gpu_bench.py's fidelity set)
   and --image-requests requests with one or two 256×256 images (64 visual tokens each; 256 is
   a multiple of 32, so neither side resamples and the pixels are identical), 4 rotations:
   ≥ 1,000 decisions with the defaults.
3. Ours: `decide --device cuda --rotations 4` with `--quantize fp8` and with `--quantize none`,
   writing every pass's token ids and readout logits.
4. transformers + PEFT on the same token ids (and image files), batched (passes right-padded;
   causal attention and the causal DeltaNet make a row's last real token independent of the
   padding after it; checked on 7 passes, 3 with images, against one-at-a-time runs,
   `batching_max_abs_dlogit_bf16`):
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
Writes OUT/fidelity_fp8.json (once every leg is complete): the object for
bench/results/h200.json's `fidelity`.

`--device cpu` is a dry run of the plumbing on a small config (`--config mid`): there is no FP8
path on the CPU, so "ours fp8" is then our CPU engine (f32) and the JSON says so.
"""
import argparse
import hashlib
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
        # Straight onto the device (no host copy of the 8 GB checkpoint, no host-side fp32 cast);
        # transformers wants accelerate for a device_map (peft depends on it), else via the host.
        import importlib.util
        kw = {"device_map": device} if device == "cuda" and importlib.util.find_spec("accelerate") else {}
        m = Qwen3_5ForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype, **kw).to(device).eval()
        self.fp8_modules = emulate_fp8(m) if fp8 else []
        self.model = PeftModel.from_pretrained(m, str(adapter_dir)).eval()
        self.core = self.model.base_model.model.model
        self.readout = load_file(str(Path(adapter_dir) / "decision_readout.safetensors"))["weight"].float().to(device)
        cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        self.proc = Qwen2VLImageProcessor(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})
        self.pixels = {}
        self.forwards, self.tokens = 0, 0
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
            logits = (last @ self.readout.T).cpu()
        self.forwards += 1
        self.tokens += len(rows) * width
        return [logits[i, :n].tolist() for i, (_, n) in enumerate(rows)]

    def batches(self, passes, max_tokens, max_rows):
        """passes: dicts with input_ids, n, images → [(indices, rows, images)]: passes that share
        their image files, sorted by length and cut so that a forward holds at most max_rows rows
        and max_tokens padded tokens."""
        out, groups = [], {}
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
                out.append(([r[2] for r in rows[i:j]], [(r[0], r[1]) for r in rows[i:j]], list(images)))
                i = j
        return out

    def run(self, passes, max_tokens, max_rows):
        """passes: dicts with input_ids, n, images → logits per pass, in order."""
        out = [None] * len(passes)
        for ks, rows, images in self.batches(passes, max_tokens, max_rows):
            for k, l in zip(ks, self.forward_rows(rows, images)):
                out[k] = l
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
    """How decided the combined decisions are: top probability quantiles, the share below 0.6,
    near-ties (top two within 0.1 of each other), and how often all rotations pick one option."""
    tops, ties, agree = [], 0, 0
    for q in qs:
        p = sorted(gb.combine(q), reverse=True)
        tops.append(p[0])
        ties += p[0] - p[1] < 0.1
        n = len(q[0][1])
        picks = {(argmax(gb.combine([(0, l)])) + off) % n for off, l in q}
        agree += len(picks) == 1
    return {"decisions": len(qs), "median_top_p": statistics.median(tops), "p10_top_p": gb.pct(tops, 0.1),
            "p90_top_p": gb.pct(tops, 0.9), "share_top_p_below_0.6": sum(t < 0.6 for t in tops) / len(tops),
            "share_top_p_above_0.95": sum(t > 0.95 for t in tops) / len(tops),
            "share_near_ties": ties / len(qs), "rotations_pick_the_same_option": agree / len(qs)}


# ---------------------------------------------------------------- parts: what one call hands the next

PHASES = ("synth", "ours", "bf16", "fp32", "fp8", "compare")
VARIANTS = ("bf16", "fp32", "fp8")
LEGS = ("ours_fp8", "ours_bf16") + tuple(f"tf_{v}" for v in VARIANTS)
# Seconds between saves of a running transformers phase (a call killed at its limit loses at most that).
SAVE_EVERY_S = 15.0


def deltanet_path():
    """Which chunked DeltaNet transformers runs: flash-linear-attention's kernel when it was
    importable when transformers was imported (bench/device_env.sh puts the carried wheel on
    PYTHONPATH), else transformers' torch reference (fp32 chunked delta rule, much slower)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq
    stack, seen = [mq.torch_chunk_gated_delta_rule], set()
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        mod = getattr(f, "__module__", "") or ""
        if mod.split(".")[0] == "fla":
            return f"flash-linear-attention ({mod}.{getattr(f, '__name__', '?')})"
        for c in getattr(f, "__closure__", None) or ():
            try:
                v = c.cell_contents
            except ValueError:
                continue
            if callable(v):
                stack.append(v)
        if getattr(f, "__wrapped__", None) is not None:
            stack.append(f.__wrapped__)
    return "transformers torch reference (torch_chunk_gated_delta_rule, fp32 chunks of 64)"


def synth_cmd(args, model, adapter):
    return ["synth", "--config", args.config, "--profile", "trained-like", "--dtype", "bf16", "--seed", str(args.seed),
            "--out", str(model), "--adapter-out", str(adapter), "--lora-rank", str(args.lora_rank),
            "--lora-alpha", str(args.lora_alpha), "--readout-rows", "256"]


def fingerprint(model, adapter):
    """sha256 of what pins a synthetic checkpoint cheaply: config, LoRA config, readout (which the
    trained-like profile computes from the weights), and every file's name and size."""
    h = hashlib.sha256()
    for f in (model / "config.json", adapter / "adapter_config.json", adapter / "decision_readout.safetensors"):
        h.update(f.read_bytes())
    for d in (model, adapter):
        for f in sorted(d.iterdir()):
            h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()


def write_json(path, obj):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


class Parts:
    """What the calls hand each other, in the --parts folder (4 files, < 10 MB with the defaults):
    plan.json (the requests' passes: request, field, rotation offset, candidates, images),
    passes.npz (every pass's token ids), logits.npz (one float32 matrix per leg, a row per pass,
    NaN where that leg has not run the pass yet: a phase cut short resumes where it stopped) and
    info.json (per phase: seconds, rates, versions, checks)."""

    def __init__(self, folder):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        f = self.dir / "info.json"
        self.info = json.loads(f.read_text()) if f.exists() else {}
        self.plan, self.passes, self.logits = None, None, {}
        if (self.dir / "plan.json").exists():
            import numpy as np
            self.plan = json.loads((self.dir / "plan.json").read_text())
            self.passes = self.plan["passes"]
            z = np.load(self.dir / "passes.npz")
            ends, flat = np.cumsum(z["lens"]).tolist(), z["ids"].tolist()
            for p, e, n in zip(self.passes, ends, z["lens"].tolist()):
                p["input_ids"] = flat[e - n: e]
            if (self.dir / "logits.npz").exists():
                z = np.load(self.dir / "logits.npz")
                self.logits = {k: z[k].copy() for k in z.files}

    def save_info(self):
        write_json(self.dir / "info.json", self.info)

    def save_plan(self, plan):
        import numpy as np
        ids = [p.pop("input_ids") for p in plan["passes"]]
        np.savez_compressed(self.dir / "passes.npz", ids=np.array([t for r in ids for t in r], dtype=np.int32),
                            lens=np.array([len(r) for r in ids], dtype=np.int32))
        write_json(self.dir / "plan.json", plan)
        for p, r in zip(plan["passes"], ids):
            p["input_ids"] = r
        self.plan, self.passes, self.logits = plan, plan["passes"], {}

    def save_logits(self):
        import numpy as np
        tmp = self.dir / "logits.tmp.npz"
        np.savez_compressed(tmp, **self.logits)
        tmp.replace(self.dir / "logits.npz")

    def leg(self, name):
        """The leg's matrix (created all-NaN on first use)."""
        import numpy as np
        if name not in self.logits:
            width = max(p["n"] for p in self.passes)
            self.logits[name] = np.full((len(self.passes), width), np.nan, dtype=np.float32)
        return self.logits[name]

    def done(self, name):
        """Which passes the leg has run (bool per pass)."""
        import numpy as np
        if name not in self.logits:
            return np.zeros(len(self.passes), dtype=bool)
        return ~np.isnan(self.logits[name][:, 0])

    def rows(self, name, subset):
        m = self.logits[name]
        return [[float(v) for v in m[k, : self.passes[k]["n"]]] for k in subset]


def images(work):
    """The two 256×256 photo-like PNGs (deterministic: every call writes the same bytes)."""
    paths = [work / f"fid{i}.png" for i in range(2)]
    for i, p in enumerate(paths):
        if not p.exists():
            gb.make_image(p, 20 + i, size=256)
    return paths


def image_request(seed, paths):
    r = gb.fidelity_requests(1, seed=seed)[0]
    r["images"] = [gb.data_url(p) for p in paths]
    return r


def subset_of(parts, variant, floor_requests):
    """Pass indices a transformers variant runs: all, or the floor requests' for fp32."""
    return [k for k, p in enumerate(parts.passes) if variant != "fp32" or p["request"] < floor_requests]


def padded_tokens(parts, ks):
    """Tokens of the passes ks with each image's pads expanded (64 per 256×256 image): what a
    transformers forward processes, before the (small) padding of a batch to its longest row."""
    return sum(len(parts.passes[k]["input_ids"]) + 63 * len(parts.passes[k]["images"]) for k in ks)


def estimates(parts, floor_requests):
    """Seconds each transformers variant still needs, from the rates measured so far."""
    out = {}
    for v in VARIANTS:
        ks = subset_of(parts, v, floor_requests)
        done = parts.done(f"tf_{v}")
        left = [k for k in ks if not done[k]]
        if not left:
            out[v] = {"left_passes": 0, "seconds": 0.0, "from": "done"}
            continue
        own = parts.info.get(f"tf_{v}", {})
        rate, load, src = own.get("tokens_per_s"), own.get("load_s"), f"{v}'s measured rate"
        if not rate:
            b = parts.info.get("tf_bf16", {})
            rate, load = b.get("tokens_per_s"), b.get("load_s")
            src = ("bf16's rate (a lower bound: its GEMMs are fp32, bf16's are not)" if v != "bf16" else "")
        tokens = padded_tokens(parts, left)
        out[v] = {"left_passes": len(left), "left_tokens": tokens,
                  "seconds": (load or 0) + tokens / rate if rate else None, "from": src or "no rate measured yet"}
    return out


def print_estimates(parts, floor_requests):
    if parts.passes is None:
        return
    lines = []
    for k in ("synth", "ours"):
        if k in parts.info:
            lines.append(f"  {k}: {parts.info[k]['seconds']:.0f} s (measured, every call that needs the checkpoint "
                         f"reruns synth)" if k == "synth" else f"  {k}: {parts.info[k]['seconds']:.0f} s (measured)")
    for v, e in estimates(parts, floor_requests).items():
        if e["left_passes"] == 0:
            lines.append(f"  {v}: done")
        elif e["seconds"] is None:
            lines.append(f"  {v}: {e['left_passes']} passes ({e['left_tokens']} tokens) left; no rate measured yet")
        else:
            lines.append(f"  {v}: {e['left_passes']} passes ({e['left_tokens']} tokens) left, ~{e['seconds']:.0f} s "
                         f"incl. loading, at {e['from']}")
    print("estimates:\n" + "\n".join(lines), file=sys.stderr, flush=True)


# ---------------------------------------------------------------- phases


def phase_synth(args, model, adapter, parts):
    t = time.perf_counter()
    gb.run([args.bin] + synth_cmd(args, model, adapter))
    parts.info["synth"] = {"seconds": time.perf_counter() - t}
    parts.save_info()


def build_requests(args, work):
    """The requests every leg runs, written to work/fidelity_fp8.jsonl: --text-requests text
    requests, then --image-requests with one or two images. Returns (path, requests, the image
    indices of each request)."""
    imgs = images(work)
    reqs = gb.fidelity_requests(args.text_requests)
    req_images = [[] for _ in reqs]
    for k in range(args.image_requests):
        idx = list(range(1 + k % 2))
        reqs.append(image_request(5000 + k, [imgs[i] for i in idx]))
        req_images.append(idx)
    req_path = work / "fidelity_fp8.jsonl"
    req_path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return req_path, reqs, req_images


def run_ours(args, work, model, adapter, req_path, name, quantize, env=None):
    """One `decide` over the requests (quantize: "fp8", "none" or None for the CPU's only path;
    env: extra environment variables); returns (every pass it emitted, sorted by request, field
    and pass; seconds)."""
    path = work / f"ours_{name}.jsonl"
    cmd = [args.bin, "decide", "--model", model, "--adapter", adapter, "--device", args.device, "--rotations", "4",
           "--request", req_path, "--out", work / f"ours_{name}_resp.jsonl", "--emit-passes", path]
    if quantize:
        cmd += ["--quantize", quantize]
    t = time.perf_counter()
    gb.run(cmd, env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - t
    key = lambda p: (p["request"], p["field"], p["pass"])
    return sorted((json.loads(l) for l in open(path)), key=key), seconds


def phase_ours(args, work, model, adapter, parts, fp):
    """Both of our legs on the same requests; records the plan (every pass's token ids) that the
    transformers phases run, in this call or a later one."""
    import numpy as np
    req_path, reqs, req_images = build_requests(args, work)
    n_cand = {(i, f): n for i, r in enumerate(reqs) for f, n in enumerate(gb.field_candidates(r))}
    timings, ours = {}, {}
    # On the CPU there is no FP8 path: one f32 run stands for both legs.
    legs = [("fp8", "fp8"), ("bf16", "none")] if args.device == "cuda" else [("bf16", None)]
    for name, q in legs:
        ours[name], timings[f"ours_{name}_s"] = run_ours(args, work, model, adapter, req_path, name, q)
    ours.setdefault("fp8", ours["bf16"])
    passes = ours["bf16"]
    assert [p["input_ids"] for p in passes] == [p["input_ids"] for p in ours["fp8"]], "the two runs planned differently"
    plan = {"config": args.config, "device": args.device, "seed": args.seed, "fingerprint": fp,
            "text_requests": args.text_requests, "image_requests": args.image_requests,
            "decisions": len({(p["request"], p["field"]) for p in passes}),
            "passes": [{"request": p["request"], "field": p["field"], "pass": p["pass"], "offset": p["offset"],
                        "n": n_cand[(p["request"], p["field"])], "images": req_images[p["request"]],
                        "input_ids": p["input_ids"]} for p in passes]}
    parts.save_plan(plan)
    for name, v in ours.items():
        m = parts.leg(f"ours_{name}")
        for k, (p, q) in enumerate(zip(v, plan["passes"])):
            m[k, : q["n"]] = np.asarray(p["logits"][: q["n"]], dtype=np.float32)
    parts.save_logits()
    parts.info = {k: v for k, v in parts.info.items() if k == "synth"}
    q = decisions(parts.passes, parts.rows("ours_bf16", range(len(parts.passes))))
    parts.info["ours"] = {"seconds": sum(timings.values()), **timings, "passes": len(passes),
                          "tokens": padded_tokens(parts, range(len(passes))),
                          "decision_peakedness_ours_bf16": peakedness(q)}
    parts.save_info()
    print("ours bf16 decisions: " + json.dumps(parts.info["ours"]["decision_peakedness_ours_bf16"]),
          file=sys.stderr, flush=True)


def phase_transformers(args, work, model, adapter, parts, variant, t0):
    """transformers on the passes this variant has not run yet, saving every SAVE_EVERY_S and
    stopping before a batch that would end past --budget (the next call resumes)."""
    import numpy as np
    import torch
    import transformers
    import peft
    # fp32 means fp32: no TF32 in the floor's GEMMs or in the fp8 emulation's.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = f"tf_{variant}"
    imgs = images(work)
    passes = [{**p, "images": [imgs[i] for i in p["images"]]} for p in parts.passes]
    done = parts.done(name)
    todo = [k for k in subset_of(parts, variant, args.floor_requests) if not done[k]]
    info = parts.info.setdefault(name, {})
    t = time.perf_counter()
    dtype = torch.float32 if variant == "fp32" else torch.bfloat16
    peer = Peer(model, adapter, dtype, args.device, fp8=variant == "fp8")
    info.update({"load_s": peer.load_s, "deltanet": deltanet_path(), "passes": len(subset_of(parts, variant, args.floor_requests)),
                 "versions": f"torch {torch.__version__} transformers {transformers.__version__} peft {peft.__version__}"})
    if variant == "fp8":
        info["fp8_emulated_modules"] = len(peer.fp8_modules)
    if variant == "fp32":
        info["floor_requests"] = args.floor_requests
    if variant == "bf16" and "batching_max_abs_dlogit" not in info:
        probe = passes[:4] + [p for p in passes if p["images"]][:3]
        c = time.perf_counter()
        info["batching_max_abs_dlogit"] = peer.batching_check(probe)
        info["batching_check_s"] = time.perf_counter() - c
    m = parts.leg(name)
    batches = peer.batches([passes[k] for k in todo], args.batch_tokens, args.batch_rows)
    ran, saved, stopped = 0, time.perf_counter(), False
    for key in ("forward_s", "tokens", "forwards", "seconds"):
        info.setdefault(key, 0)
    fwd0, tok0, sec0 = info["forward_s"], info["tokens"], info["seconds"]

    def record():
        info["tokens_per_s"] = info["tokens"] / info["forward_s"] if info["forward_s"] else None
        info["seconds"] = sec0 + time.perf_counter() - t
        info["complete"] = bool(parts.done(name)[subset_of(parts, variant, args.floor_requests)].all())
        parts.save_logits()
        parts.save_info()

    for ks, rows, imgs_b in batches:
        width = max(len(r[0]) for r in rows)
        rate = info["tokens"] / info["forward_s"] if info["forward_s"] else None
        if args.budget and rate and time.perf_counter() - t0 + len(rows) * width / rate > args.budget:
            stopped = True
            break
        c = time.perf_counter()
        for k, l in zip(ks, peer.forward_rows(rows, imgs_b)):
            m[todo[k], : len(l)] = np.asarray(l, dtype=np.float32)
        info["forward_s"] += time.perf_counter() - c
        info["tokens"] += len(rows) * width
        info["forwards"] += 1
        ran += len(ks)
        if time.perf_counter() - saved > SAVE_EVERY_S:
            record()
            saved = time.perf_counter()
    record()
    fwd_s, tokens = info["forward_s"] - fwd0, info["tokens"] - tok0
    print(f"transformers {variant}: {ran} of {len(todo)} remaining passes in {time.perf_counter() - t:.1f} s "
          f"(load {peer.load_s:.1f} s, {tokens} padded tokens in {fwd_s:.1f} s"
          f"{f', {tokens / fwd_s:.0f} tokens/s' if fwd_s else ''}; DeltaNet: {info['deltanet']})"
          + ("; stopped at --budget, the next call resumes" if stopped else ""), file=sys.stderr, flush=True)
    del peer
    if args.device == "cuda":
        torch.cuda.empty_cache()


def phase_compare(parts, out):
    """The pairs, from the parts alone (numpy, no torch: it can run on any machine)."""
    info = parts.info
    all_k = range(len(parts.passes))
    floor_k = subset_of(parts, "fp32", info["tf_fp32"]["floor_requests"])
    legs = {k: parts.rows(k, floor_k if k == "tf_fp32" else all_k) for k in LEGS}
    for k, v in legs.items():
        if any(math.isnan(x) for row in v for x in row):
            sys.exit(f"fidelity_fp8: {k} has passes that did not run (another --floor-requests between calls?)")
    floor_passes = [parts.passes[k] for k in floor_k]
    q = {k: decisions(floor_passes if k == "tf_fp32" else parts.passes, v) for k, v in legs.items()}
    qf = {k: decisions(floor_passes, parts.rows(k, floor_k)) for k in ("ours_fp8", "ours_bf16", "tf_bf16", "tf_fp8")}
    pairs = {
        "bar: ours fp8 vs transformers fp8-emulated": compare(q["ours_fp8"], q["tf_fp8"]),
        "floor: transformers bf16 vs fp32": compare(qf["tf_bf16"], q["tf_fp32"]),
        "ours fp8 vs transformers bf16": compare(q["ours_fp8"], q["tf_bf16"]),
        "ours bf16 vs transformers bf16": compare(q["ours_bf16"], q["tf_bf16"]),
        "ours bf16 vs transformers fp32 (floor requests)": compare(qf["ours_bf16"], q["tf_fp32"]),
        "transformers fp8-emulated vs bf16": compare(q["tf_fp8"], q["tf_bf16"]),
    }
    bar = pairs["bar: ours fp8 vs transformers fp8-emulated"]["combined"]
    plan = parts.plan
    cuda = plan["device"] == "cuda"
    timings = {k: {f: info[k][f] for f in ("seconds", "load_s", "forward_s", "forwards", "tokens", "tokens_per_s")
                   if f in info[k]} for k in ("synth", "ours") + tuple(f"tf_{v}" for v in VARIANTS) if k in info}
    result = {
        "profile": "trained-like",
        "config": plan["config"],
        "device": plan["device"],
        "dry_run": not cuda,
        "note": ("decisions = questions with 4 rotations combined as imajev combines them; per_pass = one decision "
                 "per option order; |Δp| over all candidates incl. unknown; same token ids and image files on "
                 "both sides" if cuda else
                 "CPU dry run: no FP8 path on the CPU, 'ours fp8' and 'ours bf16' are both our f32 CPU engine"),
        "requests": {"text": plan["text_requests"], "with_images": plan["image_requests"], "passes": len(parts.passes),
                     "decisions": len(q["ours_bf16"]), "floor_decisions": len(q["tf_fp32"])},
        "bar": {**BAR, "met": bar["top_agreement"] >= BAR["top_agreement_min"] and bar["median_abs_dp"] <= BAR["median_abs_dp_max"]},
        "pairs": pairs,
        "decision_peakedness_transformers_bf16": peakedness(q["tf_bf16"]),
        "decision_peakedness_ours_bf16": peakedness(q["ours_bf16"]),
        "checks": {"batching_max_abs_dlogit_bf16": info["tf_bf16"].get("batching_max_abs_dlogit"),
                   "fp8_emulated_modules": info["tf_fp8"].get("fp8_emulated_modules"),
                   "deltanet": {v: info[f"tf_{v}"]["deltanet"] for v in VARIANTS}},
        "checkpoint_fingerprint": plan["fingerprint"],
        "versions": info["tf_bf16"]["versions"],
        "timings_s": timings,
    }
    write_json(out / "fidelity_fp8.json", result)
    print(json.dumps({k: result[k] for k in ("bar", "requests", "decision_peakedness_transformers_bf16")}, indent=1))
    for k, v in pairs.items():
        c = v["combined"]
        print(f"{k:<48} top {c['top_agreement']:.4f}  median|Δp| {c['median_abs_dp']:.2e}  p99 {c['p99_abs_dp']:.2e}")


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", help="imajev-serve (needed while synth or ours has work)")
    ap.add_argument("--work", required=True, help="checkpoint, requests, images (not kept between calls)")
    ap.add_argument("--out", required=True, help="where compare writes fidelity_fp8.json")
    ap.add_argument("--parts", help="what each call hands the next (default OUT/parts; carry it into the next call "
                    "and pass it again, or copy it to OUT/parts)")
    ap.add_argument("--resume", help="parts a previous call returned (copied into --parts first, which must not "
                    "hold a run yet); an error if the folder has no plan.json")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help=f"comma-separated subset of {','.join(PHASES)} (default: all; a phase whose results are "
                    "in --parts is skipped, a partial transformers phase resumes)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds for this call: no transformers phase starts a batch that would end later "
                    "(0: no limit); what is left is for the next call")
    ap.add_argument("--estimate", action="store_true", help="print the estimates from --parts and exit")
    ap.add_argument("--config", default="qwen3.5-4b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-requests", type=int, default=312)
    ap.add_argument("--image-requests", type=int, default=24, help="half with one image, half with two")
    ap.add_argument("--floor-requests", type=int, default=70, help="requests (3 decisions each) for bf16 vs fp32")
    ap.add_argument("--batch-tokens", type=int, default=32768, help="padded tokens per transformers forward")
    ap.add_argument("--batch-rows", type=int, default=128, help="passes per transformers forward")
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--lora-alpha", type=float, default=128)
    args = ap.parse_args()
    t0 = time.perf_counter()
    phases = [p for p in args.phases.split(",") if p]
    bad = [p for p in phases if p not in PHASES]
    if bad:
        ap.error(f"--phases: unknown {bad}; choose from {','.join(PHASES)}")
    work, out = Path(args.work), Path(args.out)
    for d in (work, out):
        d.mkdir(parents=True, exist_ok=True)
    parts = Parts(args.parts or out / "parts")
    if args.resume:
        src = Path(args.resume)
        if not (src / "plan.json").exists():
            sys.exit(f"fidelity_fp8: --resume {src} holds no plan.json (was the previous call's parts folder carried?)")
        if parts.plan is not None:
            sys.exit(f"fidelity_fp8: --resume: {parts.dir} already holds a run")
        import shutil
        for f in ("plan.json", "passes.npz", "logits.npz", "info.json"):
            if (src / f).exists():
                shutil.copyfile(src / f, parts.dir / f)
        parts = Parts(parts.dir)
    if args.estimate:
        print_estimates(parts, args.floor_requests)
        return
    model, adapter = work / f"model-{args.config}-tl", work / f"adapter-{args.config}-tl"
    if parts.plan is not None and (parts.plan["config"], parts.plan["device"], parts.plan["seed"]) != (args.config, args.device, args.seed):
        sys.exit(f"fidelity_fp8: {parts.dir} holds a run of --config {parts.plan['config']} --device "
                 f"{parts.plan['device']} --seed {parts.plan['seed']}: pass those, or another --parts")

    def has_work(phase):
        if phase == "ours":
            return parts.plan is None
        if phase in VARIANTS:
            if parts.plan is None:
                return True
            done = parts.done(f"tf_{phase}")
            return not all(done[k] for k in subset_of(parts, phase, args.floor_requests))
        return phase == "compare"

    model_work = [p for p in phases if p in ("ours",) + VARIANTS and has_work(p)]
    ran = {}
    fp = None
    if model_work:
        if not (model / "config.json").exists():
            if "synth" not in phases:
                ap.error(f"{','.join(model_work)} need the checkpoint in --work: add synth")
            if not args.bin:
                ap.error("--bin is needed by synth")
            t = time.perf_counter()
            phase_synth(args, model, adapter, parts)
            ran["synth"] = time.perf_counter() - t
        fp = fingerprint(model, adapter)
        if parts.plan is not None and parts.plan["fingerprint"] != fp:
            sys.exit("fidelity_fp8: this call's checkpoint is not the one the parts were made with (a changed synth, "
                     "or other --lora-*): start from an empty --parts")
    for phase in phases:
        if phase == "synth" or not has_work(phase):
            continue
        if phase != "compare" and not model_work:
            continue
        t = time.perf_counter()
        if phase == "ours":
            if not args.bin:
                ap.error("--bin is needed by ours")
            phase_ours(args, work, model, adapter, parts, fp)
        elif phase in VARIANTS:
            if parts.plan is None:
                sys.exit(f"fidelity_fp8: phase {phase} needs the plan of the 'ours' phase in {parts.dir}")
            e = estimates(parts, args.floor_requests)[phase]
            load = parts.info.get(f"tf_{phase}", {}).get("load_s") or parts.info.get("tf_bf16", {}).get("load_s")
            if args.budget and load and time.perf_counter() - t0 + 2 * load > args.budget:
                print(f"phase {phase}: not started, {args.budget - (time.perf_counter() - t0):.0f} s of --budget left "
                      f"(loading alone takes ~{load:.0f} s)", file=sys.stderr, flush=True)
                continue
            phase_transformers(args, work, model, adapter, parts, phase, t0)
        else:
            missing = [v for v in VARIANTS if has_work(v)] if parts.plan is not None else ["ours"]
            if missing:
                print(f"compare: waiting for {','.join(missing)} (run the same command again with these --parts)",
                      file=sys.stderr, flush=True)
                continue
            phase_compare(parts, out)
        ran[phase] = time.perf_counter() - t
        print(f"phase {phase}: {ran[phase]:.1f} s", file=sys.stderr, flush=True)
    print_estimates(parts, args.floor_requests)
    print("this call: " + ", ".join(f"{k} {v:.1f} s" for k, v in ran.items()) +
          f"; total {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
