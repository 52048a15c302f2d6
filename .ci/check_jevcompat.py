#!/usr/bin/env python3
"""Judges a jevcompat JSON report for .ci/run.

usage: check_jevcompat.py REPORT.json MODE EXIT_CODE
  typesafe mode: every MUST and every SHOULD must pass (jevcompat exit code 0).
  imajev mode:   every MUST must pass; SHOULD failures are allowed only for the requirements
                 imajev mode breaks on purpose (listed below and in the README).
"""
import json
import sys

# imajev-mode answers keep imajev's unprefixed fields, imajev accepts a missing state as {}
# requires instructions on every question and uses its own confidence (concentration × (1 − unknown)).
IMAJEV_DELIBERATE = {"response.extensions", "errors.reject-invalid", "noul.no-instructions", "confidence.formula"}


def main() -> int:
    path, mode, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
    report = json.load(open(path))
    if report.get("aborted"):
        print(f"jevcompat aborted: {report['aborted']}")
        return 1
    summary = report["summary"]
    failed = {r["id"]: r for r in report["results"] if r.get("status") == "fail"}
    musts = [i for i, r in failed.items() if r.get("level") == "MUST"]
    shoulds = [i for i, r in failed.items() if r.get("level") == "SHOULD"]
    print(f"{mode}: MUST {summary['MUST']['passed']}/{summary['MUST']['tested']}, "
          f"SHOULD {summary['SHOULD']['passed']}/{summary['SHOULD']['tested']}; failed: {sorted(failed) or 'none'}")
    if report.get("inconclusive"):
        print(f"inconclusive cases: {report['inconclusive']}")
        return 1
    if musts:
        print(f"MUST failures: {musts}")
        return 1
    if mode == "typesafe" and (shoulds or rc != 0):
        print(f"typesafe mode must pass every SHOULD (exit code {rc}): {shoulds}")
        return 1
    unexpected = sorted(set(shoulds) - IMAJEV_DELIBERATE)
    if mode == "imajev" and unexpected:
        print(f"unexpected SHOULD failures in imajev mode: {unexpected}")
        return 1
    if summary.get("untested_musts"):
        print(f"MUSTs not tested: {summary['untested_musts']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
