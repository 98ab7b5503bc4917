"""Latency histograms: buckets as Prometheus counts them, estimates, and the exposition."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvtier.indexer.service.exposition import Family, render
from kvtier.indexer.service.histogram import Histogram


def test_a_value_on_a_bound_counts_in_that_bucket() -> None:
    h = Histogram(bounds=(0.001, 0.01, 0.1))
    for v in (0.0, 0.001, 0.0011, 0.01, 0.5, 7.0):
        h.observe(v)
    h._check()
    assert h.counts == [2, 2, 0, 2]  # le is "less or equal", as Prometheus reads it
    assert h.cumulative() == [(0.001, 2), (0.01, 4), (0.1, 4), (math.inf, 6)]
    assert h.count == 6 and h.max == 7.0 and math.isclose(h.total, 7.5121)


def test_quantiles_are_bucket_upper_bounds() -> None:
    h = Histogram(bounds=(0.001, 0.01, 0.1))
    assert h.quantile(0.99) == 0.0  # nothing observed
    for _ in range(98):
        h.observe(0.0005)
    h.observe(0.05)
    h.observe(3.0)
    assert h.quantile(0.5) == 0.001
    assert h.quantile(0.99) == 0.1  # the 99th of 100 is the 0.05 one
    assert h.quantile(1.0) == 3.0  # past every bound: the largest seen
    d = h.as_dict()
    assert d["buckets"][-1] == [None, 100] and d["p99"] == 0.1 and d["max"] == 3.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=20, allow_nan=False), max_size=50))
def test_counts_agree_with_a_sort(values: list[float]) -> None:
    h = Histogram()
    for v in values:
        h.observe(v)
    h._check()
    for bound, n in h.cumulative():
        assert n == sum(v <= bound for v in values)
    if values:
        q = h.quantile(0.99)
        ranked = sorted(values)[max(1, math.ceil(0.99 * len(values))) - 1]
        assert ranked <= q  # an upper estimate
        assert q == h.max or q in h.bounds


def test_histogram_exposition_reads_back_with_the_reference_parser() -> None:
    h = Histogram(bounds=(0.005, 0.05))
    for v in (0.001, 0.02, 0.02, 9.0):
        h.observe(v)
    fam = Family("kvtier_request_seconds", "histogram", "Time per request.")
    fam.add_histogram(h.as_dict(), endpoint="query")
    fam.add_histogram(Histogram(bounds=(0.005, 0.05)).as_dict(), endpoint="route")
    (parsed,) = text_string_to_metric_families(render([fam]))
    assert parsed.type == "histogram" and parsed.documentation == "Time per request."
    got = {(s.name, s.labels["endpoint"], s.labels.get("le")): s.value for s in parsed.samples}
    assert got[("kvtier_request_seconds_bucket", "query", "0.005")] == 1
    assert got[("kvtier_request_seconds_bucket", "query", "0.05")] == 3
    assert got[("kvtier_request_seconds_bucket", "query", "+Inf")] == 4
    assert got[("kvtier_request_seconds_count", "query", None)] == 4
    assert math.isclose(got[("kvtier_request_seconds_sum", "query", None)], 9.041)
    assert got[("kvtier_request_seconds_count", "route", None)] == 0
