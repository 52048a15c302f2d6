#!/usr/bin/env python3
"""Where does the FP8-vs-BF16 difference come from? One device run, same token ids throughout:

    ours FP8 (--quantize fp8), ours BF16 (--quantize none), transformers+PEFT bf16 and fp32.

Every pair is compared per pass (one decision per option order): top agreement and |Δp|. The
fp32 transformers run is the reference; "peer bf16 vs peer fp32" is the noise floor of bf16
itself on these random weights. Also records a stage profile (IMAJEV_PROFILE=1) of the 256-token
benchmark request. Writes OUT/ablation.json.

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=70)
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
    prof = subprocess.run(common + ["--quantize", "fp8", "--request", bench_req, "--repeat", "4"],
                          env={**os.environ, "IMAJEV_PROFILE": "1", "NO_COLOR": "1"}, capture_output=True, text=True)
    (out / "profile-256.log").write_text(prof.stderr[-20000:])
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
    for dtype in ("bfloat16", "float32"):
        import torch
        peer = gb.Peer.__new__(gb.Peer)
        # Peer.__init__ loads bf16; load the requested dtype the same way.
        from transformers import Qwen3_5ForConditionalGeneration
        from peft import PeftModel
        from safetensors.torch import load_file
        m = Qwen3_5ForConditionalGeneration.from_pretrained(str(model), dtype=getattr(torch, dtype)).to("cuda").eval()
        peer.torch, peer.device = torch, "cuda"
        peer.model = PeftModel.from_pretrained(m, str(adapter)).eval()
        peer.core = peer.model.base_model.model.model
        peer.readout = load_file(str(adapter / "decision_readout.safetensors"))["weight"].float().to("cuda")
        logits[f"peer_{dtype}"] = [peer.logits(p["input_ids"], [], nmap[(p["request"], p["field"])]) for p in fp8]
        del peer, m
        torch.cuda.empty_cache()
    pairs = [("ours_fp8", "peer_bfloat16"), ("ours_bf16", "peer_bfloat16"), ("peer_bfloat16", "peer_float32"),
             ("ours_fp8", "peer_float32"), ("ours_bf16", "peer_float32"), ("ours_fp8", "ours_bf16")]
    result = {f"{a} vs {b}": compare(logits[a], logits[b]) for a, b in pairs}
    (out / "ablation.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
