"""Metric names (and the `pool` they are selected from) in PromQL, Grafana and adapter queries.

Good enough for the expressions deploy/ writes, not a PromQL parser: grouping clauses, ranges
and Grafana variables are removed, then every identifier that is not a function, aggregation
or keyword is a metric name, with its `pool="..."` / `pool=~"a|b"` matcher if it has one.
"""

from __future__ import annotations

import re

_KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan", "le"}  # fmt: skip
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTOR = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?(\s*\()?")
_POOL = re.compile(r'\bpool\s*(=~|=)\s*"([^"]*)"')


def selectors(expr: str) -> set[tuple[str, tuple[str, ...] | None]]:
    """{(metric name, pools or None)} of the vector selectors in `expr`."""
    expr = re.sub(r"<<[^>]*>>", "", expr)  # prometheus-adapter templates
    expr = re.sub(r"\$\{?\w+\}?", "x", expr)  # Grafana variables
    expr = _GROUPING.sub(" ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges, subqueries
    found = set()
    for m in _SELECTOR.finditer(expr):
        name, matchers, is_call = m.groups()
        if is_call or name in _KEYWORDS:
            continue
        pools = None
        if matchers and (p := _POOL.search(matchers)):
            pools = tuple(p.group(2).split("|")) if p.group(1) == "=~" else (p.group(2),)
        found.add((name, pools))
    return found


def exported_names(metrics_text: str) -> set[str]:
    """Every series name a scrape can hold: samples, and families without samples yet
    (a labelled counter before its first increment), with their suffixes."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"),
        }.get(family.type, ())
        names.update(family.name + s for s in suffixes)
    return names
