"""What ``kvtier indexer`` is told: its settings (command line or TOML), the engine endpoints it follows, and
the cost model its routing answers use."""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtier.hardware.latency import PRESETS, MockerLatency, resolve_latency
from kvtier.hardware.links import (
    DEFAULT_GPU_LINK,
    DEFAULT_KV_LINK,
    DEFAULT_STORAGE_LINK,
    GBPS_RANGE,
    GPU_LINKS,
    KV_LINKS,
    STORAGE_LINKS,
)
from kvtier.indexer.routing.policies import RoutingSettings
from kvtier.indexer.routing.scoring import DEFAULT_OUT_OF_REACH, OUT_OF_REACH
from kvtier.util.fields import ConfigError, Domain, at_least, check_fields, one_of, within
from kvtier.util.infile import SETTINGS_BYTES, read_text
from kvtier.wire.notices import StreamId
from kvtier.wire.protocol import DEFAULT_BLOCK_SIZE, StorageTier
from kvtier.wire.transport.subscriber import MAX_DP_RANK, MAX_FRAME_BYTES, EndpointConfig


@dataclass(slots=True)
class ServiceConfig:
    """Everything ``kvtier indexer`` needs."""

    endpoints: list[EndpointConfig]  # engine streams to subscribe to
    # tokens per block; events with another size are rejected
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata=within(1, 1 << 16, int))
    listen: str = "127.0.0.1:8000"  # HTTP host:port (port 0 picks a free one); checked in __post_init__
    # wait for a replay or dump answer
    replay_timeout_s: float = field(default=2.0, metadata=within(0, 3600, lo_open=True))
    # The cost of the kv_* policies, as the simulator's --cost: credit (block credits per tier) or ttft
    cost: str = field(default="credit", metadata=one_of("credit", "ttft"))
    # A policy of the registry by name (kvtier.indexer.routing.policies: kv_all, min_ttft, dynamo, ...: the simulator's,
    # with the same cost under the same settings below) or a routing-policy plugin (kvtier.indexer.routing.plugins).
    # None: kv_all. Checked when the service starts.
    policy: str | None = field(default=None, metadata=Domain(str, optional=True).meta())
    # the workers' chunked-prefill tokens per iteration (ttft costs)
    prefill_budget: int = field(default=8192, metadata=at_least(1))
    # each worker's device KV capacity in tokens (ttft costs' decode and memory terms)
    capacity_tokens: int | None = field(default=None, metadata=at_least(1, optional=True))
    # what a disaggregated pool's decode side prices its workers with (None: capacity_tokens), as the simulator's
    # --decode-device-tokens; refused in an aggregated pool
    decode_capacity_tokens: int | None = field(default=None, metadata=at_least(1, optional=True))
    model: str = field(default="llama-3.1-8b", metadata=one_of(*PRESETS))  # preset for the ttft cost's transfers
    # The links KV moves over (kvtier.hardware.links presets), as the simulator's --gpu-link / --storage-link;
    # h2d_gbps / storage_gbps override them
    gpu_link: str = field(default=DEFAULT_GPU_LINK, metadata=one_of(*GPU_LINKS))
    storage_link: str = field(default=DEFAULT_STORAGE_LINK, metadata=one_of(*STORAGE_LINKS))
    h2d_gbps: float | None = field(default=None, metadata=within(*GBPS_RANGE, optional=True))
    storage_gbps: float | None = field(default=None, metadata=within(*GBPS_RANGE, optional=True))
    # A disaggregated pool (endpoints with roles): the prefill -> decode KV link (kvtier.hardware.links.KV_LINKS),
    # kv_gbps overriding it, and conditional disaggregation: a prompt whose part its decode worker lacks is under
    # this many tokens prefills there (0: never)
    kv_link: str = field(default=DEFAULT_KV_LINK, metadata=one_of(*KV_LINKS))
    kv_gbps: float | None = field(default=None, metadata=within(*GBPS_RANGE, optional=True))
    local_prefill_tokens: int = field(default=0, metadata=at_least(0))
    # iteration times: a preset of kvtier.hardware.latency.LATENCY_PRESETS or a fit JSON from `kvtier fit-latency`;
    # None: Dynamo mocker's published fit. With capacity_tokens, a fit that states its pool is rescaled to it
    latency_path: str | None = field(default=None, metadata=Domain(str, optional=True).meta())
    # goodput policy: how a request whose SLO no worker can meet is placed (OUT_OF_REACH; SloCost.out_of_reach)
    slo_out_of_reach: str = field(default=DEFAULT_OUT_OF_REACH, metadata=one_of(*OUT_OF_REACH))
    # credit costs: a host block's and a disk or shared-pool block's weight against a device block's
    host_credit: float = field(default=0.75, metadata=within(0, 1))
    disk_credit: float = field(default=0.25, metadata=within(0, 1))
    temperature: float = field(default=0.0, metadata=within(0, 1e6))  # softmax sampling over costs (0: argmin)
    seed: int = field(default=0, metadata=at_least(0))  # the router's random choices (ties, sampling)
    # Sliding window of the served model, tokens, for engines that send no window-KV events (SGLang): their
    # window KV is inferred from their stores (kvtier.indexer.index.windowkv). None: the model preset's
    # (0 for a full-attention model); 0: such engines are scored on their full-attention overlap.
    window_tokens: int | None = field(default=None, metadata=at_least(0, optional=True))
    max_body_bytes: int = field(default=8 << 20, metadata=at_least(1))  # larger request bodies get 413
    # the bytes all request bodies being read hold together; a body that would pass it gets 503
    max_body_bytes_in_flight: int = field(default=256 << 20, metadata=at_least(1))
    # longer prompts get 400 (bounds a query's lock hold)
    max_query_tokens: int = field(default=1 << 20, metadata=at_least(1))
    # a request body must arrive within this (408)
    read_timeout_s: float = field(default=10.0, metadata=within(0, 3600, lo_open=True))
    # the HTTP front end's event loop: uvloop, asyncio, or auto (uvloop where installed)
    http_loop: str = field(default="auto", metadata=one_of("auto", "uvloop", "asyncio"))
    # idle keep-alive connections are closed after this
    keepalive_s: float = field(default=75.0, metadata=within(0, 86400, lo_open=True))
    # a routed request never finished is dropped from the load after this
    request_ttl_s: float = field(default=600.0, metadata=within(0, 86400 * 7, lo_open=True))
    # where the index is saved (periodically and on stop) and restored from
    snapshot_path: str | None = field(default=None, metadata=Domain(str, optional=True).meta())
    # seconds between snapshots
    snapshot_interval_s: float = field(default=30.0, metadata=within(0.1, 86400))
    # A worker whose publisher sent nothing for this long (no batch, no answer to the idle probes: a quiet stream
    # is probed every second, or every quarter of this if shorter) is taken for gone: not routed to while another
    # worker is alive, and listed by /health, until it is heard again. Only for endpoints with a replay socket:
    # nothing can be asked of the others, whose silence says nothing.
    liveness_timeout_s: float = field(default=5.0, metadata=within(0, 86400, lo_open=True))
    # the largest ZMQ frame (an event batch) taken from a publisher: a larger one drops its connection unread, and
    # what it carried is recovered as a lost batch is (replay, else a state dump, else the worker is partial)
    max_frame_bytes: int = field(default=MAX_FRAME_BYTES, metadata=within(1 << 16, 1 << 32, int))
    # --- what HTTP clients may spend (README, "Security"); past a limit a client gets a JSON 4xx or 503 ---
    # JSON arrays and objects nested deeper get 400 (the JSON parser recurses)
    max_json_depth: int = field(default=32, metadata=within(2, 500, int))
    # more JSON arrays and objects in one body get 400 (a request has a few, and a multimodal item one each; the
    # parser's cost per empty array is what a body of them would spend)
    max_json_containers: int = field(default=65_536, metadata=within(4, 1 << 24, int))
    # more multimodal items in one request get 400
    max_mm_items: int = field(default=256, metadata=at_least(0))
    # a longer request_id (UTF-8 bytes) gets 400
    max_request_id_bytes: int = field(default=256, metadata=within(1, 65536, int))
    # bookings in flight (routed, not finished or expired): past the total 503, past one client's 429
    max_in_flight: int = field(default=100_000, metadata=at_least(1))
    max_in_flight_per_client: int = field(default=10_000, metadata=at_least(1))
    # prompt blocks those bookings hold (each holds its prompt's block keys until it ends, 45-70 bytes a block,
    # 85-135 in a disaggregated pool: bench/booking_memory.py): past the total 503, past one client's 429
    max_in_flight_blocks: int = field(default=1 << 24, metadata=at_least(1))
    max_in_flight_blocks_per_client: int = field(default=1 << 23, metadata=at_least(1))
    # open HTTP connections: one more gets a JSON 503 and is closed
    max_connections: int = field(default=1024, metadata=within(1, 1 << 20, int))
    # of them from one peer address: one more gets a JSON 429 and is closed
    max_connections_per_peer: int = field(default=256, metadata=within(1, 1 << 20, int))
    # a connection that sent no request headers this long after it opened is closed
    header_timeout_s: float = field(default=10.0, metadata=within(0, 3600, lo_open=True))
    # output_tokens a finish may report (the served model's context); more gets 400
    max_context_tokens: int = field(default=1 << 20, metadata=within(1, 1 << 32, int))
    # tokens (one a line) required as "Authorization: Bearer <token>" by /route, first_token and finish;
    # each token is one client (bookings are released only by the token that booked them). None: no token.
    auth_token_file: str | None = field(default=None, metadata=Domain(str, optional=True).meta())
    # times a failed event loop is started again (after 0.5 s, doubling to 30 s), each stream resuming after
    # its last applied batch, before the service gives up: /health 503 and a non-zero exit. 0: at once.
    loop_restarts: int = field(default=0, metadata=at_least(0))

    def __post_init__(self) -> None:
        check_fields(self, style="key")
        if not isinstance(self.listen, str):
            raise ConfigError(f"listen: {self.listen!r} is not allowed; expected HOST:PORT")
        _, sep, port = self.listen.rpartition(":")
        if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
            raise ConfigError(f"listen: {self.listen!r} is not allowed; expected HOST:PORT with a port in 0..65535")
        if self.max_body_bytes_in_flight < self.max_body_bytes:  # (a body between the two could never be read)
            raise ConfigError(f"max_body_bytes_in_flight {self.max_body_bytes_in_flight} is less than max_body_bytes "
                              f"{self.max_body_bytes}: every body the cap allows must fit")
        named: dict[str, str] = {}  # endpoint -> the worker subscribed to it
        for ep in self.endpoints:
            other = named.setdefault(ep.endpoint, ep.worker)
            if other != ep.worker:  # each would index the other's events as its own
                raise ConfigError(f"endpoints: workers {other!r} and {ep.worker!r} both subscribe to {ep.endpoint}")
        # A rank past 0 is named worker/dpN in every answer and metric: a worker named so would take its place.
        called: dict[str, StreamId] = {}
        for ep in self.endpoints:
            first = called.setdefault(str(ep.stream), ep.stream)
            if first != ep.stream:
                def what(s: StreamId) -> str:
                    return f"worker {s.worker!r}" + (f" rank {s.dp_rank}" if s.dp_rank else "")
                raise ConfigError(f"endpoints: {what(first)} and {what(ep.stream)} are both named {ep.stream} in "
                                  "every answer")

    def disaggregated_settings(self) -> list[str]:
        """The settings given that only a disaggregated pool reads (the KV link, conditional disaggregation, the
        decode workers' capacity), by name."""
        given = (("kv_link", self.kv_link != DEFAULT_KV_LINK), ("kv_gbps", self.kv_gbps is not None),
                 ("local_prefill_tokens", self.local_prefill_tokens != 0),
                 ("decode_capacity_tokens", self.decode_capacity_tokens is not None))
        return [name for name, set_ in given if set_]

    def routing_settings(self, *, decode: bool = False) -> RoutingSettings:
        """What the policy prices with, as the simulator builds it (:mod:`kvtier.indexer.routing.policies`); with
        ``decode``, a disaggregated pool's decode side (its workers' ``decode_capacity_tokens``). A latency file that
        cannot be read is a :class:`ConfigError`."""
        capacity = self.decode_capacity_tokens or self.capacity_tokens if decode else self.capacity_tokens
        latency = MockerLatency()
        if self.latency_path is not None:
            try:
                latency = resolve_latency(self.latency_path)
            except ValueError as exc:
                raise ConfigError(f"latency_path {exc}") from None
            try:  # it prices passes of up to the budget, and a prompt's prefill whole
                latency.check_prefill(max(self.prefill_budget, self.max_query_tokens))
            except ValueError as exc:
                raise ConfigError(f"latency_path {self.latency_path}: {exc} (a pass computes up to prefill_budget "
                                  "tokens, and a prompt has up to max_query_tokens)") from None
        if capacity is not None:
            latency = latency.for_pool(capacity)
        return RoutingSettings(
            cost=self.cost, model=self.model,
            h2d_gbps=self.h2d_gbps if self.h2d_gbps is not None else GPU_LINKS[self.gpu_link].gbps,
            storage_gbps=self.storage_gbps if self.storage_gbps is not None else STORAGE_LINKS[self.storage_link].gbps,
            host_credit=self.host_credit, disk_credit=self.disk_credit, prefill_budget=self.prefill_budget,
            capacity_tokens=capacity, latency=latency, temperature=self.temperature, seed=self.seed,
            slo_out_of_reach=self.slo_out_of_reach,
            kv_gbps=self.kv_gbps if self.kv_gbps is not None else KV_LINKS[self.kv_link].gbps)

    @property
    def inferred_window_tokens(self) -> int:
        """The window the index infers for engines that send no window events (0: none)."""
        return PRESETS[self.model].window_tokens if self.window_tokens is None else self.window_tokens

    @property
    def host_port(self) -> tuple[str, int]:
        """Where the HTTP front end binds (an empty host is loopback)."""
        host, _, port = self.listen.rpartition(":")
        if host.startswith("[") and host.endswith("]"):  # an IPv6 address, bracketed as in a URL
            host = host[1:-1]
        return host or "127.0.0.1", int(port)


#: [[endpoints]] keys: domain, required.
_ENDPOINT_FIELDS: dict[str, tuple[Domain, bool]] = {
    "worker": (Domain(str), True), "endpoint": (Domain(str), True),
    "replay_endpoint": (Domain(str, optional=True), False), "dp_rank": (Domain(int, lo=0, hi=MAX_DP_RANK), False),
    "supports_dump": (Domain(bool), False), "engine": (Domain(str, optional=True), False),
    "role": (Domain(str), False),
}

#: The tiers each engine keeps prefix-closed (a block held there has its parent held there), on which a store made
#: after a loss for good proves its parent chain held (kvtier.indexer.index.relearn): SGLang's radix tree on device,
#: kvtier's engine on device and host; vLLM's block pool can hold a block without its parent.
ENGINE_CLOSED_TIERS: dict[str, tuple[StorageTier, ...]] = {
    "sglang": (StorageTier.DEVICE,), "kvtier": (StorageTier.DEVICE, StorageTier.HOST), "vllm": ()}


def closed_tiers(ep: EndpointConfig) -> tuple[StorageTier, ...]:
    """What ``ep``'s engine keeps prefix-closed: its declared engine's, else kvtier's where it answers state dumps
    (only kvtier engines do), else nothing (no chain is ever regained from an undeclared engine). O(1)."""
    engine = ep.engine or ("kvtier" if ep.supports_dump else None)
    return ENGINE_CLOSED_TIERS[engine] if engine else ()


#: An endpoint on the command line (``--endpoint``), as :func:`parse_endpoint` reads it.
ENDPOINT_SPEC = ("WORKER=tcp://host:port[,replay=tcp://host:port][,dp=N][,dump][,engine=sglang|vllm|kvtier]"
                 "[,role=prefill|decode|both]")


def parse_endpoint(spec: str) -> EndpointConfig:
    """Parses :data:`ENDPOINT_SPEC`."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(f"endpoint {spec!r}: expected {ENDPOINT_SPEC}")
    parts = rest.split(",")
    opts: dict[str, Any] = {}
    for p in parts[1:]:
        key, _, value = p.partition("=")
        if key == "replay":
            if not value:
                raise ConfigError(f"endpoint {spec!r}: option {p!r}: expected replay=tcp://host:port")
            opts["replay_endpoint"] = value
        elif key == "dp":
            if not (value.isascii() and value.isdigit()):  # (isdigit alone takes '²', which int() refuses)
                raise ConfigError(f"endpoint {spec!r}: option {p!r}: expected dp=N with N an integer >= 0")
            opts["dp_rank"] = int(value)
        elif key == "engine":
            opts["engine"] = value
        elif key == "role":
            opts["role"] = value
        elif key == "dump":
            if value:
                raise ConfigError(f"endpoint {spec!r}: option {p!r}: dump takes no value")
            opts["supports_dump"] = True
        else:
            raise ConfigError(f"endpoint {spec!r}: unknown option {p!r}")
    try:
        return EndpointConfig(worker=name, endpoint=parts[0], **opts)
    except ValueError as exc:
        raise ConfigError(f"endpoint {spec!r}: {exc}") from None


def load_config(path: Path) -> ServiceConfig:
    """Reads a TOML file: top-level settings plus ``[[endpoints]]`` tables."""
    try:
        raw = tomllib.loads(read_text(path, SETTINGS_BYTES, "a TOML configuration"))
    except ValueError as exc:  # (TOMLDecodeError is one)
        raise ConfigError(f"{path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply") from None
    eps = []
    tables = raw.pop("endpoints", [])
    if not isinstance(tables, list) or not all(isinstance(e, dict) for e in tables):
        raise ConfigError(f"{path}: endpoints must be [[endpoints]] tables")
    for i, e in enumerate(tables):
        if unknown := set(e) - set(_ENDPOINT_FIELDS):
            raise ConfigError(f"{path}: endpoints[{i}]: unknown fields {sorted(unknown)}"
                              f"{_meant(unknown, _ENDPOINT_FIELDS, _ENDPOINT_OPTIONS)}")
        for name, (domain, required) in _ENDPOINT_FIELDS.items():
            if name in e:
                domain.check(f"{path}: endpoints[{i}].{name}", e[name])
            elif required:
                raise ConfigError(f"{path}: endpoints[{i}]: missing {name}")
        try:
            eps.append(EndpointConfig(worker=e["worker"], endpoint=e["endpoint"],
                                      replay_endpoint=e.get("replay_endpoint"), dp_rank=e.get("dp_rank", 0),
                                      supports_dump=e.get("supports_dump", False), engine=e.get("engine"),
                                      role=e.get("role", "both")))
        except ValueError as exc:
            raise ConfigError(f"{path}: endpoints[{i}]: {exc}") from None
    known = {f.name for f in fields(ServiceConfig)} - {"endpoints"}  # every setting, so none is forgotten here
    if unknown := set(raw) - known:
        raise ConfigError(f"{path}: unknown settings {sorted(unknown)}{_meant(unknown, known)}")
    return ServiceConfig(endpoints=eps, **raw)


#: The command line's --endpoint options by the TOML fields they set (replay=..., dp=N, dump).
_ENDPOINT_OPTIONS = {"replay": "replay_endpoint", "dp": "dp_rank", "dump": "supports_dump"}


def _meant(unknown: set[str], names: Iterable[str], aliases: Mapping[str, str] | None = None) -> str:
    """``"; did you mean ..."`` for the unknown names that look like known ones (a typo, or the command line's
    spelling of an endpoint field), else nothing. O(unknown x names)."""
    known, aliases = list(names), aliases or {}
    guesses = [f"{name!r} -> {meant!r}" for name in sorted(unknown)
               if (meant := aliases.get(name) or next(iter(difflib.get_close_matches(name, known, n=1)), None))]
    return f"; did you mean {', '.join(guesses)}" if guesses else ""
