#!/usr/bin/env python3
"""Drives a running imajev-serve with the official TypeSafe Python SDK (`typesafe-sdk`).

Checks, against the server at $URL with key $KEY (run by .ci/run in typesafe contract mode):
  1. a text request whose body is >= 1 KiB, sent zstd-compressed (asserted on the wire);
  2. an image asset placed in the state (multipart: `request` + `asset-0`), referenced by text;
  3. that every answer type parses into the SDK's typed answers.
Exit code 0 on success; prints what it checked.
"""
import os
import sys
from pathlib import Path

import httpx2
from typesafe_sdk import Choice, Image, Noul, RetryPolicy, Score, TypeSafeClient

URL = os.environ.get("URL", "http://127.0.0.1:8765")
KEY = os.environ.get("KEY", "ci-key")
ROOT = Path(__file__).resolve().parents[2]

sent = []


def remember(request):
    sent.append({"encoding": request.headers.get("content-encoding"), "type": request.headers.get("content-type", "")})


def main() -> int:
    http = httpx2.Client(event_hooks={"request": [remember]}, timeout=120)
    client = TypeSafeClient(api_key=KEY, base_url=URL, http_client=http, compression="zstd",
                            retry=RetryPolicy(max_retries=0))
    questions = {
        "refund": Noul(instructions="Is the customer asking for money back?"),
        "team": Choice(instructions="Which team should handle this ticket?",
                       criteria={"Billing": "Payments, invoices, refunds", "Technical": "Bugs and outages",
                                 "Sales": "Pricing and upgrades"}),
        "anger": Score(instructions="How frustrated is the customer?", criteria=["Calm", "Frustrated", "Very angry"]),
    }
    ticket = ("I was charged twice for my March invoice (order #4471) and the refund I was promised last week "
              "still has not arrived. ") * 12
    r = client.system_one(state={"ticket": ticket, "channel": "email"}, questions=questions)
    assert sent[-1]["encoding"] == "zstd", f"the SDK did not compress the body: {sent[-1]}"
    assert r.nouls["refund"] is not None and 0 <= r.nouls["refund"].noul <= 1
    assert r.choices["team"].choice in ("Billing", "Technical", "Sales")
    assert abs(sum(r.choices["team"].probabilities.values()) - 1) < 1e-6
    assert 0 <= r.scores["anger"].score <= 2
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == 0
    print(f"zstd text request: ok ({len(ticket)} chars of state, answers parsed: {sorted(r.answers)})")

    photo = Image(ROOT / "tests/fixtures/golden/images/wide.png")
    r = client.system_one(
        state={"photo": photo, "note": "Customer photo of the printer display"},
        questions={
            "broken": Noul(instructions=f"Does {photo} show an error message?"),
            "device": Choice(instructions="What device is shown?", criteria={"printer": None, "laptop": None, "phone": None}),
        },
    )
    assert sent[-1]["type"].startswith("multipart/form-data"), f"the image was not sent as an asset part: {sent[-1]}"
    assert r.choices["device"].choice in ("printer", "laptop", "phone")
    assert 0 <= r.nouls["broken"].noul <= 1
    print("image asset request: ok (multipart request + asset-0)")
    models = client.models.list() if hasattr(client, "models") else None
    if models is not None:
        names = [m.name for m in models.models]
        assert names, "GET /v1/models listed no model"
        print(f"models: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
