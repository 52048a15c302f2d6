#!/usr/bin/env python3
"""The playground page (GET /) in a real browser: Debian's chromium + chromedriver, driven by
Selenium, against a running imajev-serve (.ci/run starts the demo server).

usage: playground.py --url http://127.0.0.1:18765 --screenshots DIR [--key KEY] [--label NAME]
                     [--readme-screenshot FILE]

What it checks, in order:
  1. GET / and the assets carry the Content-Security-Policy; the page loads and reads /v1/models;
  2. the state editor flags invalid JSON as you type, and Send refuses to send it;
  3. a choice and a noul question built with the form, two images attached with the file picker
     (a third is refused on the page), Send: every bar, value and field rendered equals the JSON
     answer, the usage fields equal the JSON usage, and the images' sha256 equal the files';
     with --key, a first Send without the key shows the 401 at the key field;
  4. "Copy as Python" and "Copy as curl" give programs that, run as they are, get the same answers;
  5. two 422s (a choice with one option, a score level without a description): the server's
     message is shown at the field its `loc` names (the criteria of that question, that level);
  6. images dropped on the drop zone are added, a third refused; the key is not kept anywhere
     (storage, cookies, the copied programs); the page made no request outside this server, logged
     no error but the 4xx answers it asked for, and the policy is enforced (eval and innerHTML
     are refused).
Screenshots go to DIR (playground-LABEL-answer.png, playground-LABEL-422.png). Exit code 0 on
success; AssertionError otherwise.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import JavascriptException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

ROOT = Path(__file__).resolve().parents[2]
IMAGES = [ROOT / "tests/fixtures/golden/images/wide.png", ROOT / "tests/fixtures/golden/images/small.png"]
THIRD = ROOT / "tests/fixtures/image/jpeg_420_96x72.jpg"
EXAMPLE_PHOTOS = [ROOT / "src/api/playground/examples/reference.png", ROOT / "src/api/playground/examples/target.png"]
EXPECTED_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; connect-src 'self'; "
                "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; require-trusted-types-for 'script'; "
                "trusted-types 'none'")
# Chromium must not try to reach anything but the server under test.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1000", "--lang=en-US"]


def pick(a, name):
    return a[name] if name in a else a.get("x_" + name)


def check_http(url):
    for path, ctype in [("/", "text/html"), ("/playground/playground.js", "text/javascript"),
                        ("/playground/playground.css", "text/css")]:
        with urllib.request.urlopen(url + path, timeout=30) as r:
            assert r.status == 200, (path, r.status)
            assert r.headers["content-type"].startswith(ctype), (path, r.headers["content-type"])
            assert r.headers["content-security-policy"] == EXPECTED_CSP, (path, r.headers["content-security-policy"])
            assert r.headers["x-content-type-options"] == "nosniff"
    print("ok: GET / and its assets carry the Content-Security-Policy")


def start_browser(user_data_dir):
    opts = webdriver.ChromeOptions()
    for f in CHROMIUM_FLAGS:
        opts.add_argument(f)
    opts.add_argument(f"--user-data-dir={user_data_dir}")
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    service = Service(executable_path=driver_path, log_output=os.path.join(user_data_dir, "chromedriver.log"))
    return webdriver.Chrome(service=service, options=opts)


class Page:
    def __init__(self, driver, url):
        self.d = driver
        self.url = url

    def q(self, css, root=None):
        return (root or self.d).find_element(By.CSS_SELECTOR, css)

    def qa(self, css, root=None):
        return (root or self.d).find_elements(By.CSS_SELECTOR, css)

    def wait(self, cond, timeout=60, what="condition"):
        try:
            return WebDriverWait(self.d, timeout, poll_frequency=0.1).until(lambda d: cond())
        except TimeoutException:
            raise AssertionError(f"timed out waiting for {what}; status: {self.q('#status').text!r}")

    def fill(self, el, text):
        el.clear()
        el.send_keys(text)

    def cards(self):
        return self.qa("#questions .question")

    def card(self, qid):
        for c in self.cards():
            if self.q(".q-id", c).get_attribute("value") == qid:
                return c
        raise AssertionError(f"no question card {qid!r}")

    def send(self, expect_status):
        self.click_send()
        status = self.q("#status").get_attribute("data-http-status")
        assert status == str(expect_status), f"want HTTP {expect_status}, got {status!r}: {self.q('#status').text}"
        return json.loads(self.q("#response-json").get_attribute("textContent"))

    def click_send(self):
        """Clicks Send and waits until the page has finished with it (answered or refused)."""
        seq = int(self.q("#status").get_attribute("data-seq") or 0)
        self.q("#send").click()
        self.wait(lambda: int(self.q("#status").get_attribute("data-seq") or 0) > seq, 180, "the answer")

    def screenshot(self, path):
        height = self.d.execute_script("return document.documentElement.scrollHeight")
        self.d.set_window_size(1400, max(1000, height + 160))
        time.sleep(0.3)
        self.d.save_screenshot(str(path))
        self.d.set_window_size(1400, 1000)
        print(f"ok: screenshot {path}")


def build_request(p):
    """A choice and a noul question, built with the form; two images through the file picker."""
    p.q("#clear-all").click()
    assert p.cards() == [], "Empty request leaves no question"
    # The state editor validates as you type, and Send refuses invalid JSON.
    state = p.q("#state")
    p.fill(state, '{"ticket": "Printer on floor 3 shows E-204"')
    status = p.q("#state-status")
    assert "bad" in status.get_attribute("class") and status.text.startswith("Not valid JSON"), status.text
    p.click_send()
    assert p.q("#status").get_attribute("data-state") == "refused"
    assert p.q("#error-state").text.startswith("Not valid JSON"), p.q("#error-state").text
    assert p.q("#status").get_attribute("data-http-status") == ""
    state.send_keys("}")
    assert "ok" in status.get_attribute("class") and status.text.startswith("Valid JSON: a JSON object with 1 key"), status.text
    print("ok: the state editor flags invalid JSON as you type and Send refuses it")

    p.q("#add-question").click()
    team = p.cards()[-1]
    p.fill(p.q(".q-id", team), "team")
    Select(p.q(".q-type", team)).select_by_value("choice")
    p.fill(p.q(".q-instructions", team), "Which team should handle this ticket?")
    p.q(".q-add-row", team).click()
    rows = p.qa(".criteria-row", team)
    assert len(rows) == 3, len(rows)
    for row, (k, v) in zip(rows, [("infra", "network and firmware"), ("facilities", "broken devices"), ("identity", "")]):
        p.fill(p.q(".c-key", row), k)
        if v:
            p.fill(p.q(".c-desc", row), v)

    p.q("#add-question").click()
    urgent = p.cards()[-1]
    p.fill(p.q(".q-id", urgent), "urgent")
    assert Select(p.q(".q-type", urgent)).first_selected_option.get_attribute("value") == "noul"
    p.fill(p.q(".q-instructions", urgent), "Does the reporter need an answer today?")
    yes, no = p.qa(".criteria-row", urgent)
    p.fill(p.q(".c-desc", yes), "work is blocked")
    p.fill(p.q(".c-desc", no), "it can wait")

    picker = p.q("#image-input")
    picker.send_keys("\n".join(str(i) for i in IMAGES))
    p.wait(lambda: len(p.qa("#image-list .thumb")) == 2, 20, "two thumbnails")
    picker.send_keys(str(THIRD))
    p.wait(lambda: "at most two images" in p.q("#error-images").text, 10, "the third image to be refused")
    assert len(p.qa("#image-list .thumb")) == 2
    roles = [p.q(".role", t).text for t in p.qa("#image-list .thumb")]
    assert roles == ["1 · reference", "2 · target"], roles
    print("ok: a choice and a noul question built; two images attached, a third refused on the page")


def close(a, b, tol=1e-9):
    return abs(float(a) - float(b)) <= tol


def check_bars(p, card, probs, chosen=None):
    rows = p.qa(".bar-row", card)
    assert [r.get_attribute("data-key") for r in rows] == list(probs), ([r.get_attribute("data-key") for r in rows], list(probs))
    for r in rows:
        k = r.get_attribute("data-key")
        v = probs[k]
        assert float(r.get_attribute("data-value")) == v, (k, r.get_attribute("data-value"), v)
        shown = p.q(".bar-value", r).text
        assert shown.endswith("%") and abs(float(shown[:-1]) - v * 100) <= 0.05 + 1e-9, (k, shown, v)
        track = p.q(".bar-track", r).size["width"]
        fill = p.q(".bar-fill", r).size["width"]
        assert track > 50 and abs(fill / track - v) <= 2.0 / track + 1e-6, (k, fill, track, v)
        if chosen is not None:
            assert ("chosen" in r.get_attribute("class").split()) == (k == chosen), (k, chosen)


def check_fact(p, card, field, value, text_check=None):
    dd = p.q(f'dd[data-field="{field}"]', card)
    got = dd.get_attribute("data-value")
    if isinstance(value, bool):
        assert got == ("true" if value else "false"), (field, got, value)
    elif isinstance(value, (int, float)):
        assert float(got) == value, (field, got, value)
    else:
        assert got == (value or ""), (field, got, value)
    if text_check:
        assert text_check(dd.text), (field, dd.text, value)


def check_common(p, card, a):
    u = pick(a, "unknown_probability")
    check_fact(p, card, "unknown_probability", u, lambda t: abs(float(t.split("%")[0]) - u * 100) <= 0.05 + 1e-9)
    ab = pick(a, "abstained")
    check_fact(p, card, "abstained", ab, lambda t: t.startswith("Yes —" if ab else "No —"))
    cal = pick(a, "calibration_version")
    check_fact(p, card, "calibration_version", cal, lambda t: t == cal if cal else t.startswith("none"))
    if "confidence" in a:
        check_fact(p, card, "confidence", a["confidence"], lambda t: abs(float(t) - a["confidence"]) <= 0.0005 + 1e-9)


def check_answers(p, resp, images=IMAGES):
    answers = resp["answers"]
    cards = p.qa("#answers .answer")
    assert [c.get_attribute("data-qid") for c in cards] == list(answers), [c.get_attribute("data-qid") for c in cards]
    for card in cards:
        qid = card.get_attribute("data-qid")
        a = answers[qid]
        assert card.get_attribute("data-type") == a["type"]
        if a["type"] == "choice":
            assert p.q(".chosen-value", card).text == a["choice"]
            check_bars(p, card, a["probabilities"], chosen=a["choice"])
            assert close(sum(a["probabilities"].values()), 1.0, 1e-6)
        elif a["type"] == "noul":
            check_bars(p, card, {"noul": a["noul"]})
            assert abs(float(p.q(".headline-value", card).text[:-1]) - a["noul"] * 100) <= 0.05 + 1e-9
        elif a["type"] == "score":
            check_bars(p, card, {k: a["probabilities"][k] for k in sorted(a["probabilities"], key=int)})
            assert abs(float(p.q(".headline-value", card).text) - a["score"]) <= 0.005 + 1e-9
        else:
            raise AssertionError(f"unexpected answer type {a['type']}")
        check_common(p, card, a)
    usage = resp["usage"]
    for field in ["input_tokens", "processed_tokens", "passes", "rotations", "vision_ms", "prefill_ms", "questions_ms", "total_ms"]:
        td = p.q(f'#usage td[data-field="{field}"]')
        assert float(td.get_attribute("data-value")) == usage[field], (field, td.get_attribute("data-value"), usage[field])
    shown = json.loads(p.q('#usage td[data-field="images"]').get_attribute("data-value"))
    assert shown == usage["images"], (shown, usage["images"])
    want = [hashlib.sha256(i.read_bytes()).hexdigest() for i in images]
    assert [i["sha256"] for i in usage["images"]] == want, "the server got other bytes than the files attached"
    print(f"ok: {len(cards)} answers rendered exactly as the JSON says (bars, chosen option, unknown, abstained, "
          f"confidence, calibration, usage); the images arrived byte for byte")


def run_snippet(p, kind, key, want):
    p.q("#copy-python" if kind == "python" else "#copy-curl").click()
    p.wait(lambda: p.q("#snippet-box").get_attribute("data-kind") == kind and p.q("#snippet-status").text, 20, f"the {kind} snippet")
    code = p.q("#snippet").get_attribute("value")
    if key:
        assert key not in code, f"the API key leaked into the {kind} snippet"
    env = dict(os.environ)
    if key:
        env["IMAJEV_API_KEY"] = key
    cmd = [sys.executable, "-"] if kind == "python" else ["bash", "-e"]
    out = subprocess.run(cmd, input=code, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, (kind, out.returncode, out.stderr[-2000:])
    got = json.loads(out.stdout)
    assert got["answers"] == want["answers"], (kind, got["answers"], want["answers"])
    print(f"ok: 'Copy as {kind}' runs as it is and gets the same answers")


def check_422s(p, label, shots):
    team = p.card("team")
    for btn in p.qa(".criteria-row .c-remove", team)[1:]:
        btn.click()
    assert len(p.qa(".criteria-row", team)) == 1
    resp = p.send(422)
    d = resp["detail"][0]
    assert d["loc"] == ["body", "questions", "team", "criteria"], d
    err = p.q(".q-error-criteria", team)
    assert err.text == d["msg"], (err.text, d["msg"])
    assert "invalid" in p.q(".q-criteria", team).get_attribute("class")
    assert p.q("#error-general").text == "", p.q("#error-general").text
    p.screenshot(shots / f"playground-{label}-422.png")
    print(f"ok: 422 at {'.'.join(map(str, d['loc']))} shown at that question's criteria: {d['msg']!r}")

    # Fix it, then a score whose second level has no description: the error names that level.
    p.q(".q-add-row", team).click()
    p.fill(p.q(".c-key", p.qa(".criteria-row", team)[-1]), "facilities")
    p.q("#add-question").click()
    impact = p.cards()[-1]
    p.fill(p.q(".q-id", impact), "impact")
    Select(p.q(".q-type", impact)).select_by_value("score")
    p.fill(p.q(".q-instructions", impact), "How many people are affected?")
    p.fill(p.q(".c-desc", p.qa(".criteria-row", impact)[0]), "one person")
    resp = p.send(422)
    d = resp["detail"][0]
    assert d["loc"] == ["body", "questions", "impact", "criteria", 1], d
    level1 = p.qa(".criteria-row", impact)[1]
    assert p.q(".c-error", level1).text == d["msg"], (p.q(".c-error", level1).text, d["msg"])
    assert p.q(".c-error", p.qa(".criteria-row", impact)[0]).text == ""
    assert p.q(".q-error-criteria", team).text == "", "an old error stayed on the page"
    print(f"ok: 422 at {'.'.join(map(str, d['loc']))} shown at that level: {d['msg']!r}")
    p.fill(p.q(".c-desc", level1), "the whole office")
    resp = p.send(200)
    assert list(resp["answers"]) == ["team", "urgent", "impact"]
    check_answers(p, resp)


def check_drop_and_policy(p, key):
    # Drop: three files in one drop event; two are kept, the third refused.
    while p.qa("#image-list .thumb"):
        p.q("#image-list .thumb button").click()
    p.d.execute_script("""
        const files = [0, 1, 2].map((i) => new File([new Uint8Array([137, 80, 78, 71, i])], `dropped-${i}.png`, {type: "image/png"}));
        const dt = new DataTransfer();
        files.forEach((f) => dt.items.add(f));
        document.getElementById("dropzone").dispatchEvent(new DragEvent("drop", {dataTransfer: dt, bubbles: true, cancelable: true}));
    """)
    p.wait(lambda: len(p.qa("#image-list .thumb")) == 2, 10, "two dropped images")
    assert "dropped-2.png" in p.q("#error-images").text, p.q("#error-images").text
    print("ok: images dropped on the drop zone are added, a third refused")

    # Nothing is kept: no storage, no cookies.
    kept = p.d.execute_script("return [localStorage.length, sessionStorage.length, document.cookie]")
    assert kept == [0, 0, ""], kept
    # Only this server was asked for anything.
    names = p.d.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
    origin = p.d.execute_script("return location.origin")
    assert names and all(n.startswith(origin + "/") or n.startswith("blob:" + origin) for n in names), names

    # The browser logged no error except the 4xx answers this test asked for.
    asked = re.compile(r"/v1/systemone - Failed to load resource: the server responded with a status of (401|422) ")
    bad = [e for e in p.d.get_log("browser") if e["level"] == "SEVERE" and not asked.search(e["message"])]
    assert not bad, bad

    # The policy is enforced by the browser. (Scripts run through WebDriver bypass script-src, so
    # eval is not a probe; what they insert into the page is still checked.)
    got = p.d.execute_script("""
        return (async () => {
        const violations = [];
        document.addEventListener("securitypolicyviolation", (e) => violations.push(e.violatedDirective));
        const out = {};
        try { document.body.innerHTML = "<b>x</b>"; out.innerHTML = "assigned"; } catch (e) { out.innerHTML = String(e); }
        const s = document.createElement("script");
        s.append(document.createTextNode("window.__inlineRan = true;"));
        try { document.head.append(s); } catch (e) { out.script = String(e); }
        const img = document.createElement("img");
        img.src = "data:image/png;base64,iVBORw0KGgo=";
        document.body.append(img);
        try { await fetch("http://127.0.0.2:9/"); out.fetch = "answered"; } catch (e) { out.fetch = String(e); }
        await new Promise((r) => setTimeout(r, 500));
        out.inlineRan = window.__inlineRan === true;
        out.violations = violations;
        return out;
        })();
    """)
    assert "TrustedHTML" in got["innerHTML"], got
    assert not got["inlineRan"], got
    assert got["fetch"] != "answered", got
    for directive in ("img-src", "connect-src"):
        assert directive in got["violations"], got
    assert any(v in got["violations"] for v in ("require-trusted-types-for", "script-src-elem", "script-src")), got
    print(f"ok: nothing stored, nothing asked of other hosts, no console errors; the policy refused innerHTML, an inline "
          f"script, a data: image and a fetch elsewhere ({', '.join(sorted(set(got['violations'])))})")
    if key:
        p.d.refresh()
        p.wait(lambda: p.q("#model-info").get_attribute("data-model"), 60, "the page to reload")
        assert p.q("#api-key").get_attribute("value") == "", "the key survived a reload"
        print("ok: the key is gone after a reload")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--screenshots", required=True, type=Path)
    ap.add_argument("--key")
    ap.add_argument("--label", default="imajev")
    ap.add_argument("--readme-screenshot", type=Path, help="also save the answered ticket example here")
    args = ap.parse_args()
    url = args.url.rstrip("/")
    args.screenshots.mkdir(parents=True, exist_ok=True)
    check_http(url)
    with tempfile.TemporaryDirectory(prefix="playground-chromium-") as profile:
        driver = start_browser(profile)
        try:
            p = Page(driver, url)
            driver.get(url + "/")
            p.wait(lambda: p.q("#model-info").get_attribute("data-model"), 60, "GET /v1/models")
            assert len(p.cards()) == 4, "the ticket-routing example is loaded at start"
            print(f"ok: the page loaded in Chromium and read /v1/models ({p.q('#model-info').text})")
            if args.readme_screenshot:
                # The photo-comparison example, answered: what the README shows.
                p.q("#example-photos").click()
                p.wait(lambda: len(p.qa("#image-list .thumb img")) == 2 and all(
                    i.get_attribute("naturalWidth") not in (None, "0") for i in p.qa("#image-list .thumb img")), 20, "the example photos")
                if args.key:
                    p.fill(p.q("#api-key"), args.key)
                check_answers(p, p.send(200), images=EXAMPLE_PHOTOS)
                p.screenshot(args.readme_screenshot)

            build_request(p)
            if args.key:
                p.fill(p.q("#api-key"), "")
                resp = p.send(401)
                assert p.q("#error-key").text == resp["detail"]["message"], (p.q("#error-key").text, resp)
                assert "invalid" in p.q("#api-key").get_attribute("class")
                print(f"ok: 401 without the key, shown at the key field: {resp['detail']['message']!r}")
                p.fill(p.q("#api-key"), args.key)
            resp = p.send(200)
            check_answers(p, resp)
            p.screenshot(args.screenshots / f"playground-{args.label}-answer.png")
            run_snippet(p, "python", args.key, resp)
            run_snippet(p, "curl", args.key, resp)
            check_422s(p, args.label, args.screenshots)
            check_drop_and_policy(p, args.key)
        except Exception:
            try:
                driver.save_screenshot(str(args.screenshots / f"playground-{args.label}-failure.png"))
                print(f"failure screenshot: {args.screenshots / f'playground-{args.label}-failure.png'}")
            except Exception:
                pass
            raise
        finally:
            driver.quit()
    print(f"playground browser test ({args.label}): all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
