#!/usr/bin/env python3
"""Soak: mixed valid and invalid traffic against the demo server for a while, RSS sampled.

Starts `imajev-serve serve --demo` (the binary given with --bin), runs --clients client threads for
--seconds, each sending a random mix of valid requests (noul, choice, score, multi, an image,
half-closed connections) and invalid ones (bad JSON, broken rules, 415, 404/405, garbage request
lines, bad Content-Length, missing Host, too many headers, a 1 MiB header, TLS and HTTP/2 bytes,
an unknown Content-Encoding), samples the server's resident memory every 5 s from
/proc/PID/status, and writes a JSON result: the command, commit and versions, the status counts,
the RSS samples, and two checks —
  * memory is flat: the largest RSS after warm-up (the first --warmup seconds) is at most 5% over
    the RSS at the end of warm-up;
  * no 5xx other than 503/504/529 (a 500 would be a bug), and every error had a JSON body.
Exits 1 when a check fails. Python standard library only.

    python3 bench/soak.py --bin target/release/imajev-serve --out bench/results/soak.json
"""

import argparse
import base64
import collections
import json
import os
import platform
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib


def png(w, h):
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes((x * 7 + y * 3) % 256 for x in range(w * 3)) for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


IMAGE = "data:image/png;base64," + base64.b64encode(png(96, 64)).decode()
Q_NOUL = {"q": {"type": "noul", "instructions": "Is the printer working?"}}
Q_MIX = {
    "a": {"type": "choice", "instructions": "Which part failed?", "criteria": {"tray": "paper tray", "ink": "ink", "fuser": "fuser"}},
    "b": {"type": "score", "instructions": "How severe?", "criteria": ["minor", "major", "critical"]},
    "c": {"type": "multi", "instructions": "Which apply?", "criteria": {"noise": "makes noise", "jam": "paper jam"}},
}


def body(obj):
    return json.dumps(obj).encode()


def post(data, ctype="application/json", extra=b""):
    return (b"POST /v1/systemone HTTP/1.1\r\nHost: soak\r\nContent-Type: " + ctype.encode()
            + b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n" + extra + b"\r\n" + data)


def cases():
    """(name, raw request bytes, half_close, valid)."""
    state = {"ticket": "E-%d" % random.randint(0, 999), "text": "paper jam " * random.randint(1, 40)}
    return [
        ("noul", post(body({"state": state, "questions": Q_NOUL})), False, True),
        ("mixed", post(body({"state": state, "questions": Q_MIX})), False, True),
        ("image", post(body({"state": state, "questions": Q_NOUL, "images": [IMAGE]})), False, True),
        ("half_close", post(body({"state": state, "questions": Q_NOUL})), True, True),
        ("bad_json", post(b"{\"state\": {,}"), False, False),
        ("invalid", post(body({"state": {}, "questions": {"q": {"type": "choice", "instructions": "x", "criteria": {"only": "one"}}}})), False, False),
        ("unknown_type", post(body({"questions": {"q": {"type": "poem", "instructions": "x"}}})), False, False),
        ("three_images", post(body({"questions": Q_NOUL, "images": [IMAGE] * 3})), False, False),
        ("not_an_image", post(body({"questions": Q_NOUL, "images": ["data:image/png;base64,AAAA"]})), False, False),
        ("media_type", post(b"x", ctype="text/plain"), False, False),
        ("encoding", post(b"x", extra=b"Content-Encoding: br\r\n"), False, False),
        ("not_found", b"GET /nowhere HTTP/1.1\r\nHost: soak\r\n\r\n", False, False),
        ("method", b"GET /v1/systemone HTTP/1.1\r\nHost: soak\r\n\r\n", False, False),
        ("garbage_line", b"\x01\x02 garbage\r\n\r\n", False, False),
        ("negative_length", b"POST /v1/systemone HTTP/1.1\r\nHost: soak\r\nContent-Length: -5\r\n\r\n", False, False),
        ("duplicate_length", b"POST /v1/systemone HTTP/1.1\r\nHost: soak\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", False, False),
        ("no_host", b"GET /healthz HTTP/1.1\r\n\r\n", False, False),
        ("many_headers", b"GET /healthz HTTP/1.1\r\nHost: soak\r\n" + b"X-A: b\r\n" * 120 + b"\r\n", False, False),
        ("huge_header", b"GET /healthz HTTP/1.1\r\nHost: soak\r\nX-A: " + b"b" * (1 << 20) + b"\r\n\r\n", False, False),
        ("tls", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + os.urandom(32), False, False),
        ("http2", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", False, False),
    ]


def exchange(port, raw, half_close):
    """Sends one request on a fresh connection; returns (status, body bytes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        try:
            s.sendall(raw)
        except OSError:
            pass  # the server may answer (and close) before a huge head is all sent
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                head = data[:head_end].decode("latin-1")
                length = 0
                for line in head.split("\r\n")[1:]:
                    k, _, v = line.partition(":")
                    if k.strip().lower() == "content-length":
                        length = int(v.strip())
                if len(data) >= head_end + 4 + length:
                    return int(head.split(" ")[1]), data[head_end + 4:head_end + 4 + length]
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None, data
            data += chunk
    finally:
        s.close()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="target/release/imajev-serve")
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--warmup", type=float, default=120)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--port", type=int, default=18877)
    ap.add_argument("--out", default="bench/results/soak.json")
    a = ap.parse_args()

    env = {k: v for k, v in os.environ.items() if not k.startswith("IMAJEV_")}
    server = subprocess.Popen([a.bin, "serve", "--demo", "--port", str(a.port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                if exchange(a.port, b"GET /healthz HTTP/1.1\r\nHost: soak\r\n\r\n", False)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            sys.exit("the demo server did not get ready")

        counts = collections.Counter()
        by_case = collections.defaultdict(collections.Counter)
        problems = []
        latencies = []
        lock = threading.Lock()
        stop = time.time() + a.seconds
        started = time.time()

        def client(seed):
            rng = random.Random(seed)
            while time.time() < stop:
                name, raw, half, valid = rng.choice(cases())
                t = time.time()
                try:
                    status, data = exchange(a.port, raw, half)
                except OSError as e:
                    status, data = None, str(e).encode()
                dt = time.time() - t
                with lock:
                    counts[status] += 1
                    by_case[name][status] += 1
                    if valid and status == 200:
                        latencies.append(dt)
                    if status is None or (status >= 500 and status not in (503, 504, 529)):
                        problems.append({"case": name, "status": status, "body": data[:300].decode("latin-1")})
                    elif status >= 400:
                        try:
                            j = json.loads(data)
                            assert isinstance(j["error"], str) and "detail" in j
                        except Exception:
                            problems.append({"case": name, "status": status, "not_json": data[:300].decode("latin-1")})
                    if valid and status != 200 and status not in (503, 504, 529):
                        problems.append({"case": name, "status": status, "body": data[:300].decode("latin-1")})

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.clients)]
        for t in threads:
            t.start()
        samples = []
        while time.time() < stop:
            samples.append({"t": round(time.time() - started, 1), "rss_kib": rss_kib(server.pid)})
            time.sleep(5)
        for t in threads:
            t.join(120)
        samples.append({"t": round(time.time() - started, 1), "rss_kib": rss_kib(server.pid)})

        warm = [s for s in samples if s["t"] <= a.warmup]
        after = [s for s in samples if s["t"] > a.warmup]
        base = warm[-1]["rss_kib"]
        peak = max(s["rss_kib"] for s in after)
        growth = (peak - base) / base
        latencies.sort()
        version = subprocess.run([a.bin, "--version"], capture_output=True, text=True).stdout.strip()
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
        rustc = subprocess.run(["rustc", "--version"], capture_output=True, text=True).stdout.strip()
        result = {
            "command": "python3 bench/soak.py " + " ".join(sys.argv[1:]),
            "commit": commit,
            "versions": {"imajev-serve": version, "rustc": rustc, "python": platform.python_version(),
                         "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"},
            "seconds": a.seconds,
            "clients": a.clients,
            "warmup_seconds": a.warmup,
            "requests": sum(counts.values()),
            "status_counts": {str(k): v for k, v in sorted(counts.items(), key=lambda kv: str(kv[0]))},
            "by_case": {k: {str(s): n for s, n in v.items()} for k, v in sorted(by_case.items())},
            "answered_latency_s": {
                "p50": round(latencies[len(latencies) // 2], 4) if latencies else None,
                "p99": round(latencies[int(len(latencies) * 0.99)], 4) if latencies else None,
                "max": round(latencies[-1], 4) if latencies else None,
            },
            "rss_kib_end_of_warmup": base,
            "rss_kib_peak_after_warmup": peak,
            "rss_growth_after_warmup": round(growth, 4),
            "rss_samples": samples,
            "problems": problems[:50],
            "checks": {
                "memory_flat (growth <= 5% after warm-up)": growth <= 0.05,
                "no 5xx other than 503/504/529, every error JSON": not problems,
            },
        }
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(json.dumps({k: result[k] for k in ("requests", "status_counts", "rss_growth_after_warmup", "checks")}, indent=1))
        sys.exit(0 if all(result["checks"].values()) else 1)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
