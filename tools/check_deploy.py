#!/usr/bin/env python3
"""Renders deploy/kubernetes/ and deploy/monitoring/ with kustomize and checks what a schema
cannot: that the pieces fit together and agree with the server and the README.

    python3 tools/check_deploy.py --kubectl KUBECTL --out DIR [--promtool PROMTOOL]

Writes DIR/<name>.yaml for each kustomization (base, overlays/*, download, monitoring) for
kubernetes-validate (.ci/run), then checks in every rendering that has them:
* the Deployment: one nvidia.com/gpu, non-root, no service links (a Service named `imajev`
  would set IMAJEV_PORT), the model volume read-only, the kernel cache (IMAJEV_KERNEL_CACHE)
  on a writable volume, startupProbe /healthz, readinessProbe /v1/models, livenessProbe /livez
  on the container's port, terminationGracePeriodSeconds >= preStop sleep + the drain
  (IMAJEV_REQUEST_TIMEOUT + 5 s, as src/api/server.rs), every IMAJEV_* variable one the README
  documents;
* the Service, PodMonitor and PodDisruptionBudget select the pods, on a port they have;
* the ScaledObject scales this Deployment, its queries select its own namespace and read only
  recording rules of deploy/monitoring/rules.yml; the HPA's external metrics are rules of
  deploy/kubernetes/prometheus-adapter/values.yaml whose series are recording rules too;
* the download Job runs the README's `hf download` commands (models/ as /models/);
* the PrometheusRule's spec is rules.yml;
* with --promtool, every query of the Grafana dashboard parses.
Exit 1 with every failure listed.
"""
import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from promql_names import names  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy/kubernetes"
MON = ROOT / "deploy/monitoring"
RENDER = {
    "base": K8S / "base",
    "overlay-example": K8S / "overlays/example",
    "overlay-example-hpa": K8S / "overlays/example-hpa",
    "download": K8S / "download",
    "monitoring": MON,
}
failures: list[str] = []


def fail(where: str, msg: str) -> None:
    failures.append(f"{where}: {msg}")


def readme_env_vars() -> set[str]:
    return set(re.findall(r"`(IMAJEV_[A-Z0-9_]+)", (ROOT / "README.md").read_text()))


def recording_rules() -> set[str]:
    rules = yaml.safe_load((MON / "rules.yml").read_text())
    return {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def check_deployment(where: str, objs: list[dict]) -> None:
    deps = [o for o in objs if o["kind"] == "Deployment"]
    if len(deps) != 1:
        fail(where, f"expected one Deployment, found {len(deps)}")
        return
    dep = deps[0]
    ns = dep["metadata"].get("namespace")
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    labels = pod["metadata"].get("labels", {})
    if not selects(dep["spec"]["selector"]["matchLabels"], labels):
        fail(where, "the Deployment's selector does not select its own pods")
    if "replicas" in dep["spec"]:
        fail(where, "the Deployment sets replicas, which the autoscaler owns (kubectl apply would reset it)")
    if spec.get("enableServiceLinks") is not False:
        fail(where, "enableServiceLinks must be false (service links set IMAJEV_*_PORT variables)")
    sc = spec.get("securityContext", {})
    if not sc.get("runAsNonRoot") or not sc.get("runAsUser"):
        fail(where, "the pod must run as a non-root user (runAsNonRoot and runAsUser)")
    cms = {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    documented = readme_env_vars()
    containers = {c["name"]: c for c in spec["containers"]}
    server = containers.get("imajev-serve")
    if server is None:
        fail(where, "no container named imajev-serve")
        return
    env: dict[str, str] = {}
    for c in spec.get("initContainers", []) + spec["containers"]:
        for ref in c.get("envFrom", []):
            name = ref.get("configMapRef", {}).get("name")
            if name not in cms:
                fail(where, f"container {c['name']} reads the ConfigMap {name}, which is not rendered")
                continue
            if c is server:
                env.update(cms[name])
        for e in c.get("env", []):
            if c is server and "value" in e:
                env[e["name"]] = e["value"]
    for var in sorted(env):
        if var.startswith("IMAJEV_") and var not in documented:
            fail(where, f"{var} is set but the README documents no such variable")
    gpu = server.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if str(gpu) != "1":
        fail(where, f"the server container must have limits nvidia.com/gpu: 1, has {gpu!r}")
    ports = {p.get("name"): p["containerPort"] for p in server.get("ports", [])}
    port_env = int(env.get("IMAJEV_PORT", 8765))
    if port_env not in ports.values():
        fail(where, f"the server listens on {port_env} (IMAJEV_PORT, the image's default) but the container declares {ports}")
    for probe, path in [("startupProbe", "/healthz"), ("readinessProbe", "/v1/models"), ("livenessProbe", "/livez")]:
        p = server.get(probe, {}).get("httpGet")
        if not p or p.get("path") != path:
            fail(where, f"{probe} must GET {path}, is {p}")
        elif p.get("port") not in ports and p.get("port") not in ports.values():
            fail(where, f"{probe} asks port {p.get('port')}, which the container does not declare")
    mounts = {m["mountPath"]: m for m in server.get("volumeMounts", [])}
    models = [m for m in mounts.values() if m["name"] in volumes and "persistentVolumeClaim" in volumes[m["name"]] and m["mountPath"] == "/models"]
    if not models or not models[0].get("readOnly"):
        fail(where, "the model volume must be mounted read-only at /models (runtime/serve.env's paths)")
    cache = env.get("IMAJEV_KERNEL_CACHE")
    if not cache:
        fail(where, "IMAJEV_KERNEL_CACHE is not set: the kernel cache would land in the (read-only) root filesystem")
    else:
        under = [m for p, m in mounts.items() if cache == p or cache.startswith(p.rstrip("/") + "/")]
        if not under or under[0].get("readOnly"):
            fail(where, f"IMAJEV_KERNEL_CACHE={cache} is not on a writable volume mount")
    # The drain: preStop, then SIGTERM and up to request timeout + 5 s (src/api/server.rs).
    pre = server.get("lifecycle", {}).get("preStop", {})
    cmd = pre.get("exec", {}).get("command", [])
    sleep = int(cmd[-1]) if cmd and cmd[0].endswith("sleep") else int(pre.get("sleep", {}).get("seconds", 0))
    if not pre:
        fail(where, "the server container has no preStop hook")
    timeout = int(env.get("IMAJEV_REQUEST_TIMEOUT", 120))
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if grace < sleep + timeout + 5:
        fail(where, f"terminationGracePeriodSeconds {grace} < preStop {sleep} s + request timeout {timeout} s + 5 s")
    for probe in ("startupProbe",):
        p = server.get(probe, {})
        budget = p.get("periodSeconds", 10) * p.get("failureThreshold", 3)
        if budget < 600:
            fail(where, f"the startupProbe allows {budget} s for the model load, less than 10 minutes")
    # Who selects the pods.
    for o in objs:
        kind, name = o["kind"], o["metadata"]["name"]
        if kind == "Service":
            if not selects(o["spec"]["selector"], labels):
                fail(where, f"Service {name} does not select the pods")
            for p in o["spec"]["ports"]:
                if p.get("targetPort") not in ports and p.get("targetPort") not in ports.values():
                    fail(where, f"Service {name} targets port {p.get('targetPort')}, not a container port")
        elif kind == "PodMonitor":
            if not selects(o["spec"]["selector"].get("matchLabels"), labels):
                fail(where, f"PodMonitor {name} does not select the pods")
            for ep in o["spec"]["podMetricsEndpoints"]:
                if ep.get("port") not in ports or ep.get("path", "/metrics") != "/metrics":
                    fail(where, f"PodMonitor {name} scrapes {ep}, not the port {list(ports)} /metrics")
        elif kind == "PodDisruptionBudget":
            if not selects(o["spec"]["selector"].get("matchLabels"), labels):
                fail(where, f"PodDisruptionBudget {name} does not select the pods")
        elif kind == "ScaledObject":
            check_scaledobject(where, o, dep, ns)
        elif kind == "HorizontalPodAutoscaler":
            check_hpa(where, o, dep)
    kinds = {o["kind"] for o in objs}
    for need in ("Service", "PodMonitor", "PodDisruptionBudget"):
        if need not in kinds:
            fail(where, f"no {need}")
    if not kinds & {"ScaledObject", "HorizontalPodAutoscaler"}:
        fail(where, "neither a ScaledObject nor a HorizontalPodAutoscaler")
    if {"ScaledObject", "HorizontalPodAutoscaler"} <= kinds:
        fail(where, "both a ScaledObject and a HorizontalPodAutoscaler: they would fight over the replicas")


def check_scaledobject(where: str, so: dict, dep: dict, ns: str) -> None:
    name = so["metadata"]["name"]
    if so["spec"]["scaleTargetRef"]["name"] != dep["metadata"]["name"]:
        fail(where, f"ScaledObject {name} scales {so['spec']['scaleTargetRef']['name']}, not the Deployment")
    if so["spec"].get("minReplicaCount", 0) < 1:
        fail(where, f"ScaledObject {name} may scale to zero; a pod needs minutes to load")
    records = recording_rules()
    for t in so["spec"]["triggers"]:
        q = t["metadata"]["query"]
        for metric, labels in names(q).items():
            if metric not in records:
                fail(where, f"ScaledObject trigger {t.get('name')} reads {metric}, not a recording rule of rules.yml")
        selected = set(re.findall(r'namespace="([^"]*)"', q))
        if selected != {ns}:
            fail(where, f"ScaledObject trigger {t.get('name')} selects namespace {sorted(selected)}, but it is in {ns!r}")


def check_hpa(where: str, hpa: dict, dep: dict) -> None:
    ref = hpa["spec"]["scaleTargetRef"]
    if ref["kind"] != "Deployment" or ref["name"] != dep["metadata"]["name"]:
        fail(where, f"the HPA scales {ref}, not the Deployment")
    adapter = yaml.safe_load((K8S / "prometheus-adapter/values.yaml").read_text())
    served = {}
    for rule in adapter["rules"]["external"]:
        served[rule["name"]["as"]] = rule
    records = recording_rules()
    for m in hpa["spec"]["metrics"]:
        if m["type"] != "External":
            fail(where, f"HPA metric of type {m['type']}: only the adapter's external metrics are set up")
            continue
        metric = m["external"]["metric"]["name"]
        rule = served.get(metric)
        if rule is None:
            fail(where, f"the HPA reads {metric}, which prometheus-adapter/values.yaml does not serve")
            continue
        for expr in (rule["seriesQuery"], rule["metricsQuery"].replace("<<.LabelMatchers>>", 'namespace="x"')):
            for used in names(expr):
                if used not in records:
                    fail(where, f"adapter metric {metric} reads {used}, not a recording rule of rules.yml")


def check_download(where: str, objs: list[dict]) -> None:
    jobs = [o for o in objs if o["kind"] == "Job"]
    if len(jobs) != 1:
        fail(where, f"expected one Job, found {len(jobs)}")
        return
    spec = jobs[0]["spec"]["template"]["spec"]
    script = "\n".join(a for c in spec.get("initContainers", []) for a in c.get("args", []))
    got = [re.sub(r"^\S*/hf ", "hf ", line.strip()) for line in script.splitlines() if re.search(r"/hf download ", line)]
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Serving the real model", 1)[1].split("\n## ", 1)[0]
    want = [line.strip().replace(" models/", " /models/") for line in section.splitlines() if line.startswith("hf download ")]
    if not want or got != want:
        fail(where, f"the Job's downloads {got} are not the README's {want} (models/ as /models/)")
    verify = [c for c in spec["containers"] if "verify" in c.get("args", [])]
    if not verify:
        fail(where, "no container runs `verify` on what was downloaded")


def check_monitoring(where: str, objs: list[dict]) -> None:
    rules = yaml.safe_load((MON / "rules.yml").read_text())
    prs = [o for o in objs if o["kind"] == "PrometheusRule"]
    if len(prs) != 1 or prs[0]["spec"] != rules:
        fail(where, "the PrometheusRule's spec is not rules.yml (python3 tools/gen_prometheusrule.py)")
    dash = [o for o in objs if o["kind"] == "ConfigMap" and "grafana-dashboard.json" in o.get("data", {})]
    if len(dash) != 1 or json.loads(dash[0]["data"]["grafana-dashboard.json"]) != json.loads((MON / "grafana-dashboard.json").read_text()):
        fail(where, "no ConfigMap holds grafana-dashboard.json")


def check_dashboard_promql(promtool: str) -> None:
    """Every dashboard query, with its Grafana variables filled in, must parse: promtool checks
    them as the expressions of a throwaway rules file."""
    dash = json.loads((MON / "grafana-dashboard.json").read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend((p.get("title"), t["expr"]) for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    fill = {"$__rate_interval": "5m", "$namespace": "imajev", "$pod": ".*"}
    rules = []
    for i, (title, expr) in enumerate(exprs):
        for k, v in fill.items():
            expr = expr.replace(k, v)
        if "$" in expr:
            fail("dashboard", f"panel '{title}' uses a variable this check does not know: {expr}")
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
        f.flush()
        r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    if r.returncode != 0:
        fail("dashboard", f"promtool rejects a panel query: {r.stdout.strip()} {r.stderr.strip()}")
    else:
        print(f"dashboard: {len(rules)} panel queries parse (promtool)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kubectl", default="kubectl", help="kubectl with its built-in kustomize")
    ap.add_argument("--out", required=True, type=pathlib.Path, help="folder for the rendered manifests")
    ap.add_argument("--promtool", help="promtool, to check that every dashboard query parses")
    args = ap.parse_args()
    if args.promtool:
        check_dashboard_promql(args.promtool)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, path in RENDER.items():
        r = subprocess.run([args.kubectl, "kustomize", str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            fail(name, f"kubectl kustomize {path.relative_to(ROOT)} failed: {r.stderr.strip()}")
            continue
        (args.out / f"{name}.yaml").write_text(r.stdout)
        objs = [o for o in yaml.safe_load_all(r.stdout) if o]
        print(f"{name}: {len(objs)} objects ({', '.join(sorted(o['kind'] for o in objs))})")
        if name == "download":
            check_download(name, objs)
        elif name == "monitoring":
            check_monitoring(name, objs)
        else:
            check_deployment(name, objs)
    for f in failures:
        print(f"FAIL {f}")
    print("deploy checks: " + ("all passed" if not failures else f"{len(failures)} failed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
