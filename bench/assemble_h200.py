#!/usr/bin/env python3
"""Turns the files one `bash bench/h200_run.sh ...` device call wrote under $OUT into the committed
bench/results/h200.json (the issue's schema plus context), and copies the logs beside it.

    python3 bench/assemble_h200.py <OUT folder> --command "<the exact device command>"

What other runs recorded there is kept: `fidelity` (issue 12's FP8 bar, `bench/fidelity_fp8.py`),
`throughput*` (`bench/h200_throughput.sh`) and the long-input rows of `requests` (`image_side`,
each with its own command) that this run did not measure. This run's random-weights comparison
goes to `fidelity_random_weights`.
"""
import argparse
import datetime
import json
import re
import shutil
from pathlib import Path

TARGETS = {"256_tokens_3q_4rot_p50_ms": 30, "speedup_vs_peer_at_256": 40,
           "fidelity_top_agreement": 0.99, "fidelity_median_abs_dp": 0.002}


def per_op(log):
    out = {}
    for line in log.splitlines():
        m = re.match(r"\s+(.+?):\s+([0-9.]+) ms\s*(.*)$", line)
        if m and ("GEMM" in m.group(1) or "rms_norm" in m.group(1) or "gated_" in m.group(1)):
            out[m.group(1).strip()] = {"ms": float(m.group(2)), "note": m.group(3).strip()}
    return out


def keep(doc, path):
    """Carries over from the committed file what this run did not measure (see the module doc)."""
    if not path.exists():
        return
    before = json.loads(path.read_text())
    measured = {(q["tokens"], q["images"]) for q in doc["requests"]}
    doc["requests"] += [q for q in before.get("requests", []) if "image_side" in q
                        and (q["tokens"], q["images"]) not in measured]
    for key in ("fidelity", "throughput", "throughput_command", "throughput_packing_off"):
        if key in before:
            doc[key] = before[key]
    if "fidelity" in doc:
        doc["met"]["fidelity_fp8_bar"] = doc["fidelity"]["bar"]["met"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--command", required=True)
    ap.add_argument("--dest", default="bench/results")
    args = ap.parse_args()
    src, dest = Path(args.out), Path(args.dest)
    r = json.loads((src / "results.json").read_text())
    gpu = (src / "gpu.txt").read_text().strip().split(", ")
    info = {}
    for line in (src / "bench.log").read_text().splitlines():
        m = re.search(r"DeviceInfo \{.*?name: \"([^\"]+)\".*?driver_version: (\d+), nvrtc_version: \((\d+), (\d+)\), cublaslt_version: (\d+)", line)
        if m:
            info = {"name": m.group(1), "driver": int(m.group(2)), "nvrtc": f"{m.group(3)}.{m.group(4)}", "cublaslt": int(m.group(5))}
            break
    lt = info.get("cublaslt", 0)
    requests = []
    for x in r["requests"]:
        requests.append({"tokens": x["tokens"], "images": x["images"], "questions": x["questions"], "rotations": x["rotations"],
                         "ours_p50_ms": round(x["ours_p50_ms"], 2), "ours_p95_ms": round(x["ours_p95_ms"], 2),
                         "peer_p50_ms": round(x["peer_p50_ms"], 1), "speedup": round(x["speedup"], 2),
                         "passes": x["passes"], "processed_tokens": x["processed_tokens"],
                         "ours_prefill_p50_ms": round(x["ours_prefill_p50_ms"], 2),
                         "ours_vision_p50_ms": round(x["ours_vision_p50_ms"], 2),
                         "ours_questions_p50_ms": round(x["ours_questions_p50_ms"], 2)})
    first = next(q for q in requests if q["images"] == 0 and q["tokens"] < 400)
    fid = r["fidelity"]
    doc = {
        "gpu": f"{gpu[0]} ({gpu[2] if len(gpu) > 2 else '?'})",
        "driver": f"{gpu[1] if len(gpu) > 1 else '?'} (CUDA {info.get('driver', 0) // 1000}.{info.get('driver', 0) % 1000 // 10}, "
                  f"cuBLASLt {lt // 10000}.{lt % 10000 // 100}.{lt % 100}, NVRTC {info.get('nvrtc', '?')})",
        "date": datetime.date.today().isoformat(),
        "command": args.command,
        "versions": (src / "versions.txt").read_text().strip(),
        "deltanet_scan": (src / "scan.txt").read_text().strip(),
        "model": "synth --config qwen3.5-4b --dtype bf16 --seed 0 (exact Qwen3.5-4B shapes, random weights) + LoRA "
                 "r64/alpha128 on the 200 text projections + F32 readout [256, 2560]",
        "ours": "imajev-serve decide --device cuda --quantize fp8 --rotations 4: block-FP8 projections (E4M3, 128x128 RTN), "
                "BF16 LoRA unmerged, FP32 readout; the shared prefix (once) and the 11 question passes that continue it "
                "in one packed forward (up to 8192 tokens; longer prefixes are prefilled first, then the passes are "
                "extended as forks). Latency = the whole request (parsing, image preprocessing, tokenisation, vision, "
                "prefill, passes, readout), p50/p95 over the timed runs after one warm-up.",
        "peer": "transformers + PEFT, bf16, flash-linear-attention 0.6.0; the same token ids, one full forward per pass "
                "(vision recomputed per pass), as imajev's torch server; forwards only are timed, after one warm-up.",
        "requests": requests,
        "fidelity_random_weights": {
            **{k: fid[k] for k in ("decisions", "top_agreement", "median_abs_dp", "p99_abs_dp", "max_abs_dp", "compared")},
            "rotations_combined": r.get("fidelity_rotations_combined"),
            "ablation": {
                "file": "bench/results/h200-fidelity-ablation-emulated.json",
                "summary": "The FP8 recipe emulated inside transformers on the same weights and token ids: FP8 weights "
                           "alone (RTN 128x128, bf16 compute) vs bf16 give median |dp| 7.8e-3; weights + 1x128 "
                           "activations 6.1e-3 and 96.4% top agreement; our BF16 path vs transformers bf16 1.9e-3 and "
                           "100%. The 2e-3 target is below what FP8 weights alone cost on these random weights.",
            },
            "note": "the random-weights profile of the request benchmark; superseded as the fidelity criterion by "
                    "`fidelity` (issue 12): on random weights every comparison is dominated by noise",
        },
        "synth_s": r.get("synth_s"),
        "peer_load_s": r.get("peer", {}).get("load_s"),
        "targets": TARGETS,
        "met": {
            "256_tokens_p50_le_30ms": first["ours_p50_ms"] <= TARGETS["256_tokens_3q_4rot_p50_ms"],
            "speedup_ge_40x_at_256": first["speedup"] >= TARGETS["speedup_vs_peer_at_256"],
            "every_bucket_faster_than_peer": all(q["speedup"] > 1 for q in requests),
            "fidelity_random_weights_99pct_2e-3": fid["top_agreement"] >= TARGETS["fidelity_top_agreement"]
            and fid["median_abs_dp"] <= TARGETS["fidelity_median_abs_dp"],
        },
    }
    if (src / "gpu-test.log").exists():
        doc["per_op_one_layer_2048_tokens"] = per_op((src / "gpu-test.log").read_text())
    keep(doc, dest / "h200.json")
    (dest / "h200.json").write_text(json.dumps(doc, indent=2) + "\n")
    for name, new in [("gpu-test.log", "h200-gpu-test.log"), ("bench.log", "h200-bench.log"),
                      ("gpu-service.log", "h200-gpu-service.log"), ("profile-256-tail.log", "h200-kernel-profile-256.log")]:
        if (src / name).exists():
            shutil.copyfile(src / name, dest / new)
    print(json.dumps(doc["met"]), first)


if __name__ == "__main__":
    main()
