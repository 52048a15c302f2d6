#!/usr/bin/env python3
"""Summarises an Nsight Compute text report written by bench/h200_ncu.sh: one block per kernel
(its first profiled launch; the others are the same shape repeated), with the duration, how busy
the issue slots were, occupancy and its limiter, registers, shared memory, and the warp stall
reasons (cycles per issued instruction) in decreasing order: enough to tell an issue-bound kernel
from a latency-bound one without the full report (which is ~0.5 MB per kernel group).

    python3 bench/ncu_summary.py ncu-attn.txt [more reports...]
"""
import re
import sys

KEEP = re.compile(
    r"Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit (Registers|Shared Mem)"
    r"|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc Active|Dynamic Shared Memory Per Block"
    r"|Compute \(SM\) Throughput|Max Bandwidth|No Eligible"
)
STALL = re.compile(r"\s+smsp__average_warps_issue_stalled_(\S+)_per_issue_active\.ratio\s+\S+\s+([\d.]+)")


def summarise(text):
    blocks = re.split(r"\n(?=  [A-Za-z_0-9]+ \(\d)", text)
    seen = set()
    for block in blocks[1:]:
        head = block.split("\n")[0].strip()
        key = head.split(", Context")[0]
        if key in seen:
            continue
        seen.add(key)
        print("==", key)
        stalls = []
        for line in block.split("\n"):
            m = STALL.match(line)
            if m:
                stalls.append((float(m.group(2)), m.group(1)))
            elif KEEP.search(line):
                print("  ", " ".join(line.split()))
        stalls.sort(reverse=True)
        print("   stalls (cycles per issue):", ", ".join(f"{n} {v:.2f}" for v, n in stalls[:8]))


if __name__ == "__main__":
    for path in sys.argv[1:]:
        summarise(open(path, encoding="utf-8", errors="replace").read())
