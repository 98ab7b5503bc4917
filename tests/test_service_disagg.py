"""The service over a disaggregated pool: endpoint roles (TOML and command line), ``POST /route`` answering a
(prefill, decode) pair, and first-token and finish reports booking both workers' load. No sockets: the service is
not started, its index is fed events directly."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.hardware.latency import LATENCY_PRESETS, PRESETS
from kvtier.indexer.routing.disagg import KvLinkCost
from kvtier.indexer.routing.plugins import PluginError, PolicyBase, RouteContext
from kvtier.indexer.service.app import ConfigError, IndexerService, ServiceConfig, load_config, parse_endpoint
from kvtier.indexer.service.clients import TooManyInFlight
from kvtier.wire import BlockStored, WorkerId
from kvtier.wire.notices import StreamId

BS = 16
W = [StreamId(WorkerId(f"w{i}")) for i in range(4)]
PROMPT = list(range(1000, 1000 + 64 * BS))  # 64 blocks


def _service(policy: str, roles: tuple[str, ...] = ("prefill", "prefill", "decode", "decode"),
             **settings: object) -> IndexerService:
    eps = [parse_endpoint(f"w{i}=tcp://127.0.0.1:{i + 1},role={r}") for i, r in enumerate(roles)]
    return IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", policy=policy,
                                        **settings))  # type: ignore[arg-type]


def _store(svc: IndexerService, worker: StreamId, blocks: int) -> None:
    svc.index.apply(worker, BlockStored(block_hashes=list(range(1, blocks + 1)), parent_block_hash=None,
                                        token_ids=PROMPT[:blocks * BS], block_size=BS, medium="GPU"))


def test_roles_from_toml_and_the_command_line(tmp_path: Path) -> None:
    toml = tmp_path / "svc.toml"
    toml.write_text('[[endpoints]]\nworker = "p0"\nendpoint = "tcp://127.0.0.1:1"\nrole = "prefill"\n'
                    '[[endpoints]]\nworker = "d0"\nendpoint = "tcp://127.0.0.1:2"\nrole = "decode"\n'
                    '[[endpoints]]\nworker = "a0"\nendpoint = "tcp://127.0.0.1:3"\n')
    assert [ep.role for ep in load_config(toml).endpoints] == ["prefill", "decode", "both"]
    assert parse_endpoint("w0=tcp://127.0.0.1:1,role=decode").role == "decode"
    with pytest.raises(ConfigError, match="role 'middle'"):
        parse_endpoint("w0=tcp://127.0.0.1:1,role=middle")
    toml.write_text('[[endpoints]]\nworker = "p0"\nendpoint = "tcp://127.0.0.1:1"\nrole = "decoder"\n')
    with pytest.raises(ConfigError, match="role 'decoder'"):
        load_config(toml)
    with pytest.raises(ConfigError, match="needs a prefill and a decode worker"):
        _service("kv_all", ("prefill", "prefill"))


def test_dynamo_answers_a_pair_kv_aware_prefill_and_load_based_decode() -> None:
    """The prefill side goes where the prompt is cached (w1); the decode side, as Dynamo's decode router, to the
    decode worker with fewer active blocks (w3), though w2 holds the prompt too."""
    svc = _service("dynamo")
    _store(svc, W[1], 64)
    _store(svc, W[2], 64)
    svc.decode_loads.add("busy", W[2], [], 4096, 0)
    out = svc.route({"token_ids": PROMPT, "request_id": "r"})
    assert out["prefill"]["recommended"] == "w1" and out["decode"]["recommended"] == "w3"
    assert out["worker"] == "w1" and out["local_prefill"] is False
    assert set(out["prefill"]["costs"]) == {"w0", "w1"} and set(out["decode"]["costs"]) == {"w2", "w3"}
    assert out["decode"]["workers"]["w2"]["role"] == "decode" and out["prefill"]["workers"]["w1"]["role"] == "prefill"


def test_min_ttft_saves_the_transfer_on_the_decode_side() -> None:
    svc = _service("min_ttft", capacity_tokens=100_000)
    _store(svc, W[2], 64)
    out = svc.route({"token_ids": PROMPT, "request_id": "r"})
    assert out["decode"]["recommended"] == "w2"  # holds the prompt: nothing to move
    costs = out["decode"]["costs"]
    assert costs["w2"] < costs["w3"]


def test_first_token_and_finish_book_both_workers() -> None:
    svc = _service("kv_all")
    out = svc.route({"token_ids": PROMPT, "request_id": "r"})
    p = StreamId(WorkerId(out["prefill"]["recommended"]))
    d = StreamId(WorkerId(out["decode"]["recommended"]))
    assert svc.loads.load(p).running == 1 and svc.loads.load(p).pending_prefill_tokens == len(PROMPT)
    assert svc.decode_loads.load(d).running == 1 and svc.decode_loads.load(d).prefilling == 1
    workers = svc.metrics()["workers"]
    assert (workers[str(p)]["requests_running"], workers[str(d)]["requests_running"]) == (1, 1)
    svc.first_token("r")  # the prompt is computed and handed over: the prefill worker is done with it
    assert svc.loads.load(p).running == 0
    assert svc.decode_loads.load(d).running == 1 and svc.decode_loads.load(d).prefilling == 0
    workers = svc.metrics()["workers"]  # /metrics reads each worker's own pool's bookings
    assert (workers[str(p)]["requests_running"], workers[str(d)]["requests_running"]) == (0, 1)
    assert workers[str(d)]["active_blocks"] == svc.decode_loads.load(d).active_blocks > 0
    assert svc.finish("r", {"output_tokens": 40})["was_in_flight"] is True
    assert svc.decode_loads.load(d).running == 0 and svc.decode_loads.expected_output == 40.0


def test_a_pair_booking_counts_its_prompt_blocks_against_the_caps() -> None:
    svc = _service("kv_all", max_in_flight_blocks=100)
    assert set(svc.route({"token_ids": PROMPT, "request_id": "r1"})) >= {"prefill", "decode"}
    assert svc.clients.blocks == 64
    with pytest.raises(TooManyInFlight, match=r"64 prompt blocks in flight .* max_in_flight_blocks 100") as err:
        svc.route({"token_ids": PROMPT, "request_id": "r2"})
    assert err.value.status == 503 and "r2" not in svc.clients._owner
    svc.finish("r1")
    assert svc.clients.blocks == 0
    assert svc.route({"token_ids": PROMPT, "request_id": "r2"})["local_prefill"] is False


def test_a_pair_whose_plugin_fails_to_learn_its_route_books_nothing() -> None:
    """A routing-history hook that raises fails the route as the plugin's error (a 500 over HTTP), before either
    worker is booked: no load on either pool, no client booking, no prediction waiting for its reports."""
    svc = _service("tests.test_service_limits:LearnsWrong")
    with pytest.raises(PluginError, match=r"policy 'learns_wrong': routed\(\) raised KeyError"):
        svc.route({"token_ids": PROMPT, "request_id": "r"})
    assert all(svc.loads.load(w).running == 0 and svc.decode_loads.load(w).running == 0 for w in W)
    assert len(svc.clients) == 0 and len(svc.predictions) == 0


class Counted(PolicyBase):
    """A plugin that counts its instances (a plugin may hold connections or history: one per pool that routes)."""

    name = "counted"
    built = 0

    def __init__(self) -> None:
        Counted.built += 1

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        return 0.0


@pytest.mark.parametrize(("roles", "built"), [(("prefill", "prefill", "decode", "decode"), 2), (("both", "both"), 1)])
def test_a_pool_builds_the_routers_it_routes_with_alone(roles: tuple[str, ...], built: int) -> None:
    """A disaggregated pool builds its plugin once per pool (prefill, decode) and no aggregated router beside them;
    an aggregated pool one router, no pair."""
    Counted.built = 0
    svc = _service("tests.test_service_disagg:Counted", roles)
    assert Counted.built == built
    assert (svc.router is None) == (svc.pair is not None)
    out = svc.route({"token_ids": PROMPT, "request_id": "r"})
    assert ("prefill" in out) == (svc.pair is not None)


def test_an_aggregated_pool_answers_as_before() -> None:
    svc = _service("kv_all", ("both", "both"))
    assert svc.pair is None
    out = svc.route({"token_ids": PROMPT, "request_id": "r"})
    assert "prefill" not in out and out["worker"] in ("w0", "w1")


def test_a_prompt_its_decode_worker_nearly_holds_prefills_there() -> None:
    """Conditional disaggregation: with the prompt on w2 but for 4 blocks, under local_prefill_tokens, it prefills on
    its decode worker, booked there alone, prefill included; a cold prompt goes to the prefill pool."""
    svc = _service("min_ttft", capacity_tokens=100_000, local_prefill_tokens=128)
    _store(svc, W[2], 60)
    out = svc.route({"token_ids": PROMPT, "request_id": "near"})
    assert out["local_prefill"] is True and out["worker"] == out["decode"]["recommended"] == "w2"
    assert svc.decode_loads.load(W[2]).pending_prefill_tokens == 4 * BS
    assert svc.loads.load(W[0]).running == svc.loads.load(W[1]).running == 0
    cold = svc.route({"token_ids": list(range(50_000, 50_000 + 64 * BS)), "request_id": "cold"})
    assert cold["local_prefill"] is False and cold["worker"] in ("w0", "w1")
    assert svc.router_settings.kv_gbps == 50.0


def test_the_indexer_cli_refuses_a_pool_without_decode_workers_in_one_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each refused before the compiled kernels load: a pool without decode workers, and a pool's settings given to an
    aggregated one, were refused only once they had (half a minute on the first start after an install, with a line
    saying so)."""
    from kvtier.indexer.service import app
    from kvtier.sim.cli import main as cli

    def loading() -> None:
        raise AssertionError("the kernels were loaded before the refusal")

    monkeypatch.setattr(app, "load_kernels", loading)
    for argv, expected in (
        (["--endpoint", "w0=tcp://127.0.0.1:1,role=prefill"], "needs a prefill and a decode worker"),
        (["--endpoint", "w0=tcp://127.0.0.1:1,role=prefill", "--endpoint", "w1=tcp://127.0.0.1:2,role=decode",
          "--kv-link-gbps", "-1"], "kv_gbps"),
        (["--endpoint", "w0=tcp://127.0.0.1:1,role=dec"], "role 'dec'"),
        (["--endpoint", "w0=tcp://127.0.0.1:1,role=prefill", "--endpoint", "w1=tcp://127.0.0.1:2,role=decode",
          "--decode-capacity-tokens", "0"], "decode_capacity_tokens"),
        (["--endpoint", "w0=tcp://127.0.0.1:1", "--decode-capacity-tokens", "4096", "--kv-link-gbps", "50"],
         "kv_gbps, decode_capacity_tokens: they apply to a disaggregated pool only"),
    ):
        rc = cli(["indexer", "--listen", "127.0.0.1:0", *argv])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert rc == 2 and len(err) == 1 and expected in err[0], (argv, err)


def test_no_endpoints_are_no_pool_error() -> None:
    """A configuration without endpoints is refused as such (by the service: "no endpoints configured"), not as a
    disaggregated pool missing a role. (From review BB.)"""
    from kvtier.indexer.routing.disagg import pool_error

    assert pool_error([]) is None and pool_error(["both", "both"]) is None
    assert pool_error(["prefill", "decode"]) is None and pool_error(["both", "decode"]) is None
    assert "needs a prefill and a decode worker" in (pool_error(["prefill"]) or "")


def test_a_pair_predicts_the_simulators_ttft_for_a_lone_request_and_hears_back() -> None:
    """On an idle pool, the pair's predicted TTFT is the prefill, the KV transfer and the decode worker's first step,
    as the simulator runs a lone request (to the float); a decode worker holding the prompt saves its transfer in the
    prediction. The reports feed the observed latencies back, as in an aggregated pool."""
    from kvtier.sim.cluster import ClusterConfig
    from kvtier.sim.run import RunConfig, simulate
    from kvtier.sim.trace import Request

    n = 3000
    pd = ClusterConfig.of(prefill_workers=1, decode_workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0)
    sim = simulate([Request("a", 0.0, n, 5, [1, 2, 3, 4, 5, 6])], pd, RunConfig("round_robin")).records[0]
    eps = [parse_endpoint("p=tcp://127.0.0.1:1,role=prefill"), parse_endpoint("d=tcp://127.0.0.1:2,role=decode")]
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=64, listen="127.0.0.1:0", policy="round_robin",
                                       capacity_tokens=pd.capacity_tokens()))
    prompt = list(range(7, 7 + n))
    cold = svc.route({"token_ids": prompt, "request_id": "a", "slo": {"ttft_ms": 1e4, "tpot_ms": 1e-3}})
    assert cold["predicted"]["ttft_ms"] == pytest.approx(sim.ttft * 1000, rel=1e-9)
    assert cold["predicted"]["tpot_ms"] > 0 and cold["predicted"]["meets_slo"] is False
    assert svc.finish("a", {"output_tokens": 5})["was_in_flight"] is True
    # The decode worker holds the prompt's 46 whole blocks: only the last 56 tokens' KV moves.
    d = StreamId(WorkerId("d"))
    svc.index.apply(d, BlockStored(block_hashes=list(range(1, 47)), parent_block_hash=None, token_ids=prompt[:46 * 64],
                                   block_size=64, medium="GPU"))
    warm = svc.route({"token_ids": prompt, "request_id": "b"})
    saved = 46 * 64 * PRESETS["llama-3.1-8b"].bytes_per_token / (svc.router_settings.kv_gbps * 1e6)
    assert warm["predicted"]["ttft_ms"] == pytest.approx(cold["predicted"]["ttft_ms"] - saved, rel=1e-9)
    assert svc.first_token("b")["observed_ttft_ms"] >= 0
    assert svc.metrics()["predictions"]["ttft"]["abs_error_seconds"]["count"] == 1


def test_a_pair_predicts_with_its_decode_workers_own_capacity() -> None:
    """``decode_capacity_tokens`` (the simulator's ``decode_device_tokens``): the decode worker's first step, in the
    pair's predicted TTFT, and its TPOT are priced on the decode worker's own memory, as the simulator runs them (to the
    float for a lone request); without it, on the prefill workers' ``capacity_tokens``."""
    from kvtier.sim.cluster import ClusterConfig
    from kvtier.sim.run import RunConfig, simulate
    from kvtier.sim.trace import Request

    n = 3000
    pd = ClusterConfig.of(prefill_workers=1, decode_workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0,
                          decode_device_tokens=8192)
    sim = simulate([Request("a", 0.0, n, 5, [1, 2, 3, 4, 5, 6])], pd, RunConfig("round_robin")).records[0]
    eps = [parse_endpoint("p=tcp://127.0.0.1:1,role=prefill"), parse_endpoint("d=tcp://127.0.0.1:2,role=decode")]
    predicted = {}
    for decode in (8192, None):
        svc = IndexerService(ServiceConfig(endpoints=eps, block_size=64, listen="127.0.0.1:0", policy="min_ttft",
                                           capacity_tokens=pd.capacity_tokens(), decode_capacity_tokens=decode))
        predicted[decode] = svc.route({"token_ids": list(range(7, 7 + n)), "request_id": "a"})["predicted"]
    assert predicted[8192]["ttft_ms"] == pytest.approx(sim.ttft * 1000, rel=1e-9)
    assert predicted[None]["ttft_ms"] < predicted[8192]["ttft_ms"]
    assert predicted[None]["tpot_ms"] < predicted[8192]["tpot_ms"]


@pytest.mark.parametrize("policy", ["min_ttft", "llmd_kv"])
def test_a_pools_decode_router_is_built_on_the_decode_workers_capacity(policy: str) -> None:
    """The decode side's router: a cost priced (``min_ttft``) or a policy built (``llmd_kv``, an incumbent's rule
    over each pool) on ``decode_capacity_tokens``, with a latency fit that states its pool rescaled to it; the
    prefill side's on ``capacity_tokens``."""
    svc = _service(policy, capacity_tokens=100_000, decode_capacity_tokens=20_000, latency_path="h200-llama-3.1-8b")
    assert svc.pair is not None
    pre, dec = svc.pair.prefill, svc.pair.decode
    if policy == "min_ttft":
        assert isinstance(dec.cost_model, KvLinkCost) and dec.cost_model.capacity_tokens == 20_000
        fit = LATENCY_PRESETS["h200-llama-3.1-8b"]
        assert dec.cost_model.latency == fit.for_pool(20_000) != fit.for_pool(100_000)
        assert getattr(pre.cost_model, "capacity_tokens", None) == 100_000
    else:
        assert getattr(dec.policy, "capacity_tokens", None) == 20_000
        assert getattr(pre.policy, "capacity_tokens", None) == 100_000


def test_a_requests_slo_steers_the_goodput_pair() -> None:
    """The goodput policy's decode side, disaggregated: w2 holds the prompt (no transfer over a slow link) but decodes a
    big batch. With no SLO it takes w2; told a TPOT bound w2's batch would break, the idle w3; its prediction says
    so."""
    svc = _service("goodput", capacity_tokens=100_000, kv_gbps=0.5)
    _store(svc, W[2], 64)
    svc.decode_loads.add("batch", W[2], [], 60_000, 0)
    svc.decode_loads.prefill_done("batch")
    plain = svc.route({"token_ids": PROMPT, "request_id": "a"})
    assert plain["decode"]["recommended"] == "w2" and plain["predicted"]["tpot_ms"] > 20
    bounded = svc.route({"token_ids": PROMPT, "request_id": "b", "slo": {"tpot_ms": 15.0}})
    assert bounded["decode"]["recommended"] == "w3" and bounded["predicted"]["meets_slo"] is True
    assert bounded["predicted"]["tpot_ms"] < 15.0


@pytest.mark.parametrize("policy", ["kv_all", "dynamo", "min_ttft", "power_of_two"])
def test_a_query_answers_the_pair_a_route_would_book_and_books_nothing(policy: str) -> None:
    """A query in a disaggregated pool recommended a worker of the whole pool, as if aggregated: a decode-only
    worker (w2, where the prompt is) as the one to send it to. It answers the pair /route books, booking nothing,
    and takes back its random draws (ties among the prefill workers), so that the route then gets that pair."""
    svc = _service(policy, capacity_tokens=100_000)
    _store(svc, W[2], 64)
    for i in range(6):
        prompt = PROMPT if i % 2 else list(range(10_000 * i, 10_000 * i + 64 * BS))
        out = svc.query({"token_ids": prompt})
        assert out["prefill"]["recommended"] in ("w0", "w1") and out["decode"]["recommended"] in ("w2", "w3")
        assert set(out["prefill"]["costs"]) == {"w0", "w1"} and out["worker"] == out["prefill"]["recommended"]
        assert out["local_prefill"] is False and out["prefill"]["workers"]["w2"]["role"] == "decode"
        assert sum(svc.loads.load(w).running + svc.decode_loads.load(w).running for w in W) == 2 * i  # unbooked
        routed = svc.route({"token_ids": prompt, "request_id": str(i)})
        assert [routed[side]["recommended"] for side in ("prefill", "decode")] == \
            [out[side]["recommended"] for side in ("prefill", "decode")]
    assert sum(svc.loads.load(w).running for w in W) == 6 and len(svc.clients) == 6


def test_a_both_worker_shows_both_sides_bookings_in_metrics() -> None:
    """A worker of role "both" in a disaggregated pool may prefill one request and decode another: /metrics adds its
    two pools' bookings (it showed the prefill pool's alone: a request decoding there was invisible)."""
    svc = _service("kv_all", ("both", "decode"), local_prefill_tokens=256)
    _store(svc, W[0], 64)
    out = svc.route({"token_ids": PROMPT, "request_id": "r"})  # held whole on w0: prefilled there, decoded there
    assert out["local_prefill"] is True and out["worker"] == "w0"
    assert svc.decode_loads.load(W[0]).running == 1 and svc.loads.load(W[0]).running == 0
    w0 = svc.metrics()["workers"]["w0"]
    assert (w0["requests_running"], w0["requests_prefilling"]) == (1, 1) and w0["active_blocks"] > 0
    assert 'kvtier_requests_running{worker="w0"} 1' in svc.metrics_text()
    svc.first_token("r")
    svc.finish("r")
    assert svc.metrics()["workers"]["w0"]["requests_running"] == 0


def test_a_both_worker_picked_by_both_sides_prefills_where_it_decodes() -> None:
    """Nothing moves when a pair's two sides pick the same worker (role "both"): the request is a local prefill,
    booked on that worker once, its prediction without a KV transfer (it was booked in both pools, a transfer from
    the worker to itself predicted)."""
    svc = _service("kv_all", ("both", "decode"), capacity_tokens=100_000)
    _store(svc, W[0], 64)
    out = svc.route({"token_ids": PROMPT, "request_id": "s"})
    assert out["prefill"]["recommended"] == out["decode"]["recommended"] == out["worker"] == "w0"
    assert out["local_prefill"] is True
    assert svc.loads.load(W[0]).running == 0 and svc.decode_loads.load(W[0]).running == 1


def test_each_side_prices_a_both_worker_with_what_the_other_side_booked_there() -> None:
    """w1 serves both roles: what the decode side booked there loads it for the prefill side, and the other way round
    (each side read its own pool's bookings alone, so a worker prefilling a local prefill looked idle to the prefill
    side). Dynamo's prefill side prices prompt blocks still to prefill, its decode side active blocks: w0 and w2 have
    one each booked, w1 256 from the other side."""
    svc = _service("dynamo", ("prefill", "both", "decode"))
    svc.loads.add("small-prefill", W[0], [], BS, BS)
    svc.decode_loads.add("small-decode", W[2], [], BS, 0)
    held = list(range(10_000, 10_256))  # (a booking's blocks are its prompt's keys)
    svc.decode_loads.add("local", W[1], held, 256 * BS, 256 * BS)  # a local prefill: booked on the decode side
    out = svc.route({"token_ids": PROMPT, "request_id": "a"})
    assert out["prefill"]["recommended"] == "w0", out["prefill"]["costs"]
    assert svc.pair is not None and svc.pair.prefill.loads.load(W[1]).running == 1
    svc.finish("a")
    svc.decode_loads.finish("local")
    svc.loads.add("prefilling", W[1], held, 256 * BS, 256 * BS)
    out = svc.route({"token_ids": PROMPT, "request_id": "b"})
    assert out["decode"]["recommended"] == "w2", out["decode"]["costs"]
    assert svc.pair.decode.loads.load(W[1]).running == 1 and svc.decode_loads.load(W[1]).running == 0


def test_a_pairs_finish_teaches_the_output_length_to_the_decode_pool_alone() -> None:
    """The prefill pool decodes nothing: a finish's output_tokens is the decode pool's to learn, whether or not the
    first token was reported (skipping that report taught it to the prefill pool, whose routing then reserved output
    room on prefill workers)."""
    for report_first in (True, False):
        svc = _service("min_ttft", capacity_tokens=20_000)
        svc.route({"token_ids": PROMPT, "request_id": "r"})
        if report_first:
            svc.first_token("r")
        svc.finish("r", {"output_tokens": 8000})
        assert svc.loads.expected_output == 0 and svc.decode_loads.expected_output > 0, report_first


def test_a_route_books_as_prefill_only_what_no_tier_of_the_worker_holds() -> None:
    """/route books the prompt tokens the chosen worker must compute: those past its overlap on any tier (a host hit
    is loaded, not prefilled), as the simulator books them."""
    svc = _service("kv_all", ("both", "both"))
    svc.index.apply(W[0], BlockStored(block_hashes=list(range(1, 33)), parent_block_hash=None,
                                      token_ids=PROMPT[:32 * BS], block_size=BS, medium="CPU_PINNED"))
    out = svc.route({"token_ids": PROMPT, "request_id": "r"})
    assert out["worker"] == "w0"
    assert svc.loads.load(W[0]).pending_prefill_tokens == len(PROMPT) - 32 * BS
    assert svc.metrics()["workers"]["w0"]["pending_prefill_tokens"] == len(PROMPT) - 32 * BS


def test_an_expired_pair_booking_frees_its_prefill_and_its_decode_worker() -> None:
    """A request of a disaggregated pool never finished is dropped at its deadline from both pools' bookings."""
    now = [0.0]
    eps = [parse_endpoint(f"w{i}=tcp://127.0.0.1:{i + 1},role={r}")
           for i, r in enumerate(("prefill", "prefill", "decode", "decode"))]
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", policy="kv_all",
                                       request_ttl_s=10.0), request_clock=lambda: now[0])
    out = svc.route({"token_ids": PROMPT, "request_id": "r"})
    p = StreamId(WorkerId(out["prefill"]["recommended"]))
    d = StreamId(WorkerId(out["decode"]["recommended"]))
    assert svc.loads.load(p).running == 1 and svc.decode_loads.load(d).running == 1
    now[0] = 11.0
    for rid in svc._deadlines.expire(now[0]):  # what the event loop does at each deadline
        svc._expired(rid)
    assert svc.loads.load(p).running == 0 and svc.decode_loads.load(d).running == 0
    workers = svc.metrics()["workers"]
    assert workers[str(d)]["requests_running"] == 0 and workers[str(d)]["active_blocks"] == 0


def test_a_request_id_with_a_slash_is_refused() -> None:
    """A request id is a path segment of ``/requests/{id}/first_token`` and ``.../finish``: one with a "/" could
    never be finished, so /route refuses it, books nothing."""
    svc = _service("kv_all", ("both", "both"))
    with pytest.raises(ValueError, match="request_id"):
        svc.route({"token_ids": PROMPT, "request_id": "a/b"})
    assert svc.metrics()["requests_in_flight"] == 0


def test_dynamos_decode_side_counts_a_prompt_in_flight_there_again() -> None:
    """Dynamo's decode router assumes no reuse: a prompt already in flight on a decode worker is booked there in
    full again (kv_all's decode side counts those blocks once)."""
    svc = _service("dynamo")
    svc.decode_loads.add("before", W[2], svc.index.request_keys(PROMPT), len(PROMPT), 0)
    out = svc.route({"token_ids": PROMPT, "request_id": "r"})
    assert out["decode"]["costs"]["w2"] == pytest.approx(2 * 64)  # 64 blocks in flight + this request's 64
    assert out["decode"]["costs"]["w3"] == pytest.approx(64)
