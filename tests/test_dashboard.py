"""deploy/grafana/ppserver.json: every query names metrics a real server exports (scraped from its
--metrics endpoint while an epoch runs and a worker is killed, so that the ETA and the departures
have values), and the panels the dashboard is for are there."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from typing import List, Set

import pytest
from conftest import REPO, SLOW_MAPPER, free_port, numpy_config, run_server

DASHBOARD = os.path.join(REPO, "deploy", "grafana", "ppserver.json")

# PromQL's own words (functions, aggregations, keywords) that may stand where a metric name could
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "delta", "deriv", "topk", "bottomk",
    "label_values", "histogram_quantile", "clamp_min", "clamp_max", "abs", "and", "or", "unless",
    "bool", "offset", "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "time", "vector",
}  # fmt: skip


def queries(dashboard: dict) -> List[str]:
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            found.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return found


def metric_names(expr: str) -> Set[str]:
    """The metric names in a query: what is left of its identifiers without label matchers, ranges,
    grouping clauses, strings and PromQL's own words."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"label_values\(([^,)]*),[^)]*\)", r"\1", text)  # label_values(metric, label)
    return {word for word in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text) if word not in PROMQL_WORDS}


def exported(port: int) -> Set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    return {f.name for f in families} | {s.name for f in families for s in f.samples}


@pytest.mark.processes
def test_every_dashboard_query_names_exported_metrics(tmp_path):
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exprs = queries(dashboard)
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.05), n=120, extra="buf_size = 2\n")
    port = free_port()
    names: Set[str] = set()
    with run_server(cfg, workers=2, extra=["--metrics", f"127.0.0.1:{port}"]) as srv, srv.client() as c:
        worker = srv.worker_pids()[0]
        for n, _ in enumerate(c.epoch(1)):  # scraped while the epoch runs (its ETA known), a worker killed
            if n == 30:
                os.kill(worker, signal.SIGKILL)  # a departure, and the seqs it held redone
            if n % 10 == 9:
                names |= exported(port)
        names |= exported(port)
        assert c.status()["departures"].get("exited") == 1  # the kill landed while the epoch ran
    assert {"ppserver_eta_seconds", "ppserver_worker_departures_total", "ppserver_held_back"} <= names
    for expr in exprs:
        used = metric_names(expr)
        assert used, f"no metric in {expr!r}"
        assert used <= names, f"{expr!r} names {sorted(used - names)}, which the server does not export"


@pytest.mark.unit
def test_dashboard_shows_what_it_is_for():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    used = set().union(*(metric_names(e) for e in queries(dashboard)))
    for metric in (
        "ppserver_rate_seqs_per_second",  # rate
        "ppserver_eta_seconds",  # ETA
        "ppserver_stage_seconds_total",  # per-stage time
        "ppserver_held_back",  # which side holds the epoch back
        "ppserver_workers",  # workers per host
        "ppserver_reassigned_total",  # reassignments
    ):
        assert metric in used, metric
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
