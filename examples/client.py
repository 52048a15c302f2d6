#!/usr/bin/env python3
"""A client for imajev-serve's POST /v1/systemone, standard library only, no other files needed.

Sends a text request, a one-image request (the image as a data URL in `images`) and a two-image
request (multipart/form-data: the JSON in `request`, the files under `image`; first = reference,
second = target), and prints the answers. Without --image it draws two small PNGs itself; with
one --image the two-image request is skipped (it says so). Exits 1 if any request is not
answered with HTTP 2xx (or the server cannot be reached), 2 on bad arguments.

    python3 client.py --base-url http://127.0.0.1:8765 [--image a.jpg [--image b.png]] [--key KEY]
"""
import argparse
import base64
import json
import mimetypes
import struct
import sys
import urllib.error
import urllib.request
import uuid
import zlib
from pathlib import Path


def png(width, height, pixel):
    """A truecolour PNG whose pixel (x, y) is the (r, g, b) `pixel` returns."""
    rows = b"".join(b"\x00" + bytes(c for x in range(width) for c in pixel(x, y)) for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def drawn_images():
    """A device with a green screen, then the same device with a red screen and a crack."""
    def device(screen, cracked):
        def pixel(x, y):
            if cracked and abs((x - 40) - (y - 30) // 2) < 1:
                return (20, 20, 20)
            if 24 <= x < 104 and 16 <= y < 80:
                return screen
            return (190, 190, 200)
        return pixel

    return [("reference.png", png(128, 96, device((40, 180, 60), False)), "image/png"),
            ("target.png", png(128, 96, device((200, 40, 40), True)), "image/png")]


def read_image(path):
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        sys.exit(f"client.py: cannot read --image {path}: {e.strerror}")
    return (p.name, data, mimetypes.guess_type(p.name)[0] or "application/octet-stream")


def post(base_url, body, content_type, key=None):
    headers = {"Content-Type": content_type}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/systemone", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw or b"{}")
        except ValueError:
            return e.code, {"body": raw.decode("utf-8", "replace")}
    except (urllib.error.URLError, OSError) as e:
        sys.exit(f"client.py: cannot reach {base_url}: {getattr(e, 'reason', e)}")


def data_url(image):
    _, data, mime = image
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def multipart(request, images):
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\n'
             f"Content-Type: application/json\r\n\r\n".encode() + json.dumps(request).encode() + b"\r\n"]
    for name, data, mime in images:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n'
                     f"Content-Type: {mime}\r\n\r\n".encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", "--url", dest="base_url", default="http://127.0.0.1:8765",
                    help="the server (default %(default)s); --url is the same option")
    ap.add_argument("--image", action="append", default=[], metavar="FILE",
                    help="an image file; give it once or twice (reference, then target)")
    ap.add_argument("--key", help="API key, sent as Authorization: Bearer")
    args = ap.parse_args()
    if len(args.image) > 2:
        ap.error(f"--image was given {len(args.image)} times; a request carries at most two images")
    images = [read_image(p) for p in args.image] or drawn_images()

    failed = []

    def show(title, status, body):
        print(f"\n== {title}: HTTP {status}")
        print(json.dumps(body, indent=2, ensure_ascii=False))
        if not 200 <= status < 300:
            failed.append(f"{title} (HTTP {status})")

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
    show("text", *post(args.base_url, json.dumps(text).encode(), "application/json", args.key))

    one = {
        "model": "jev-latest",
        "state": {"note": "Photo from the reporter"},
        "questions": {"error": {"type": "noul", "instructions": "Does the photo show an error message?",
                                "criteria": {"true": "an error code or warning is visible"}}},
        "images": [data_url(images[0])],
    }
    show("one image (data URL)", *post(args.base_url, json.dumps(one).encode(), "application/json", args.key))

    if len(images) == 2:
        two = {
            "model": "jev-latest",
            "state": {},
            "questions": {"same": {"type": "noul", "instructions": "Do the first and the second photo show the same device?"},
                          "changed": {"type": "multi", "instructions": "What changed between the photos?",
                                      "criteria": {"position": None, "display": "what the screen shows", "damage": None}}},
        }
        body, ctype = multipart(two, images)
        show("two images (multipart)", *post(args.base_url, body, ctype, args.key))
    else:
        print("\n== two images (multipart): skipped, only one --image was given", file=sys.stderr)

    if failed:
        print(f"\nclient.py: not answered: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
