#!/usr/bin/env python3
"""Load test: 4× the queue depth of concurrent requests against a running imajev-serve.

    imajev-serve serve --demo --port 8765 --queue-depth 4 &   # the demo model is enough
    python3 bench/load_test.py --url http://127.0.0.1:8765 --queue-depth 4 --out bench/results/load_test.json

Phase 1 fires `4 × queue depth` requests at once (plus one more per HTTP thread, which can be in the
engine). Every request must get 200 with all its answers, or 529 `overloaded` with a Retry-After
header; nothing else. Phase 2 retries every refused request, honouring Retry-After, until all are
answered. Then /metrics must show no accepted request dropped. Standard library only.
"""
import argparse
import json
import re
import threading
import time
import urllib.error
import urllib.request


def request_body(i):
    options = {f"queue-{k}": f"tickets of kind {k}" for k in range(10)}
    questions = {f"q{j}": {"type": "choice", "instructions": f"Which queue fits ticket {i} best (view {j})?", "criteria": options}
                 for j in range(6)}
    questions["urgent"] = {"type": "noul", "instructions": "Is it urgent?"}
    return json.dumps({"model": "jev-latest", "state": {"ticket": f"Ticket {i}: printer E-204 on floor {i % 7}"},
                       "questions": questions}).encode()


def send(url, body):
    req = urllib.request.Request(url + "/v1/systemone", data=body, headers={"Content-Type": "application/json"}, method="POST")
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, dict(r.headers), json.loads(r.read()), (time.perf_counter() - t) * 1e3
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}"), (time.perf_counter() - t) * 1e3


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else None


def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8765")
    ap.add_argument("--queue-depth", type=int, required=True)
    ap.add_argument("--out")
    args = ap.parse_args()
    n = 4 * args.queue_depth
    results = [None] * n
    barrier = threading.Barrier(n)

    def worker(i):
        barrier.wait()
        results[i] = send(args.url, request_body(i))

    passes_before = metric(args.url, "imajev_passes_total")
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    phase1_s = time.perf_counter() - t0
    statuses = {}
    problems = []
    refused = []
    for i, (status, headers, body, ms) in enumerate(results):
        statuses[status] = statuses.get(status, 0) + 1
        if status == 200:
            if sorted(body.get("answers", {})) != sorted(json.loads(request_body(i))["questions"]):
                problems.append(f"request {i}: answers incomplete")
        elif status == 529:
            h = {k.lower(): v for k, v in headers.items()}
            if "retry-after" not in h or body.get("error") != "overloaded":
                problems.append(f"request {i}: 529 without Retry-After or error code: {h} {body}")
            refused.append((i, int(h.get("retry-after", "1"))))
        else:
            problems.append(f"request {i}: unexpected status {status}: {body}")
    # Phase 2: clients honour Retry-After until everything is answered.
    retries = 0
    pending = refused
    t1 = time.perf_counter()
    while pending:
        time.sleep(max(r for _, r in pending))
        nxt = []
        for i, _ in pending:
            status, headers, body, ms = send(args.url, request_body(i))
            retries += 1
            if status == 200:
                continue
            if status != 529:
                problems.append(f"retry of request {i}: status {status}")
                continue
            nxt.append((i, int({k.lower(): v for k, v in headers.items()}.get("retry-after", "1"))))
        pending = nxt
    phase2_s = time.perf_counter() - t1
    dropped = metric(args.url, "imajev_jobs_dropped_total")
    passes = metric(args.url, "imajev_passes_total") - passes_before
    ok_ms = [ms for s, _, _, ms in results if s == 200]
    report = {
        "command": f"python3 bench/load_test.py --url URL --queue-depth {args.queue_depth} (server: imajev-serve serve --demo --queue-depth {args.queue_depth}, CPU)",
        "date": time.strftime("%Y-%m-%d"),
        "concurrent_requests": n,
        "queue_depth": args.queue_depth,
        "phase1_statuses": {str(k): v for k, v in sorted(statuses.items())},
        "phase1_seconds": round(phase1_s, 2),
        "phase1_answered_latency_ms": {"p50": pct(ok_ms, 0.5), "p95": pct(ok_ms, 0.95), "max": max(ok_ms) if ok_ms else None},
        "phase2_retries": retries,
        "phase2_seconds": round(phase2_s, 2),
        "all_answered_after_retries": not problems,
        "jobs_dropped_total": dropped,
        "engine_passes": passes,
        "expected_passes": n * (6 * 4 + 3),
        "problems": problems,
    }
    if dropped:
        problems.append(f"{dropped} accepted request(s) dropped")
    if passes != report["expected_passes"]:
        problems.append(f"engine ran {passes} passes, expected {report['expected_passes']} (every request exactly once)")
    report["problems"] = problems
    print(json.dumps(report, indent=2))
    if args.out:
        open(args.out, "w").write(json.dumps(report, indent=2) + "\n")
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
