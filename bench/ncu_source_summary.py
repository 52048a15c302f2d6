#!/usr/bin/env python3
"""Reads the SASS source page that bench/h200_ncu_source.sh writes (ncu --page source --csv
--print-source sass, gzipped or not) and says where one kernel launch spends its time:

    python3 bench/ncu_source_summary.py bench/results/h200-ncu-source-scan-pipelined-16k.csv.gz [--top 40]

1. warp-level instructions executed and stall samples, and the samples by stall reason;
2. executed instructions and stall samples by opcode;
3. straight-line regions (runs of instructions executed equally often: a loop body, a phase
   between barriers) holding at least 1% of the instructions or of the samples, with their size
   and their instructions per execution;
4. the --top instructions by stall samples with their three main reasons.
Standard library only.
"""
import argparse
import collections
import csv
import gzip
import io
import sys


def load(path):
    raw = gzip.open(path, "rb").read() if path.endswith(".gz") else open(path, "rb").read()
    rows = list(csv.reader(io.StringIO(raw.decode("utf-8", "replace"))))
    head = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    return rows[head], rows[head + 1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    hdr, data = load(args.csv)
    ix = {h: i for i, h in enumerate(hdr)}

    def num(r, k):
        try:
            return float(r[ix[k]].replace(",", ""))
        except (KeyError, ValueError, IndexError):
            return 0.0

    def opcode(r):
        words = r[ix["Source"]].split()
        if not words:
            return "?"
        w = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        return w.split(".")[0]

    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    exe = [num(r, "Instructions Executed") for r in data]
    smp = [num(r, "Warp Stall Sampling (All Samples)") for r in data]
    tot_i, tot_s = sum(exe), sum(smp) or 1.0
    print(f"{tot_i:,.0f} warp instructions executed, {tot_s:,.0f} stall samples")
    by_reason = collections.Counter()
    for r in data:
        for s in stalls:
            by_reason[s] += num(r, s)
    for s, v in by_reason.most_common(12):
        if v:
            print(f"  {s[6:]:20s} {100 * v / tot_s:5.1f}% of samples")
    print("\nby opcode: % of instructions, % of samples")
    ops_i, ops_s = collections.Counter(), collections.Counter()
    for r, e, s in zip(data, exe, smp):
        ops_i[opcode(r)] += e
        ops_s[opcode(r)] += s
    for k, v in ops_i.most_common(20):
        print(f"  {k:12s} {100 * v / tot_i:5.1f}% {100 * ops_s[k] / tot_s:5.1f}%")
    print("\nregions (instructions executed equally often), >= 1% of instructions or samples:")
    i = 0
    while i < len(data):
        j = i
        while j + 1 < len(data) and exe[j + 1] == exe[i]:
            j += 1
        n, e, s = j - i + 1, exe[i], sum(smp[i:j + 1])
        if e and (n * e >= 0.01 * tot_i or s >= 0.01 * tot_s):
            ops = " ".join(opcode(r) for r in data[i:i + 10])
            print(f"  rows {i:5d}-{j:5d}: {n:4d} instructions x {e:>11,.0f} = {100 * n * e / tot_i:5.1f}% of "
                  f"instructions, {100 * s / tot_s:5.1f}% of samples  [{ops} ...]")
        i = j + 1
    print(f"\nthe {args.top} instructions with the most stall samples:")
    for k in sorted(sorted(range(len(data)), key=lambda k: -smp[k])[:args.top]):
        r = data[k]
        reasons = sorted(((num(r, s), s[6:]) for s in stalls), reverse=True)[:3]
        why = " ".join(f"{n}:{v:.0f}" for v, n in reasons if v > 0)
        print(f"  row {k:5d} {100 * smp[k] / tot_s:5.1f}%  x{exe[k]:>10,.0f}  {r[ix['Source']].strip()[:58]:58s} {why}")


if __name__ == "__main__":
    sys.exit(main())
