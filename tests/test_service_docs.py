"""docs/outputs.md, "The indexer service's answers", has a row for every field the service answers: the answers of a
real service (every endpoint over HTTP: a window-aware worker, a routed request with an SLO and its reports, a
snapshot that failed, stores of another block size, an event loop that died) and of a disaggregated pool's /route
(built, not started: its index fed directly) are walked for their key names, and each must be named in the first
cell of a table row of its endpoint's part of the section; so must every Prometheus family /metrics exports."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.indexer.service.app import IndexerService, ServiceConfig, parse_endpoint
from kvtier.wire import BlockStored, EventBatch, Publisher
from tests.test_service import BS, TOKS, get, replaced_by_a_directory, stored, wait_for
from tests.test_service_disagg import PROMPT, W, _service, _store
from tests.test_service_http import refuse_subscriptions
from tests.test_service_limits import call

DOC = (Path(__file__).resolve().parent.parent / "docs" / "outputs.md").read_text()
TITLE = "## The indexer service's answers"
# The section's parts, by heading; "" is the text before the first.
QUERY, ROUTE, ERRORS, HEALTH = "### `POST /query`", "### `POST /route`", "### Errors", "### `GET /health`"
REPORTS = "### `POST /requests/{id}/first_token` and `POST /requests/{id}/finish`"
JSON_METRICS, PROMETHEUS = "### `GET /metrics?format=json`", "### `GET /metrics`"
WORKERS = {str(w) for w in W} | {"w0"}  # worker names: keys that are data, not schema


def _parts() -> dict[str, str]:
    start = DOC.index(TITLE)
    end = DOC.find("\n## ", start + 1)
    section = DOC[start + len(TITLE):end if end > 0 else None]
    parts: dict[str, str] = {}
    for i, chunk in enumerate(section.split("\n### ")):
        heading, _, body = chunk.partition("\n")
        parts["" if i == 0 else f"### {heading.strip()}"] = body
    return parts


def _documented(*headings: str) -> set[str]:
    """Every name backquoted in the first cell of a table row of those parts, a dotted path's each step."""
    parts = _parts()
    names: set[str] = set()
    for heading in headings:
        assert heading in parts, f"docs/outputs.md has no {heading!r} under {TITLE!r}"
        for line in parts[heading].splitlines():
            if line.startswith("| ") and not line.startswith("|---"):
                for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
                    names.update(name.split("."))
    return names


def _keys(answer: Any) -> set[str]:
    """Every key of a JSON answer, at any depth, but worker names (keys of a map by worker)."""
    if isinstance(answer, dict):
        own = {k for k in answer if k not in WORKERS}
        return own.union(*(_keys(v) for v in answer.values()))
    if isinstance(answer, list):
        return set().union(*(_keys(v) for v in answer))
    return set()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A started service's answers, by endpoint: goodput with a capacity (a TPOT predicted), window KV inferred
    (``window_tokens``), a snapshot every 0.1 s."""
    snap = tmp_path_factory.mktemp("docs") / "idx.snap"
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    svc = IndexerService(ServiceConfig(endpoints=[parse_endpoint(f"w0={pub.endpoint},replay={pub.replay_endpoint}")],
                                       block_size=BS, listen="127.0.0.1:0", policy="goodput", capacity_tokens=100_000,
                                       window_tokens=2 * BS, snapshot_path=str(snap), snapshot_interval_s=0.1,
                                       replay_timeout_s=1.0))
    svc.start()
    out: dict[str, Any] = {}
    try:
        pub.publish(EventBatch(ts=time.time(), events=[stored([1, 2, 3, 4, 5, 6], None, 0),
                                                       stored([7, 8], 6, 6, "EXTERNAL")]))

        def query() -> dict[str, Any]:
            code, body, _ = call(svc, "POST", "/query", {"token_ids": TOKS})
            assert code == 200, body
            return dict(body)

        wait_for(lambda: (w := query()["workers"]["w0"])["raw"]["device"] == 6 and not w["recovering"])
        out["query"] = query()
        slo = {"ttft_ms": 500.0, "tpot_ms": 50.0}
        code, out["route"], _ = call(svc, "POST", "/route", {"token_ids": TOKS, "request_id": "r1", "slo": slo})
        assert code == 200, out["route"]
        code, out["first_token"], _ = call(svc, "POST", "/requests/r1/first_token")
        assert code == 200, out["first_token"]
        code, out["finish"], _ = call(svc, "POST", "/requests/r1/finish", {"output_tokens": 8})
        assert code == 200, out["finish"]
        code, out["error"], _ = call(svc, "POST", "/query", {"token_ids": "not a list"})
        assert code == 400, out["error"]
        # A snapshot that cannot be written (the rename over a directory fails), and stores of another block size.
        wait_for(snap.exists)
        wait_for(lambda: replaced_by_a_directory(snap))
        pub.publish(EventBatch(ts=time.time(), events=[
            BlockStored(block_hashes=[99], parent_block_hash=None, token_ids=TOKS[:2 * BS], block_size=2 * BS,
                        medium="GPU")]))
        wait_for(lambda: {"snapshot_error", "wrong_block_size_workers"} <= set(svc.health()))
        code, out["health"], _ = call(svc, "GET", "/health")
        assert code == 200 and out["health"]["status"] == "degraded", out["health"]
        code, out["metrics"], _ = call(svc, "GET", "/metrics?format=json")
        assert code == 200
        out["prometheus"] = get(svc.address + "/metrics")
        snap.rmdir()
        yield out
    finally:
        svc.stop()
        pub.close()


@pytest.fixture(scope="module")
def pair() -> dict[str, Any]:
    """A disaggregated pool's /route answer (goodput, with a capacity and an SLO)."""
    svc = _service("goodput", capacity_tokens=100_000)
    _store(svc, W[1], 64)
    _store(svc, W[2], 32)
    return svc.route({"token_ids": PROMPT, "request_id": "r", "slo": {"ttft_ms": 500.0, "tpot_ms": 50.0}})


def test_every_query_field_is_documented(served: dict[str, Any]) -> None:
    keys = _keys(served["query"])
    assert {"total_blocks", "raw", "window_inferred", "window_kv", "costs"} <= keys  # what the setup must give
    assert keys - _documented(QUERY) == set()


def test_every_route_field_is_documented(served: dict[str, Any], pair: dict[str, Any]) -> None:
    """An aggregated answer has every field of /query's beside its own; a pair's, /query's answer per pool."""
    keys = _keys(served["route"]) | _keys(pair)
    assert {"meets_slo", "tpot_ms", "local_prefill", "role", "prefill", "decode"} <= keys
    assert keys - _documented(QUERY, ROUTE) == set()


def test_every_report_field_is_documented(served: dict[str, Any]) -> None:
    keys = _keys(served["first_token"]) | _keys(served["finish"])
    assert {"in_flight", "observed_ttft_ms", "was_in_flight", "observed_tpot_ms"} <= keys
    assert keys - _documented(REPORTS) == set()


def test_every_error_field_is_documented(served: dict[str, Any]) -> None:
    assert _keys(served["error"]) - _documented(ERRORS) == set()


def test_every_health_field_is_documented(served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Degraded (a snapshot failed, another block size), and down: an event loop that died as it started."""
    refuse_subscriptions(monkeypatch)
    s = IndexerService(ServiceConfig(endpoints=[parse_endpoint("a=tcp://127.0.0.1:1")], listen="127.0.0.1:0"))
    s.start()
    try:
        wait_for(s.failed.is_set)
        code, down, _ = call(s, "GET", "/health")
    finally:
        s.stop()
    assert code == 503 and down["status"] == "down"
    keys = _keys(served["health"]) | _keys(down)
    assert {"restored_from", "snapshot_error", "wrong_block_size_workers", "block_size_error", "error"} <= keys
    assert keys - _documented(HEALTH) == set()


def test_every_json_metric_is_documented(served: dict[str, Any]) -> None:
    keys = _keys(served["metrics"])
    assert {"latency", "p99", "abs_error_seconds", "blocks", "gaps", "apply_lag_seconds"} <= keys
    assert keys - _documented(JSON_METRICS) == set()


def test_every_prometheus_family_is_documented(served: dict[str, Any]) -> None:
    families = set(re.findall(r"^# TYPE (\S+) ", served["prometheus"], re.MULTILINE))
    assert {"kvtier_blocks", "kvtier_gaps_total", "kvtier_request_seconds"} <= families
    assert families - _documented(PROMETHEUS) == set()
