"""SLO-aware routing in the service: /route takes a request's SLO and answers its predicted TTFT and TPOT; the
first-token and finish reports give the observed values, and /metrics the prediction errors."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.indexer.service.app import IndexerService, ServiceConfig, parse_endpoint
from kvtier.wire import BlockStored, WorkerId
from kvtier.wire.notices import StreamId

BS = 16
W0, W1 = StreamId(WorkerId("w0")), StreamId(WorkerId("w1"))
PROMPT = list(range(1000, 1000 + 256 * BS))  # 256 blocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    """The routed requests' clock of :func:`svc`'s service."""
    return Clock()


def _service(clock: Clock, **settings: object) -> IndexerService:
    """Two workers (not started: no sockets); w0 holds PROMPT's blocks on device and decodes a big batch."""
    eps = [parse_endpoint(f"w{i}=tcp://127.0.0.1:{i + 1}") for i in range(2)]
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", **settings),  # type: ignore[arg-type]
                         request_clock=clock)
    svc.index.apply(W0, BlockStored(block_hashes=list(range(1, 257)), parent_block_hash=None, token_ids=PROMPT,
                                    block_size=BS, medium="GPU"))
    svc.loads.add("batch", W0, [], 60_000, 0)  # 60,000 tokens of context decoding on w0
    svc.loads.prefill_done("batch")
    return svc


@pytest.fixture
def svc(clock: Clock) -> IndexerService:
    return _service(clock, policy="goodput", capacity_tokens=100_000)


def test_a_requests_slo_steers_the_goodput_policy(svc: IndexerService, clock: Clock) -> None:
    """Without an SLO the goodput policy is min_ttft: w0, where the prompt is cached whole. Told a TPOT bound that
    w0's big batch would break, it sends the request to the idle w1; the answer says what it predicted."""
    plain = svc.route({"token_ids": PROMPT, "request_id": "a"})
    assert plain["worker"] == "w0" and "meets_slo" not in plain["predicted"]
    step = plain["predicted"]["tpot_ms"]
    assert step > 20  # w0's decode step at 60% of its memory
    bounded = svc.route({"token_ids": PROMPT, "request_id": "b", "slo": {"tpot_ms": 15.0}})
    assert bounded["worker"] == "w1" and bounded["predicted"]["meets_slo"] is True
    assert bounded["predicted"]["tpot_ms"] < 15.0 < step
    hopeless = svc.route({"token_ids": list(range(9000, 9000 + 64 * BS)), "request_id": "c", "slo": {"ttft_ms": 1e-3}})
    assert hopeless["predicted"]["meets_slo"] is False


def test_reports_feed_back_the_observed_latencies_and_metrics_export_the_errors(svc: IndexerService,
                                                                                 clock: Clock) -> None:
    routed = svc.route({"token_ids": PROMPT[:64], "request_id": "r"})
    predicted = routed["predicted"]
    clock.now += 0.250
    assert svc.first_token("r")["observed_ttft_ms"] == pytest.approx(250.0)
    assert "observed_ttft_ms" not in svc.first_token("r")  # (a repeated report is not a second observation)
    clock.now += 1.0
    done = svc.finish("r", {"output_tokens": 41})
    assert done["observed_tpot_ms"] == pytest.approx(25.0)
    p = svc.metrics()["predictions"]
    assert p["ttft"]["abs_error_seconds"]["count"] == 1 and p["tpot"]["abs_error_seconds"]["count"] == 1
    assert p["ttft"]["mean_signed_error_seconds"] == pytest.approx(0.250 - predicted["ttft_ms"] / 1000)
    assert p["tpot"]["mean_signed_error_seconds"] == pytest.approx(0.025 - predicted["tpot_ms"] / 1000)
    families = {f.name: f for f in text_string_to_metric_families(svc.metrics_text())}
    hist = families["kvtier_tpot_prediction_error_seconds"]
    assert [s.value for s in hist.samples if s.name.endswith("_count")] == [1.0]
    assert families["kvtier_ttft_prediction_bias_seconds"].samples[0].value == pytest.approx(
        0.250 - predicted["ttft_ms"] / 1000)
    assert len(svc.predictions) == 0  # forgotten at finish: bounded by the bookings in flight


def test_without_a_capacity_there_is_no_tpot_prediction(clock: Clock) -> None:
    s = _service(clock, policy="kv_all")
    out = s.route({"token_ids": PROMPT, "request_id": "a", "slo": {"ttft_ms": 500.0}})
    assert out["predicted"]["tpot_ms"] is None and out["predicted"]["ttft_ms"] >= 0
    assert s.route({"token_ids": PROMPT, "request_id": "b"})["worker"] in ("w0", "w1")
    with pytest.raises(ValueError, match="slo"):
        s.route({"token_ids": PROMPT, "request_id": "c", "slo": {"tpot_ms": -1}})
