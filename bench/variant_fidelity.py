#!/usr/bin/env python3
"""Does an engine option move answers? Ours against ours, on the trained-like checkpoint.

    source bench/device_env.sh
    python3 bench/variant_fidelity.py --bin .gpu/imajev-serve --work /tmp/vf --out $OUT \
        --variant IMAJEV_GDN_TF32=1 --variant "IMAJEV_NARROW_GEMM=n"

An option that changes arithmetic (one TF32 MMA per DeltaNet product instead of 3xTF32, our own
narrow GEMMs instead of cuBLASLt, ...) should become the default only if it moves decisions less
than the distances we already accept: on this profile ours vs transformers bf16 is median |Δp|
4.6e-5 and transformers' own bf16 vs fp32 floor 5.4e-5 (bench/results/h200-fidelity-fp8.json).
A full fidelity run needs transformers (two device calls); this needs only our binary: the
requests of bench/fidelity_fp8.py (same synth --profile trained-like, same plan) through `decide
--quantize fp8` once with the default engine and once per --variant (space-separated NAME=value
assignments added to the environment), each variant compared with the default per decision (4
rotations combined) and per pass with fidelity_fp8's metrics, and each leg's wall time.
Writes OUT/variant_fidelity.json. One device call: synth ~12 s, each leg ~30-50 s (the first
also compiles the kernels on a fresh machine, ~50 s).
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity_fp8 as ff  # noqa: E402
import gpu_bench as gb  # noqa: E402


def parse_env(spec):
    env = {}
    for item in spec.split():
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"--variant {spec!r}: expected NAME=value assignments")
        env[name] = value
    return env


def leg_decisions(passes, n_cand):
    """A leg's passes grouped into decisions, each pass's logits cut to its candidates."""
    logits = [p["logits"][: n_cand[(p["request"], p["field"])]] for p in passes]
    return ff.decisions(passes, logits)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="imajev-serve")
    ap.add_argument("--work", required=True, help="checkpoint, requests, images")
    ap.add_argument("--out", required=True, help="where variant_fidelity.json goes")
    ap.add_argument("--variant", action="append", type=parse_env, required=True,
                    help="NAME=value [NAME=value ...]: one variant of the engine (repeatable)")
    ap.add_argument("--quantize", default="fp8", choices=["fp8", "none"])
    ap.add_argument("--config", default="qwen3.5-4b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-requests", type=int, default=312)
    ap.add_argument("--image-requests", type=int, default=24, help="half with one image, half with two")
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--lora-alpha", type=float, default=128)
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    for d in (work, out):
        d.mkdir(parents=True, exist_ok=True)
    model, adapter = work / f"model-{args.config}-tl", work / f"adapter-{args.config}-tl"
    timings = {}
    if not (model / "config.json").exists():
        t = time.perf_counter()
        gb.run([args.bin] + ff.synth_cmd(args, model, adapter))
        timings["synth_s"] = time.perf_counter() - t
    req_path, reqs, _ = ff.build_requests(args, work)
    n_cand = {(i, f): n for i, r in enumerate(reqs) for f, n in enumerate(gb.field_candidates(r))}
    quantize = args.quantize if args.device == "cuda" else None
    base, timings["default_s"] = ff.run_ours(args, work, model, adapter, req_path, "default", quantize)
    base_q = leg_decisions(base, n_cand)
    variants = []
    for i, env in enumerate(args.variant):
        passes, seconds = ff.run_ours(args, work, model, adapter, req_path, f"variant{i}", quantize, env)
        if [p["input_ids"] for p in passes] != [p["input_ids"] for p in base]:
            sys.exit(f"variant_fidelity: {env} planned other passes than the default engine")
        pair = ff.compare(leg_decisions(passes, n_cand), base_q)
        variants.append({"env": env, "seconds": seconds, "vs_default": pair})
        c = pair["combined"]
        print(f"{' '.join(f'{k}={v}' for k, v in env.items()):<40} top {c['top_agreement']:.4f}  "
              f"median|Δp| {c['median_abs_dp']:.2e}  p99 {c['p99_abs_dp']:.2e}  max {c['max_abs_dp']:.2e}  "
              f"({seconds:.1f} s; default {timings['default_s']:.1f} s)", flush=True)
    result = {
        "what": "ours with an engine option vs ours with the default engine, same requests (bench/fidelity_fp8.py's "
                "trained-like checkpoint and plan), decisions = 4 rotations combined",
        "command": " ".join(sys.argv),
        "config": args.config, "device": args.device, "quantize": quantize or "none (the CPU engine is f32)",
        "requests": {"text": args.text_requests, "with_images": args.image_requests, "passes": len(base),
                     "decisions": len(base_q)},
        "reference_distances": "ours bf16 vs transformers bf16: median |dp| 4.6e-5; transformers bf16 vs fp32: "
                               "5.4e-5 (bench/results/h200-fidelity-fp8.json)",
        "variants": variants,
        "timings_s": timings,
    }
    ff.write_json(out / "variant_fidelity.json", result)


if __name__ == "__main__":
    main()
