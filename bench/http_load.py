#!/usr/bin/env python3
"""HTTP throughput under concurrent clients, and byte-identity of every answer (issue 11).

    # the GPU service (synthetic Qwen3.5-4B, as bench/gpu_bench.py builds it under --work):
    python3 bench/http_load.py --bin target/release/imajev-serve --work /tmp/bench \
        --out bench/results/http_load.json -- --device cuda --quantize fp8 --rotations 4
    # the CPU demo server (the built-in random-weight model), e.g. to check this script:
    python3 bench/http_load.py --bin target/release/imajev-serve --demo --tokens 64 --duration 3 --out /tmp/load.json
    # a server that is already running:
    python3 bench/http_load.py --url http://127.0.0.1:8765 --model-dir DIR_WITH_TOKENIZER ...
    # put reports written with --out (e.g. by bench/h200_throughput.sh) into the results file:
    python3 bench/http_load.py --merge-into bench/results/h200.json --merge-report throughput.json \
        --merge-report throughput-unpacked.json

The request is gpu_bench.py's: 3 questions (noul, 4-option choice, 5-level score) over a state of
about `--tokens` tokens (256), in `--variants` versions (8) whose states differ, so that packed
forwards mix different requests. First every variant is sent once, alone, one after the other:
those answers are the single-client reference. Then for each client count (`--clients`,
1,4,16,64) the clients send requests back to back over keep-alive connections (variant i of
client c: (c + i) mod variants) for `--duration` seconds after a warm-up of one round per client;
a 529 is counted and retried after its Retry-After. Per level: requests/s (200s over the wall time
of the measured window), p50/p99 latency of the 200s, the count of every status, and whether
every 200's `answers` equals the reference answer of its variant byte for byte (compared as
parsed and re-serialised JSON: equal exactly when every number is the same double and every key
and string the same, in the same order).

Writes {"throughput": [{clients, requests_per_s, p50_ms, p99_ms, statuses,
identical_to_single_client}], ...} plus the server's engine rounds per level (from /metrics:
requests per packed forward, and the fraction of the wall time the engine spent in rounds with
their mean length, from `imajev_engine_busy_seconds_total`) and the sha256 of each variant's reference answers (so that two
servers' answers can be compared); `--merge-into bench/results/h200.json` also puts the rows there
under "throughput" (and the commands under "throughput_command"). With `--merge-report` instead of
a run, the rows come from a report written before; a second `--merge-report` (a run with
cross-request packing off) goes under "throughput_packing_off". Exits 1 when an answer differs or
a status other than 200/529 comes back. Standard library only (gpu_bench.py
needs PIL/numpy only for images, which this does not send).
"""
import argparse
import hashlib
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402  (the benchmark request and the synthetic model)


def pct(xs, q):
    return gpu_bench.pct(xs, q) if xs else None


class Client:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, url):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.conn = None

    def post(self, body):
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
            try:
                t = time.perf_counter()
                self.conn.request("POST", "/v1/systemone", body=body, headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                data = r.read()
                ms = (time.perf_counter() - t) * 1e3
                if r.getheader("connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return r.status, {k.lower(): v for k, v in r.getheaders()}, data, ms
            except (http.client.HTTPException, ConnectionError, OSError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise RuntimeError("unreachable")


def answers_text(data):
    """The response's answers as canonical text (see the module doc)."""
    return json.dumps(json.loads(data)["answers"], ensure_ascii=False)


def metrics(url):
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("imajev_batch_requests_sum", "imajev_batch_requests_count",
                            "imajev_engine_busy_seconds_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def run_level(url, bodies, reference, clients, duration):
    """`clients` clients for `duration` seconds after one warm-up round each."""
    stop_at = [None]
    lock = threading.Lock()
    rows = []  # (status, ms, identical or None)
    problems = []
    warm = threading.Barrier(clients + 1)
    go = threading.Event()

    def client(c):
        cl = Client(url)
        i = 0
        try:
            # Warm-up: one request per client, not measured.
            cl.post(bodies[c % len(bodies)])
        except Exception as e:
            with lock:
                problems.append(f"client {c} warm-up: {e!r}")
        warm.wait()
        go.wait()
        while time.perf_counter() < stop_at[0]:
            v = (c + i) % len(bodies)
            i += 1
            try:
                status, headers, data, ms = cl.post(bodies[v])
            except Exception as e:  # a broken connection is a result too
                with lock:
                    rows.append(("error", None, None))
                    problems.append(f"client {c}: {e!r}")
                continue
            same = None
            if status == 200:
                same = answers_text(data) == reference[v]
                if not same:
                    with lock:
                        problems.append(f"{clients} clients: variant {v} answered differently than alone")
            elif status == 529:
                time.sleep(int(headers.get("retry-after-ms", "100")) / 1000)
            else:
                with lock:
                    problems.append(f"{clients} clients: status {status}: {data[:300]!r}")
            with lock:
                rows.append((status, ms, same))

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    warm.wait()  # everyone warmed up
    before = metrics(url)
    t0 = time.perf_counter()
    stop_at[0] = t0 + duration
    go.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = metrics(url)
    ok = [ms for s, ms, _ in rows if s == 200]
    statuses = {}
    for s, _, _ in rows:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    rounds = after.get("imajev_batch_requests_count", 0) - before.get("imajev_batch_requests_count", 0)
    answered = after.get("imajev_batch_requests_sum", 0) - before.get("imajev_batch_requests_sum", 0)
    row = {
        "clients": clients,
        "requests_per_s": round(len(ok) / wall, 2),
        "p50_ms": round(pct(ok, 0.5), 2) if ok else None,
        "p99_ms": round(pct(ok, 0.99), 2) if ok else None,
        "statuses": dict(sorted(statuses.items())),
        "identical_to_single_client": bool(ok) and all(same for s, _, same in rows if s == 200),
    }
    busy = after.get("imajev_engine_busy_seconds_total", 0) - before.get("imajev_engine_busy_seconds_total", 0)
    detail = {"clients": clients, "requests": len(rows), "answered": len(ok), "seconds": round(wall, 2),
              "engine_rounds": int(rounds),
              "requests_per_engine_round": round(answered / rounds, 2) if rounds else None,
              # The engine thread's time inside rounds: wall / rounds - this is what it spends
              # between rounds (taking the next requests, answering); busy / wall near 1: saturated.
              "engine_busy_fraction": round(busy / wall, 3) if "imajev_engine_busy_seconds_total" in after else None,
              "engine_ms_per_round": round(1e3 * busy / rounds, 2) if rounds and busy else None}
    return row, detail, problems


def merge(path, report, packing_off=None):
    """Put `report`'s rows into the results file `path` under "throughput" (and, given, a run with
    cross-request packing off under "throughput_packing_off")."""
    doc = json.loads(Path(path).read_text())
    doc["throughput"] = report["throughput"]
    doc["throughput_command"] = {"client": report["command"], "server": report["server"],
                                 "request": report["request"], "details": report["details"], "date": report["date"]}
    if packing_off is not None:
        doc["throughput_packing_off"] = {
            "rows": packing_off["throughput"], "details": packing_off["details"],
            "client": packing_off["command"], "server": packing_off["server"],
            "same_answers_as_packed_server": packing_off.get("reference_sha256") == report.get("reference_sha256"),
        }
    Path(path).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def start_server(args, work):
    port = args.port
    cmd = [args.bin, "serve", "--port", str(port), "--queue-depth", str(max(64, max(args.clients)))]
    if args.demo:
        cmd += ["--demo"]
    else:
        cmd += ["--model", str(work / "model"), "--adapter", str(work / "adapter")]
    cmd += args.server_args
    log_path = Path(args.server_log) if args.server_log else work / "server.log"
    log = open(log_path, "w")
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    t = time.time()
    while time.time() - t < args.start_timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log_path}")
        try:
            if urllib.request.urlopen(url + "/healthz", timeout=5).status == 200:
                return proc, url, cmd
        except Exception:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not become healthy in {args.start_timeout} s; see {log_path}")


def print_report(path):
    """A report written by --out as a few lines: its server, its request, then per client count the
    requests/s, latencies, statuses, the byte-identity check and requests per engine round."""
    if not Path(path).exists():
        print(f"{path}: no report")
        return
    r = json.loads(Path(path).read_text())
    print(f"{Path(path).stem}: {r['server']}")
    print(f"  request: {r['request']}")
    for row, d in zip(r["throughput"], r["details"]):
        print(f"  {row['clients']:3d} clients: {row['requests_per_s']:7.2f} req/s  p50 {row['p50_ms']} ms  "
              f"p99 {row['p99_ms']} ms  statuses {row['statuses']}  identical {row['identical_to_single_client']}  "
              f"requests/round {d['requests_per_engine_round']}  engine busy {d.get('engine_busy_fraction')}"
              f" ({d.get('engine_ms_per_round')} ms a round)")
    for q in r["problems"][:5]:
        print(f"  problem: {q}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", help="imajev-serve binary: start `serve` (and build the model with `synth` when needed)")
    ap.add_argument("--url", help="an already running server instead of --bin")
    ap.add_argument("--work", default=None, help="model folder as gpu_bench.py makes it (work/model, work/adapter)")
    ap.add_argument("--config", default="qwen3.5-4b", help="synth preset when --work has no model yet")
    ap.add_argument("--demo", action="store_true", help="serve the built-in demo model (`serve --demo`)")
    ap.add_argument("--model-dir", help="with --url: a folder whose tokenizer sizes the state (else the built-in one)")
    ap.add_argument("--port", type=int, default=18777)
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per client count")
    ap.add_argument("--tokens", type=int, default=256, help="about this many tokens per request")
    ap.add_argument("--variants", type=int, default=8)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--server-log", help="where the started server's output goes (default: WORK/server.log)")
    ap.add_argument("--out")
    ap.add_argument("--merge-into", help="also set this JSON file's \"throughput\" (e.g. bench/results/h200.json)")
    ap.add_argument("--merge-report", action="append", default=[],
                    help="with --merge-into and no run: a report written by --out (a second one: packing off)")
    ap.add_argument("--print-report", nargs="+", metavar="REPORT",
                    help="no run: print reports written by --out, a block each (server, request, one line per level)")
    ap.add_argument("server_args", nargs="*", help="after --: extra `serve` flags (e.g. --device cuda --quantize fp8)")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    if args.print_report:
        for path in args.print_report:
            print_report(path)
        return
    if args.merge_report:
        if not args.merge_into or args.bin or args.url or len(args.merge_report) > 2:
            ap.error("--merge-report: one or two reports, with --merge-into and without --bin/--url")
        reports = [json.loads(Path(r).read_text()) for r in args.merge_report]
        merge(args.merge_into, *reports)
        return
    if bool(args.bin) == bool(args.url):
        ap.error("give exactly one of --bin and --url")
    tmp = tempfile.TemporaryDirectory()
    work = Path(args.work) if args.work else Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    proc = None
    if args.bin and not args.demo and not (work / "model" / "config.json").exists():
        gpu_bench.run([args.bin, "synth", "--config", args.config, "--dtype", "bf16", "--seed", "0", "--out",
                       work / "model", "--adapter-out", work / "adapter", "--lora-rank", "64", "--lora-alpha", "128",
                       "--readout-rows", "256"])
    if args.bin:
        proc, url, cmd = start_server(args, work)
        server_command = " ".join(map(str, cmd))
    else:
        url, server_command = args.url.rstrip("/"), f"(already running at {args.url})"
    try:
        tok_dir = work / "model" if (work / "model").exists() and not args.demo else Path(args.model_dir or tmp.name)
        binary = args.bin or "imajev-serve"
        bodies, sizes = [], []
        for v in range(args.variants):
            req = gpu_bench.build_requests(binary, tok_dir, args.tokens, 0, [], seed=v)
            bodies.append(json.dumps(req).encode())
        # The single-client reference: each variant once, alone.
        reference = []
        cl = Client(url)
        for v, body in enumerate(bodies):
            status, _, data, _ = cl.post(body)
            if status != 200:
                raise SystemExit(f"variant {v}: status {status}: {data[:500]!r}")
            reference.append(answers_text(data))
            sizes.append(json.loads(data)["usage"])
        rows, details, problems = [], [], []
        for c in args.clients:
            row, detail, probs = run_level(url, bodies, reference, c, args.duration)
            print(json.dumps({**row, **detail}), file=sys.stderr, flush=True)
            rows.append(row)
            details.append(detail)
            problems += probs
        report = {
            "command": "python3 " + " ".join(sys.argv),
            "server": server_command,
            "date": time.strftime("%Y-%m-%d"),
            "request": {"questions": 3, "variants": args.variants, "target_tokens": args.tokens,
                        "input_tokens": sorted({u["input_tokens"] for u in sizes}),
                        "processed_tokens": sorted({u["processed_tokens"] for u in sizes}),
                        "passes": sizes[0]["passes"], "rotations": sizes[0]["rotations"]},
            "duration_s": args.duration,
            "throughput": rows,
            "details": details,
            "reference_sha256": [hashlib.sha256(r.encode()).hexdigest() for r in reference],
            "problems": problems[:50],
        }
        text = json.dumps(report, indent=2, ensure_ascii=False)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        if args.merge_into:
            merge(args.merge_into, report)
        bad = [r for r in rows if not r["identical_to_single_client"]]
        odd = [s for r in rows for s in r["statuses"] if s not in ("200", "529")]
        raise SystemExit(1 if bad or odd else 0)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
