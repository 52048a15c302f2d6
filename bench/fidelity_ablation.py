#!/usr/bin/env python3
"""Where does the FP8-vs-BF16 difference come from? One device run, same token ids throughout:

    ours FP8 (--quantize fp8), ours BF16 (--quantize none), transformers+PEFT bf16 and fp32, and
    two emulations of the FP8 recipe inside transformers (qwen35.md §7.3):
      peer_w8   — every projection we store as FP8 gets RTN 128x128 E4M3 weights, bf16 compute;
      peer_w8a8 — the same plus per-token 1x128 E4M3 activation quantisation, GEMM in fp32
                  (what a block-FP8 GEMM computes, without any kernel's accumulation order).

Every pair is compared per pass (one decision per option order): top agreement and |Δp|. The
fp32 transformers run is the reference; "peer bf16 vs peer fp32" is the noise floor of bf16
itself on these random weights; "peer_w8 vs peer_bfloat16" is what the FP8 weights alone cost,
which no FP8 server can avoid; "ours_fp8 vs peer_w8a8" is our kernels against the recipe.
Optionally records a kernel profile (IMAJEV_PROFILE=kernels) of the 256-token request.
Writes OUT/ablation.json.

    python3 bench/fidelity_ablation.py --bin .gpu/imajev-serve --work /tmp/bench --out $OUT
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # noqa: E402


def compare(a, b):
    agree, dps = 0, []
    for x, y in zip(a, b):
        n = len(x)
        px, py = gb.combine([(0, x)]), gb.combine([(0, y)])
        agree += max(range(n), key=lambda j: px[j]) == max(range(n), key=lambda j: py[j])
        dps += [abs(u - v) for u, v in zip(px, py)]
    return {"decisions": len(a), "top_agreement": agree / len(a), "median_abs_dp": statistics.median(dps),
            "p99_abs_dp": gb.pct(dps, 0.99), "max_abs_dp": max(dps)}


def rtn_fp8_blocks(w):
    """RTN 128x128 E4M3 with s = 448 / max|block| (qwen35.md §7.1), dequantised back, in fp32."""
    import torch
    o, i = w.shape
    x = w.float().reshape(o // 128, 128, i // 128, 128)
    amax = x.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    q = (x * s).to(torch.float8_e4m3fn).float()
    return (q / s).reshape(o, i)


def quant_act_1x128(x):
    """Per-token, per-128-column E4M3 with s_a = max|x| / 448 (qwen35.md §7.3), dequantised, fp32."""
    import torch
    sh = x.shape
    g = x.float().reshape(*sh[:-1], sh[-1] // 128, 128)
    sa = g.abs().amax(dim=-1, keepdim=True) / 448.0
    q = torch.where(sa > 0, g / torch.where(sa > 0, sa, torch.ones_like(sa)), torch.zeros_like(g))
    return (q.to(torch.float8_e4m3fn).float() * sa).reshape(sh)


FP8_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "in_proj_qkv", "in_proj_z", "out_proj")


def emulate_fp8(model, activations):
    """The projections our loader stores as block FP8 (text decoder, dims multiples of 128)."""
    import torch
    n = 0
    for name, mod in model.model.language_model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name.split(".")[-1] not in FP8_MODULES:
            continue
        o, i = mod.weight.shape
        if o % 128 or i % 128:
            continue
        wq = rtn_fp8_blocks(mod.weight.data)
        mod.weight.data = wq.to(mod.weight.dtype)
        if activations:
            w32 = wq.to("cuda")

            def fwd(x, w32=w32, bias=mod.bias):
                y = torch.nn.functional.linear(quant_act_1x128(x), w32)
                return (y if bias is None else y + bias.float()).to(x.dtype)
            mod.forward = fwd
        n += 1
    print(f"emulated FP8 on {n} projections (activations: {activations})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=70)
    ap.add_argument("--profile", default="", help="IMAJEV_PROFILE value for a profile of the 256-token request")
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    model, adapter = work / "model", work / "adapter"
    if not (model / "config.json").exists():
        gb.run([args.bin, "synth", "--config", "qwen3.5-4b", "--dtype", "bf16", "--seed", "0", "--out", model,
                "--adapter-out", adapter, "--lora-rank", "64", "--lora-alpha", "128", "--readout-rows", "256"])
    fid = work / "fidelity.jsonl"
    reqs = gb.fidelity_requests(args.requests)
    fid.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    common = [args.bin, "decide", "--model", model, "--adapter", adapter, "--device", "cuda", "--rotations", "4"]
    passes = {}
    for q in ("fp8", "none"):
        path = work / f"abl_{q}.jsonl"
        gb.run(common + ["--quantize", q, "--request", fid, "--out", work / f"abl_{q}_resp.jsonl", "--emit-passes", path])
        passes[q] = [json.loads(l) for l in open(path)]
    # Stage profile of the 256-token, 3-question, 4-rotation request.
    bench_req = work / "one256.jsonl"
    gb.make_image(work / "img0.png", 0)
    bench_req.write_text(json.dumps(gb.build_requests(args.bin, model, 256, 0, [])) + "\n")
    if args.profile:
        prof = subprocess.run(common + ["--quantize", "fp8", "--request", bench_req, "--repeat", "4"],
                              env={**os.environ, "IMAJEV_PROFILE": args.profile, "NO_COLOR": "1"},
                              capture_output=True, text=True)
        (out / "profile-256.log").write_text(prof.stderr[-60000:])
    ncand = []
    for i, r in enumerate(reqs):
        for f, n in enumerate(gb.field_candidates(r)):
            ncand += [(i, f, n)]
    key = lambda p: (p["request"], p["field"], p["pass"])
    fp8 = sorted(passes["fp8"], key=key)
    bf = sorted(passes["none"], key=key)
    nmap = {(i, f): n for i, f, n in ncand}
    logits = {"ours_fp8": [p["logits"][:nmap[(p["request"], p["field"])]] for p in fp8],
              "ours_bf16": [p["logits"][:nmap[(p["request"], p["field"])]] for p in bf]}
    for variant in ("bfloat16", "float32", "w8", "w8a8"):
        import torch
        peer = gb.Peer.__new__(gb.Peer)
        # Peer.__init__ loads bf16; load the requested dtype the same way.
        from transformers import Qwen3_5ForConditionalGeneration
        from peft import PeftModel
        from safetensors.torch import load_file
        dtype = torch.float32 if variant == "float32" else torch.bfloat16
        m = Qwen3_5ForConditionalGeneration.from_pretrained(str(model), dtype=dtype).to("cuda").eval()
        if variant in ("w8", "w8a8"):
            emulate_fp8(m, variant == "w8a8")
        peer.torch, peer.device = torch, "cuda"
        peer.model = PeftModel.from_pretrained(m, str(adapter)).eval()
        peer.core = peer.model.base_model.model.model
        peer.readout = load_file(str(adapter / "decision_readout.safetensors"))["weight"].float().to("cuda")
        name = f"peer_{variant}"
        logits[name] = [peer.logits(p["input_ids"], [], nmap[(p["request"], p["field"])]) for p in fp8]
        del peer, m
        torch.cuda.empty_cache()
    pairs = [("ours_fp8", "peer_bfloat16"), ("ours_bf16", "peer_bfloat16"), ("peer_bfloat16", "peer_float32"),
             ("peer_w8", "peer_bfloat16"), ("peer_w8a8", "peer_bfloat16"), ("ours_fp8", "peer_w8a8"),
             ("ours_fp8", "peer_float32"), ("ours_bf16", "peer_float32"), ("ours_fp8", "ours_bf16")]
    result = {f"{a} vs {b}": compare(logits[a], logits[b]) for a, b in pairs}
    (out / "ablation.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
