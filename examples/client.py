#!/usr/bin/env python3
"""A client for imajev-serve's POST /v1/systemone, standard library only.

Sends a text request, a one-image request (image as a data URL in `images`) and a two-image
request (multipart/form-data: the JSON in `request`, files under `image`), and prints the answers.

    python3 examples/client.py --url http://127.0.0.1:8765 [--image a.jpg] [--image b.png] [--key KEY]
"""
import argparse
import base64
import json
import mimetypes
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_IMAGES = [HERE.parent / "tests/fixtures/golden/images/wide.png", HERE.parent / "tests/fixtures/golden/images/tall.png"]


def post(url, body, content_type, key=None):
    headers = {"Content-Type": content_type}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url.rstrip("/") + "/v1/systemone", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def data_url(path):
    mime = mimetypes.guess_type(str(path))[0] or "application/octet-stream"
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()


def multipart(request, files):
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\n'
             f"Content-Type: application/json\r\n\r\n".encode() + json.dumps(request).encode() + b"\r\n"]
    for path in files:
        mime = mimetypes.guess_type(str(path))[0] or "application/octet-stream"
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{Path(path).name}"\r\n'
                     f"Content-Type: {mime}\r\n\r\n".encode() + Path(path).read_bytes() + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def show(title, status, body):
    print(f"\n== {title}: HTTP {status}")
    print(json.dumps(body, indent=2, ensure_ascii=False))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8765")
    ap.add_argument("--image", action="append", help="image file (give up to two; defaults to the test images)")
    ap.add_argument("--key", help="API key, sent as Authorization: Bearer")
    args = ap.parse_args()
    images = [Path(p) for p in (args.image or DEFAULT_IMAGES)][:2]

    text = {
        "model": "jev-latest",
        "state": {"ticket": "Printer on floor 3 shows E-204 after the firmware update", "reporter": "Zoë"},
        "questions": {
            "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
                     "criteria": {"infra": "network problems", "facilities": "broken devices", "identity": "accounts"}},
            "urgent": {"type": "noul", "instructions": "Does the reporter need an answer today?"},
            "impact": {"type": "score", "instructions": "How many people are affected?",
                       "criteria": ["one person", "a team", "the whole office"]},
        },
    }
    show("text", *post(args.url, json.dumps(text).encode(), "application/json", args.key))

    one = {
        "model": "jev-latest",
        "state": {"note": "Photo from the reporter"},
        "questions": {"error": {"type": "noul", "instructions": "Does the photo show an error message?",
                                "criteria": {"true": "an error code or warning is visible"}}},
        "images": [data_url(images[0])],
    }
    show("one image (data URL)", *post(args.url, json.dumps(one).encode(), "application/json", args.key))

    two = {
        "model": "jev-latest",
        "state": {},
        "questions": {"same": {"type": "noul", "instructions": "Do the first and the second photo show the same device?"},
                      "changed": {"type": "multi", "instructions": "What changed between the photos?",
                                  "criteria": {"position": None, "display": "what the screen shows", "damage": None}}},
    }
    body, ctype = multipart(two, images)
    show("two images (multipart)", *post(args.url, body, ctype, args.key))


if __name__ == "__main__":
    sys.exit(main())
