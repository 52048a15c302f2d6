#!/usr/bin/env python3
"""Fails when a metric that the alert rules or the Grafana dashboard read is not exposed.

    python3 tools/check_deploy_metrics.py http://127.0.0.1:8765/metrics

Reads every PromQL expression of deploy/monitoring/rules.yml and of
deploy/monitoring/grafana-dashboard.json (panels and variables), and scrapes the URL (a server
that has answered some requests, so labelled series exist). Each metric name must be a sample
name of the scrape (`imajev_x_bucket` for a histogram's buckets); each name with a colon must be
a recording rule of rules.yml; each label a selector matches on must be a label of that metric,
except those Prometheus adds per target (namespace, pod, job, instance, container, endpoint,
service). Prints what is missing and where it is used; exit 1 if anything is.
"""
import json
import pathlib
import re
import sys
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from promql_names import names  # noqa: E402

import yaml  # noqa: E402  (PyYAML, from .ci/requirements-deploy.txt)

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy/monitoring/rules.yml"
DASHBOARD = ROOT / "deploy/monitoring/grafana-dashboard.json"
TARGET_LABELS = {"namespace", "pod", "job", "instance", "container", "endpoint", "service"}


def expressions():
    """(where, expr) for every PromQL expression the monitoring files hold, and the recording rules."""
    out, records = [], set()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            if "record" in rule:
                records.add(rule["record"])
            out.append((f"rules.yml {group['name']}/{name}", rule["expr"]))
    dash = json.loads(DASHBOARD.read_text())

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"dashboard panel '{p.get('title')}'", t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", q or "")
        if m:
            out.append((f"dashboard variable ${var['name']}", m.group(1)))
    return out, records


def scrape(url):
    """{sample name: set of label names} of a Prometheus text exposition."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s", line)
        if not m:
            continue
        labels = set(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(3) or ""))
        samples.setdefault(m.group(1), set()).update(labels)
    return samples


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    exprs, records = expressions()
    samples = scrape(sys.argv[1])
    missing: dict[str, list[str]] = {}
    bad_labels: dict[str, list[str]] = {}
    used = set()
    for where, expr in exprs:
        for metric, labels in names(expr).items():
            used.add(metric)
            if ":" in metric:
                if metric not in records:
                    missing.setdefault(f"{metric} (no such recording rule in rules.yml)", []).append(where)
                continue
            if metric not in samples:
                missing.setdefault(metric, []).append(where)
                continue
            for label in sorted(labels - TARGET_LABELS - samples[metric]):
                bad_labels.setdefault(f"{metric}{{{label}}}", []).append(where)
    exposed = sorted(m for m in used if ":" not in m and m in samples)
    print(f"{len(exposed)} metrics read by the rules and the dashboard are exposed by {sys.argv[1]}")
    for name, where in sorted(missing.items()):
        print(f"MISSING {name}: used by {', '.join(sorted(set(where)))}")
    for name, where in sorted(bad_labels.items()):
        print(f"NO SUCH LABEL {name}: used by {', '.join(sorted(set(where)))}")
    return 1 if missing or bad_labels else 0


if __name__ == "__main__":
    sys.exit(main())
