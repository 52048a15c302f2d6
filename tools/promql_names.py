"""The metric names and selector label names a PromQL expression reads, for the deploy checks
(tools/check_deploy.py, tools/check_deploy_metrics.py). A tokeniser, not a parser: no PromQL
parser is on PyPI that this project could pin, and the checks need only the names, which PromQL
writes as identifiers not followed by `(` outside label matchers, grouping clauses and ranges.
"""
import re

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def names(expr: str) -> dict[str, set[str]]:
    """Every metric (or recording rule) the expression selects, with the label names its matchers use."""
    out: dict[str, set[str]] = {}
    # Label matchers first (they hold strings), keeping which metric each belongs to.
    text = ""
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "{":
            j = i + 1
            while j < len(expr) and expr[j] != "}":
                m = _STRING.match(expr, j)
                j = m.end() if m else j + 1
            body = _STRING.sub('""', expr[i + 1 : j])
            labels = set(_LABEL.findall(body))
            before = re.search(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*$", text)
            if before and before.group(1) not in KEYWORDS:
                out.setdefault(before.group(1), set()).update(labels)
            text += " "
            i = j + 1
            continue
        m = _STRING.match(expr, i)
        if m:
            text += '""'
            i = m.end()
            continue
        text += c
        i += 1
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    for m in _IDENT.finditer(text):
        word = m.group(0)
        if word in KEYWORDS or word.startswith("$"):
            continue
        if text[m.start() - 1 : m.start()] == "$":  # a Grafana variable such as $__rate_interval
            continue
        rest = text[m.end() :].lstrip()
        if rest.startswith("("):  # a function
            continue
        if text[m.start() - 1 : m.start()] in set("0123456789."):  # 2e-3, offset 5m
            continue
        if word.lower() in {"inf", "nan"}:
            continue
        out.setdefault(word, set())
    return out
