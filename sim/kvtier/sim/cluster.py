"""Simulated workers running the real cache logic on the modeled data path.

A worker does continuous batching: each iteration prefills up to ``prefill_budget``
uncached prompt tokens (chunked prefill) and decodes one token for every running
request; its duration comes from the latency model. Iterations with no prefill are
merged into one closed-form decode run, cut short when new work arrives. Load-back
and L3 prefetch sit on the critical path of the request that needs them, per the
cache's prefetch policy.

Disaggregated serving (``prefill_workers`` and ``decode_workers`` > 0): workers ``0..P-1`` prefill, ``P..P+D-1``
decode (their device and batch sized by ``decode_device_tokens`` and ``decode_max_running``, by default the prefill
workers'). A prefill worker runs the full tiered cache and computes the prompt (reserving room for one output token,
as a prefill request with ``max_tokens=1`` does); the computed prompt stays held there until its decode worker has
received it. The decode worker admits the request once its device has room for the prompt and the whole output
(requests wait in its queue until then), matches the prompt against its own radix cache (device only: the tiers
below are the prefill pool's), and receives only the part it lacks over the KV link (``kv_link``), in ``tokens *
bytes per token / bandwidth``. The transfer starts once the prefill has finished, not layer by layer beside it:
vLLM's NixlConnector (what Dynamo and llm-d run) reads the prompt's blocks from the prefill worker when the prefill
request has finished, and Dynamo's mocker times its handoff the same way; a layer-wise push would hide most of it
behind the prefill. Transfers do not contend for a NIC (nor do the mocker's) unless ``kv_link_sharing`` is ``nic``
(:mod:`kvtier.sim.kvlink`). The first token comes from the decode worker's first decode step after the KV landed (as
vLLM's decode worker and Dynamo's mocker produce it), so the transfer and that step show in TTFT. A prompt whose
part its decode worker lacks, as the router's index shows it (whatever the policy: :mod:`kvtier.sim.disagg`), is
under ``local_prefill_tokens`` prefills on its decode worker instead (conditional disaggregation, as vLLM's and
Dynamo's routers allow).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvtier.engine.cache import Admission, CacheConfig, PrefetchPolicy, TieredCache, WritePolicy
from kvtier.engine.config import count_pages
from kvtier.engine.datapath import Bandwidths, ModeledDataPath
from kvtier.engine.l3.storage import PageStore
from kvtier.hardware.latency import (
    PRESETS,
    LatencyModel,
    MockerLatency,
    decode_run_ms,
    decode_step_max_ms,
    decode_steps_done,
    trailing_kv_bytes,
)
from kvtier.hardware.links import (
    DEFAULT_GPU_LINK,
    DEFAULT_KV_LINK,
    DEFAULT_STORAGE_LINK,
    GBPS_RANGE,
    GPU_LINKS,
    KV_LINKS,
    STORAGE_LINKS,
)
from kvtier.indexer.routing.scoring import visible
from kvtier.sim.core import Environment, Timer
from kvtier.sim.kvlink import SHARING, KvLink
from kvtier.sim.metrics import RequestRecord
from kvtier.sim.trace import Request
from kvtier.util.fields import ConfigError, at_least, check_fields, one_of, within
from kvtier.wire.protocol import EventBatch, PackedTokens, StorageTier

#: The fields of every worker's :class:`CacheConfig` a cluster's user sets; the others follow from the cluster
#: (device pages from ``device_tokens``, write-behind from ``l3``, window pools from the model and ``swa_ratio``).
CACHE_SETTINGS = ("page_size", "host_ratio", "write_policy", "eviction", "selective_threshold", "load_back",
                  "prefetch_policy", "prefetch_min_pages", "prefetch_timeout_s", "swa_events")


@dataclass(slots=True, frozen=True)
class ClusterConfig:
    """Workers, their caches and links. The cache settings live once, in :attr:`cache` (a :class:`CacheConfig`,
    whose fields also give the command line its options and defaults); read them as ``cluster.page_size`` etc.,
    and build or change a cluster with flat settings through :meth:`of` and :meth:`replace`."""

    workers: int = field(default=4, metadata=at_least(1, help="inference workers"))
    device_tokens: int = field(default=262_144, metadata=at_least(1, help="device KV per worker, tokens"))
    l3: str = field(default="none", metadata=one_of(
        "none", "disk", "external", help="storage tier: none, a disk per worker, or one external pool"))
    l3_tokens: int = field(default=4_194_304, metadata=at_least(
        1, help="disk per worker, or the external pool's total, tokens"))
    model: str = field(default="llama-3.1-8b", metadata=one_of(*PRESETS))  # KV bytes per token
    # SWA models: window-KV pool tokens per full-attention pool token (SGLang's --swa-full-tokens-ratio): the
    # device KV memory splits as device_tokens full-attention tokens + swa_ratio * device_tokens window tokens
    swa_ratio: float = field(default=0.8, metadata=within(0, 1024, help=(
        "hybrid models: window-KV pool tokens per full-attention pool token (SGLang's --swa-full-tokens-ratio)")))
    # speculative-decoding draft model whose KV moves with each page
    draft_model: str | None = field(default=None, metadata=one_of(*PRESETS, optional=True, help=(
        "speculative decoding's draft model preset: its KV is copied with every page and sent with every prompt "
        "(default: none)")))
    prefill_budget: int = field(default=8192, metadata=at_least(1, help="chunked-prefill tokens per iteration"))
    max_running: int = field(default=64, metadata=at_least(1, help="requests in a worker's batch at once"))
    # host <-> device and host <-> L3, GB/s (see kvtier.hardware.links)
    h2d_gbps: float = field(default=GPU_LINKS[DEFAULT_GPU_LINK].gbps, metadata=within(*GBPS_RANGE))
    storage_gbps: float = field(default=STORAGE_LINKS[DEFAULT_STORAGE_LINK].gbps, metadata=within(*GBPS_RANGE))
    # iteration times (default: the mocker's fit; kvtier.hardware.latency.LATENCY_PRESETS names measured ones)
    latency: MockerLatency = field(default_factory=MockerLatency)
    cache: CacheConfig = field(default_factory=CacheConfig)  # every worker's cache settings (CACHE_SETTINGS)

    @classmethod
    def of(cls, **settings: Any) -> ClusterConfig:
        """A cluster from flat settings: its own fields and any of :data:`CACHE_SETTINGS` (to its cache). A value
        given as a string for an enum-typed setting (``write_policy="write_back"``) is converted."""
        return cls().replace(**settings)

    def replace(self, **settings: Any) -> ClusterConfig:
        """This cluster with some flat settings changed (see :meth:`of`)."""
        cache = {k: settings.pop(k) for k in list(settings) if k in CACHE_SETTINGS}
        for k, v in cache.items():
            kind = type(getattr(self.cache, k))
            if issubclass(kind, Enum) and not isinstance(v, kind):
                cache[k] = kind(v)
        if cache:
            settings["cache"] = dataclasses.replace(self.cache, **cache)
        return dataclasses.replace(self, **settings)

    def settings(self) -> dict[str, Any]:
        """Every setting, flat (the cluster's fields and :data:`CACHE_SETTINGS`), as JSON-ready values."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cache"}
        out.update((k, getattr(self.cache, k)) for k in CACHE_SETTINGS)
        return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type)
                else getattr(v, "value", v) for k, v in out.items()}

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    @property
    def host_ratio(self) -> float:
        return self.cache.host_ratio

    @property
    def write_policy(self) -> WritePolicy:
        return self.cache.write_policy

    @property
    def prefetch_policy(self) -> PrefetchPolicy:
        return self.cache.prefetch_policy

    @property
    def prefetch_min_pages(self) -> int:
        return self.cache.prefetch_min_pages

    @property
    def swa_events(self) -> bool:
        return self.cache.swa_events

    # Disaggregated serving: prefill and decode pools (both 0: aggregated; else they set workers to their sum)
    prefill_workers: int = field(default=0, metadata=at_least(0))
    decode_workers: int = field(default=0, metadata=at_least(0))
    kv_link: str = field(default=DEFAULT_KV_LINK, metadata=one_of(*KV_LINKS))  # prefill -> decode link preset
    kv_gbps: float | None = field(default=None, metadata=within(*GBPS_RANGE, optional=True,
                                                                     option="--kv-link-gbps"))
    # a prompt with fewer uncached tokens than this prefills on its decode worker (0: never)
    local_prefill_tokens: int = field(default=0, metadata=at_least(0))
    # A decode worker's own device KV and batch (None: the prefill pool's device_tokens, max_running), as Dynamo's
    # mocker takes decode engine args apart and SGLang's decode servers are given more running requests.
    decode_device_tokens: int | None = field(default=None, metadata=at_least(1, optional=True, help=(
        "device KV per decode worker, tokens (default: --device-tokens)")))
    decode_max_running: int | None = field(default=None, metadata=at_least(1, optional=True, help=(
        "requests in a decode worker's batch at once (default: --max-running)")))
    # how transfers share the KV link (kvtier.sim.kvlink): none (each at the whole bandwidth, as Dynamo's mocker) or
    # nic (each worker's NIC shared by the transfers it sends or receives at once)
    kv_link_sharing: str = field(default="none", metadata=one_of(*SHARING, help=(
        "how KV transfers share the link: none (each at the whole bandwidth, as Dynamo's mocker) or nic (each "
        "worker's NIC shared by the transfers it sends or receives at once)")))

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0

    @property
    def kv_link_gbps(self) -> float:
        """Prefill -> decode bandwidth, GB/s: ``kv_gbps`` if given, else the preset's."""
        return self.kv_gbps if self.kv_gbps is not None else KV_LINKS[self.kv_link].gbps

    def describe_workers(self) -> str:
        """The workers in words: ``4 workers``, or ``3 prefill + 1 decode workers``."""
        if not self.disaggregated:
            return f"{self.workers} workers"
        return f"{self.prefill_workers} prefill + {self.decode_workers} decode workers"

    def describe_devices(self) -> str:
        """Device KV in words: ``262,144 device tokens each``, or per pool where the decode pool is sized apart."""
        if self.disaggregated and self.decode_device_tokens:
            return f"{self.device_tokens:,} device tokens a prefill worker, {self.decode_device_tokens:,} a decode one"
        return f"{self.device_tokens:,} device tokens each"

    def role(self, worker: int) -> str:
        """``"prefill"``, ``"decode"`` or ``"both"`` (aggregated)."""
        if not self.disaggregated:
            return "both"
        return "prefill" if worker < self.prefill_workers else "decode"

    def decode_config(self) -> ClusterConfig:
        """The decode pool's configuration, as a cluster of its ``decode_workers`` alone: a device cache only (the
        prefill pool holds the tiers below), of its own size and batch where ``decode_device_tokens`` and
        ``decode_max_running`` say."""
        return self.replace(host_ratio=0.0, l3="none", device_tokens=self.decode_device_tokens or self.device_tokens,
                            max_running=self.decode_max_running or self.max_running, workers=self.decode_workers,
                            prefill_workers=0, decode_workers=0, decode_device_tokens=None, decode_max_running=None)

    def cache_config(self) -> CacheConfig:
        """A worker's cache: :attr:`cache` with the sizes the cluster decides."""
        window_pages, swa_pages = self._window_pages()
        return dataclasses.replace(
            self.cache, device_pages=self.device_tokens // self.page_size, l3_write_behind=self.l3 != "none",
            swa_window_pages=window_pages, swa_pages=swa_pages)

    def _window_pages(self, device_tokens: int | None = None) -> tuple[int, int]:
        """Pages a hybrid model's window needs (0 without a window), and the window-KV pool a worker with
        ``device_tokens`` (default: :attr:`device_tokens`) has (sized either way; made only where there is a
        window)."""
        window = PRESETS[self.model].window_tokens
        window_pages = -(-window // self.page_size)  # pages holding the window before a page-aligned cut
        device = (self.device_tokens if device_tokens is None else device_tokens) // self.page_size
        return window_pages, max(window_pages, int(device * self.swa_ratio))

    def _pages(self, device_tokens: int, host_ratio: float) -> float:
        """Device, host and window-KV pages of one worker with ``device_tokens``."""
        window_pages, swa_pages = self._window_pages(device_tokens)
        return count_pages(device_tokens // self.page_size, host_ratio, swa_pages if window_pages else 0)

    def capacity_tokens(self) -> int:
        """Tokens a worker's device pool holds (whole pages)."""
        return self.device_tokens // self.page_size * self.page_size

    def worker_latency(self) -> MockerLatency:
        """The latency fit for a worker's device pool (:meth:`MockerLatency.for_pool`): what the engines charge and
        the router prices with."""
        return self.latency.for_pool(self.capacity_tokens())

    def device_kv_bytes(self) -> int:
        """Device memory the KV pools take per worker: full-attention pages, plus the window-KV pool."""
        preset, cfg = PRESETS[self.model], self.cache_config()
        full = cfg.device_pages * self.page_size * preset.bytes_per_token
        return full + cfg.window_pool_pages * self.page_size * preset.window_bytes_per_token

    def bandwidths(self) -> Bandwidths:
        return Bandwidths(d2h=self.h2d_gbps * 1e9, h2d=self.h2d_gbps * 1e9, storage_write=self.storage_gbps * 1e9,
                          storage_read=self.storage_gbps * 1e9)

    def __post_init__(self) -> None:
        check_fields(self)
        for option, tokens in (("--device-tokens", self.device_tokens),
                               ("--decode-device-tokens", self.decode_device_tokens)):
            if tokens is not None and tokens < self.page_size * 4:
                raise ConfigError(f"{option}: {tokens} holds fewer than 4 pages of --page-size {self.page_size}; "
                                  f"expected >= {self.page_size * 4}")
        device = self.device_tokens // self.page_size
        if self.host_ratio > 0 and int(device * self.host_ratio) == 0:
            least = math.ceil(1e6 / device) / 1e6  # (1/device itself may round to no page)
            raise ConfigError(f"--host-ratio {self.host_ratio:g}: a host tier of no page (--device-tokens "
                              f"{self.device_tokens:,} is {device:,} pages); expected 0 for none, or {least:g} or more")
        if self.l3 != "none" and self.host_ratio <= 0:
            raise ConfigError(f"--l3 {self.l3}: needs a host tier (--host-ratio > 0): pages reach storage from host "
                              "memory and are prefetched back into it")
        try:  # engines charge passes of up to the budget; the router prices a prompt's prefill whole
            self.latency.check_prefill(max(self.prefill_budget, self.capacity_tokens()))
        except ValueError as exc:
            raise ConfigError(f"--latency: {exc} (engines compute up to --prefill-budget tokens a pass, and the "
                              "router prices prompts up to --device-tokens)") from None
        if self.decode_device_tokens is not None and self.prefill_workers > 0:  # (the decode pool's, checked now)
            try:  # a decode worker may prefill a prompt of up to its device (local_prefill_tokens)
                self.latency.check_prefill(self.decode_device_tokens // self.page_size * self.page_size)
            except ValueError as exc:
                raise ConfigError(f"--latency: {exc} (a decode worker's router prices prompts up to "
                                  "--decode-device-tokens)") from None
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            raise ConfigError(f"--prefill-workers {self.prefill_workers} --decode-workers {self.decode_workers}: "
                              "give both (disaggregated) or neither (aggregated)")
        if self.disaggregated:  # the pools make the cluster (so a sweep over them keeps the rest as it is)
            object.__setattr__(self, "workers", self.prefill_workers + self.decode_workers)
        if self.workers > MAX_WORKERS:
            who = (f"--prefill-workers {self.prefill_workers} --decode-workers {self.decode_workers}"
                   if self.disaggregated else f"--workers {self.workers}")
            raise ConfigError(f"{who}: {self.workers:,} workers; a simulation holds at most {MAX_WORKERS:,} (each "
                              "costs some 15 KB and a tenth of a millisecond before it holds a page)")
        if self.l3 != "none" and self.l3_tokens < self.page_size:
            raise ConfigError(f"--l3-tokens: {self.l3_tokens} holds no page of --page-size {self.page_size}")
        # Device, host and window-KV pages, before any is made (a decode worker has no host tier).
        if self.disaggregated:
            pages = (self.prefill_workers * self._pages(self.device_tokens, self.host_ratio)
                     + self.decode_workers * self._pages(self.decode_device_tokens or self.device_tokens, 0.0))
        else:
            pages = self.workers * self._pages(self.device_tokens, self.host_ratio)
        if pages > MAX_PAGES:
            who = (f"--prefill-workers {self.prefill_workers} --decode-workers {self.decode_workers}"
                   if self.disaggregated else f"--workers {self.workers}")
            window_pages, swa_pages = self._window_pages()
            swa = f", --swa-ratio {self.swa_ratio:g} ({swa_pages:,} window-KV pages a worker)" if window_pages else ""
            dec = f", --decode-device-tokens {self.decode_device_tokens}" if self.decode_device_tokens else ""
            raise ConfigError(f"{who}, --device-tokens {self.device_tokens}{dec}, --host-ratio {self.host_ratio:g}"
                              f"{swa}: {pages:,.0f} pages in all; a simulation holds at most {MAX_PAGES:,} (every "
                              "page is bookkept in memory, some 40 bytes each)")

#: Device, host and window-KV pages of a whole simulated cluster at most: their pools are made when the run starts.
MAX_PAGES = 1 << 25
#: Workers of a simulated cluster at most: each has its engine, scheduler and bookkeeping whatever its pages.
MAX_WORKERS = 1 << 14


@dataclass(slots=True, eq=False)
class Job:
    """A request inside a worker."""

    req: Request  # from the trace
    tokens: PackedTokens  # its prompt, packed as the engine keeps it
    record: RequestRecord  # its metrics, filled as it runs
    adm: Admission | None = None  # its hold on the cache
    visible_tier: StorageTier = StorageTier.EXTERNAL  # tiers the router saw when it predicted the overlap
    admitted_at: float = 0.0  # when the cache was first asked
    prefill_left: int = 0  # tokens still to prefill
    generated: int = 0  # output tokens produced
    digests: bytes = b""  # its full pages' digests joined, made ahead (sim.lookahead); empty: the engine makes them
    last_token: float = -1.0  # when its latest token was produced
    gaps: list[float] | None = None  # every inter-token gap, seconds, where the run keeps them (--itl-series)
    # Disaggregated: the prefill worker holding its computed prompt while a decode worker receives it, and the hold
    source: SimWorker | None = None
    source_adm: Admission | None = None


#: The priority of an idle worker's next iteration among the events of one instant: after arrivals (2) and copy
#: completions (1), so that it sees every request of the instant (kvtier.sim.core runs lower priorities first).
START_PRIORITY = 3


@dataclass(slots=True)
class _DecodeRun:
    """Decode iterations merged into one event. Each step runs at its own utilisation: every running
    request adds one token of KV per step, so utilisation rises by ``du`` per step from ``u0``."""

    start: float  # when the run began
    u0: float  # KV utilisation at the first step
    du: float  # utilisation added per step
    steps: int  # iterations planned
    timer: Timer  # fires at the end
    reported: int = 0  # iterations whose tokens the router was told of (SimWorker.report_progress)
    due_ms: float = 0.0  # when, after ``start``, the first iteration not reported ends (0: not worked out yet)


class SimWorker:
    """One engine: queue, batch, cache. Calls ``on_event`` with each event batch it publishes."""

    def __init__(self, index: int, env: Environment, cfg: ClusterConfig, store: PageStore | None,
                 on_event: Callable[[int, EventBatch], None], on_first_token: Callable[[Job], None],
                 on_finish: Callable[[Job], None], latency: LatencyModel | None = None,
                 on_progress: Callable[[Job, int], None] | None = None, role: str = "both",
                 on_prefilled: Callable[[Job], None] | None = None, kv_link: KvLink | None = None) -> None:
        self.index = index
        # "both" (aggregated), "prefill" (computes prompts and hands each to ``on_prefilled``, holding its KV until
        # the decode worker has it: :meth:`release_source`) or "decode" (receives prompts: :meth:`receive`)
        self.role = role
        self._on_prefilled = on_prefilled
        self.env = env
        self.cfg = cfg
        self.latency = latency or cfg.worker_latency()
        model = PRESETS[cfg.model]
        per_token = model.bytes_per_token
        if cfg.draft_model is not None:
            per_token += PRESETS[cfg.draft_model].bytes_per_token  # the draft pool is copied with every page
        page_bytes = per_token * cfg.page_size
        self.kv_bytes_per_token = per_token  # what the KV link carries per prompt token
        # and per token of the prompt's last window, a hybrid model's window KV (bytes per token, window)
        self.kv_window = (model.window_bytes_per_token, model.window_tokens)
        self.dp = ModeledDataPath(page_bytes, lambda: env.now, cfg.bandwidths(),
                                  window_page_bytes=model.window_bytes_per_token * cfg.page_size)
        self.cache = TieredCache(cfg.cache_config(), self.dp, store, name=f"w{index}")
        self._on_event = on_event
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        # (job, tokens generated so far): tokens streamed back, as a router in the response path sees them
        self._on_progress = on_progress
        self.queue: deque[Job] = deque()  # arrived, not yet admitted to the cache
        self.admitted: list[Job] = []  # admitted, waiting for loads or room
        self.running: list[Job] = []  # prefilling or decoding
        self._busy_until: Timer | None = None  # the iteration in progress
        self._decode: _DecodeRun | None = None  # a merged decode run in progress
        self._wake: Timer | None = None  # next copy completion
        self.capacity_tokens = cfg.capacity_tokens()
        # what a decode worker's device holds (a prefill worker's cluster config is the whole cluster's)
        self.decode_capacity_tokens = cfg.decode_config().capacity_tokens() if role == "prefill" else \
            self.capacity_tokens
        self.peers: list[SimWorker] = []  # workers sharing this one's L3 pool
        self.receiving = 0  # decode role: requests whose KV is on the way (they count against max_running)
        self.received: list[Job] = []  # decode role: KV landed; they join the batch at the next iteration
        self.handing_off = 0  # prefill role: computed prompts held here until their decode worker has them
        # rejected requests that fit no decode worker: on a prefill worker, those that fit it; on a decode worker
        # (prefilled there: conditional disaggregation), all
        self.rejected_for_decode = 0
        self.kv_link = kv_link  # decode role: what prompts arrive over (the cluster's one link)

    # --- arrivals and cache bookkeeping --------------------------------------------------

    def submit(self, job: Job, visible_tier: StorageTier = StorageTier.EXTERNAL) -> None:
        """A request arrives; ``visible_tier`` limits the true overlap recorded against the router's guess."""
        job.visible_tier = visible_tier
        # Rejected if it could never fit: here (its prompt and the output room it reserves here) or on a decode
        # worker (its prompt and whole output, at least the one token every request generates).
        prompt = job.req.input_length
        fits_here = prompt + self._output_room(job) <= self.capacity_tokens
        if not fits_here or prompt + max(1, job.req.output_length) > self.decode_capacity_tokens:
            self.rejected_for_decode += fits_here or self.role == "decode"
            job.record.rejected = True
            self._on_finish(job)
            return
        self.queue.append(job)
        self.kick()

    def _flush(self) -> None:
        self._publish()
        # A write into a shared pool can evict pages other engines announced: their removals
        # are published now, as a real engine told by its pool would, not at their next step.
        for peer in self.peers:
            if peer.cache.has_events:
                peer._publish()
        self._schedule_wake()

    def _publish(self) -> None:
        batch = self.cache.flush_events(ts=self.env.now)
        if batch is not None:
            self._on_event(self.index, batch)

    def flush_events(self) -> None:
        """Publishes pending events now (before a state dump, which must cover them)."""
        self._publish()

    def _schedule_wake(self) -> None:
        t = self.dp.next_completion()
        if t is None or (self._wake is not None and self._wake.time <= t and self._wake.time >= self.env.now):
            return
        if self._wake is not None:
            self._wake.cancel()
        self._wake = self.env.at(max(t, self.env.now), self._on_copies, priority=1)

    def _on_copies(self) -> None:
        self._wake = None
        self.cache.poll()
        self._flush()
        self.kick()

    def _ready(self, job: Job) -> bool:
        assert job.adm is not None
        return self.cache.ready(job.adm, job.admitted_at, self.env.now)

    def _admit_from_queue(self) -> None:
        # Admit a bounded number ahead of the batch: admission locks prefixes and starts loads.
        while self.queue and len(self.admitted) + len(self.running) + self.receiving < self.cfg.max_running:
            job = self.queue.popleft()
            if job.record.actual_blocks < 0:  # first admission: what the router's prediction is judged by
                job.record.actual_blocks = visible(self.cache.peek_overlap(job.tokens), job.visible_tier).external
                if self.cache.config.swa_window_pages:
                    job.record.usable_blocks = visible(self.cache.usable_overlap(job.tokens),
                                                       job.visible_tier).external
            job.adm = self.cache.admit(job.req.request_id, job.tokens, job.digests)
            job.admitted_at = self.env.now
            self.admitted.append(job)
            if self.cfg.prefetch_policy is PrefetchPolicy.TIMEOUT and job.adm.prefetch_op is not None:
                self.env.after(self.cache.config.prefetch_timeout_s, self.kick)
        self._flush()

    # --- batching ------------------------------------------------------------------------

    def kick(self) -> None:
        """New work may be possible: start an iteration, or cut a decode run short. An idle worker starts it once
        every event of this instant has run (``START_PRIORITY``), so that requests arriving together are scheduled
        in one batch, as an engine's scheduler step takes every request waiting when it begins."""
        if self._decode is not None:
            self._interrupt_decode()
            return
        if self._busy_until is None and (self.queue or self.admitted or self.running or self.received):
            # (an idle worker with nothing to run would find nothing: every path that gives it work kicks after)
            self._busy_until = self.env.at(self.env.now, self._iterate, priority=START_PRIORITY)

    def _output_room(self, job: Job) -> int:
        """Output tokens ``job`` reserves room for here: its whole output, at least the one token every request
        generates, or one on a prefill worker (as a prefill request with max_tokens=1 does). O(1)."""
        return 1 if self.role == "prefill" else max(1, job.req.output_length)

    def _start_prefills(self) -> None:
        ps = self.cfg.page_size
        for job in list(self.admitted):
            if len(self.running) + self.receiving >= self.cfg.max_running:
                break
            if job.adm is None:
                continue  # sent back to the queue by _unlock_others
            if not self._ready(job):
                continue
            assert job.adm is not None
            plan = self.cache.begin_prefill(job.adm, self._output_room(job))
            if plan is None and not self.running and not self.receiving and not self.dp.ops:
                self._unlock_others(job)  # nothing will free room: admitted prefixes hold it, or its own window
                # (a prompt handed off frees its hold once received: its window KV then goes the usual way)
                plan = self.cache.begin_prefill(job.adm, self._output_room(job), last_resort=not self.handing_off)
            if plan is None:
                break  # no device room: wait for running requests to finish
            self.admitted.remove(job)
            rec = job.record
            if job.source is not None:  # its prompt was computed on a prefill worker: receive what is missing
                self._start_receive(job, plan.cached_tokens, plan.compute_tokens)
                continue
            # The split is taken now, when prefill starts: the cached prefix is what was on device at
            # admission, then the host run loaded back, then the L3 run prefetched; whatever else is
            # on device now was computed by a concurrent request since admission, a device hit too (so is
            # all of it where nothing is loaded back: host and L3 pages then never reach the device).
            adm, cached = job.adm, plan.cached_tokens // ps
            host = storage = 0
            if self.cache.config.load_back:
                host = min(adm.host_pages, max(0, cached - adm.device_pages))
                storage = min(adm.l3_pages, max(0, cached - adm.device_pages - host))
            rec.device_tokens = (cached - host - storage) * ps
            rec.host_tokens, rec.storage_tokens = host * ps, storage * ps
            rec.recomputed_tokens = plan.compute_tokens
            rec.prefill_start = self.env.now
            # A prompt cached whole still runs its last token through the model for the logits of its first output
            # token (SGLang and vLLM match at most all but the last token): one token of prefill, its KV already
            # on device, so the tier split above stands.
            job.prefill_left = max(plan.compute_tokens, 1)
            self.running.append(job)
        self._flush()

    # --- disaggregated serving -----------------------------------------------------------

    def receive(self, job: Job) -> None:
        """Decode role: ``job``'s prompt was computed on ``job.source``; it waits here for room (its prompt and
        whole output), then receives the KV this worker's cache lacks."""
        assert job.source is not None and self.role != "prefill"
        self.queue.append(job)
        self.kick()

    def _start_receive(self, job: Job, cached: int, missing: int) -> None:
        rec = job.record
        rec.decode_cached_tokens, rec.transferred_tokens = cached, missing
        rec.receive_start = self.env.now
        self.receiving += 1
        nbytes = trailing_kv_bytes(missing, self.kv_bytes_per_token, *self.kv_window)
        assert self.kv_link is not None and job.source is not None, "a decode worker receives over the KV link"
        self.kv_link.start(job.source.index, self.index, nbytes, lambda: self._received(job))

    def _received(self, job: Job) -> None:
        self.receiving -= 1
        assert job.adm is not None and job.source is not None
        self.cache.finish_prefill(job.adm)  # the received pages join this worker's radix cache
        job.source.release_source(job)
        self.received.append(job)
        self._flush()
        self.kick()

    def release_source(self, job: Job) -> None:
        """Prefill role: the decode worker has ``job``'s KV; its pages here are free to evict."""
        assert job.source_adm is not None
        self.cache.release(job.source_adm)
        job.source_adm = None
        self.handing_off -= 1
        self._flush()
        self.kick()

    def _unlock_others(self, keep: Job) -> None:
        """Releases every other admission (they re-queue in order) so ``keep`` can get room."""
        others = [j for j in self.admitted if j is not keep]
        for j in reversed(others):
            assert j.adm is not None
            self.cache.release(j.adm)
            j.adm = None
            self.admitted.remove(j)
            self.queue.appendleft(j)

    def _iterate(self) -> None:
        self._busy_until = None
        if self.received:  # received KV: these decode from this iteration on, their first token at its end
            self.running.extend(self.received)
            self.received.clear()
        self._admit_from_queue()
        self._start_prefills()
        budget = self.cfg.prefill_budget
        chunks: list[tuple[Job, int]] = []
        for job in self.running:
            if job.prefill_left > 0 and budget > 0:
                take = min(job.prefill_left, budget)
                chunks.append((job, take))
                budget -= take
        decoders = [j for j in self.running if j.prefill_left == 0]
        if not chunks and not decoders:
            return  # idle until an arrival or a copy completion
        if not chunks:
            self._start_decode_run(decoders)
            return
        step = self._decode_step(decoders) if decoders else 0.0
        tokens = sum(t for _, t in chunks)
        dt = self.latency.prefill_ms(tokens) / 1000.0 + step
        self._busy_until = self.env.after(dt, lambda: self._end_iteration(chunks, decoders))

    def _utilisation(self, jobs: list[Job] | None = None) -> float:
        """The KV ``jobs`` (default: every running request) attend over, as a share of the device pool."""
        return sum(j.req.input_length + j.generated for j in (self.running if jobs is None else jobs)) \
            / self.capacity_tokens

    def _decode_step(self, decoders: list[Job]) -> float:
        """The decode part of a mixed iteration: its time grows with the context the decoding requests attend over,
        not with prompts still being prefilled beside them (a prompt's chunks are the prefill part's cost), as
        Dynamo's mocker times it too."""
        return self.latency.decode_ms(self._utilisation(decoders)) / 1000.0

    def _end_iteration(self, chunks: list[tuple[Job, int]], decoders: list[Job]) -> None:
        now = self.env.now
        for job in decoders:
            self._advance(job, 1, now, 0.0, ())
        for job, take in chunks:
            job.prefill_left -= take
            if job.prefill_left == 0:
                assert job.adm is not None
                self.cache.finish_prefill(job.adm)
                if self.role == "prefill":  # computed: held here until its decode worker has received it
                    assert self._on_prefilled is not None
                    job.record.prefill_end = now
                    self.running.remove(job)
                    job.source, job.source_adm, job.adm = self, job.adm, None
                    self.handing_off += 1
                    self._on_prefilled(job)
                    continue
                job.record.first_token = now
                self._on_first_token(job)
                self._advance(job, 1, now, 0.0, ())
        self._flush()
        self._iterate()

    def _advance(self, job: Job, steps: int, first_at: float, later_max: float, later: Sequence[float]) -> None:
        """``steps`` more tokens of ``job``: the first at ``first_at``, each later one its step after the one before,
        ``later_max`` the longest of those steps and ``later`` all of them (read only where ``job.gaps`` is kept).
        Records its time to the second token and its longest inter-token gap. O(1), O(steps) keeping gaps."""
        rec = job.record
        if job.generated:
            gap = first_at - job.last_token
            if job.generated == 1:
                rec.second_token = first_at
            rec.max_itl = max(rec.max_itl, gap, later_max)
            if job.gaps is not None:
                job.gaps.append(gap)
                job.gaps.extend(later)
        else:
            assert steps == 1, "a first token comes alone, at the end of its prefill or first decode step"
            if rec.first_token < 0:  # its KV was received: its first token is its first decode step's
                rec.first_token = self.env.now
                self._on_first_token(job)
        job.last_token = self.env.now
        job.generated += steps
        if job.generated >= max(job.req.output_length, 1):
            job.record.finish = self.env.now
            assert job.adm is not None
            self.cache.release(job.adm)
            self.running.remove(job)
            self._on_finish(job)
        elif self._on_progress is not None:
            self._on_progress(job, job.generated)

    # --- closed-form decode --------------------------------------------------------------

    def _start_decode_run(self, decoders: list[Job]) -> None:
        # A request whose KV was received makes its first token alone: the run stops after one step.
        steps = max(1, min((max(j.req.output_length, 1) - j.generated) if j.generated else 1 for j in decoders))
        u0, du = self._utilisation(), len(decoders) / self.capacity_tokens
        timer = self.env.after(decode_run_ms(self.latency, u0, du, steps) / 1000.0, self._end_decode_run)
        self._decode = _DecodeRun(self.env.now, u0, du, steps, timer)

    def report_progress(self) -> None:
        """Tells ``on_progress`` of the tokens the merged decode run in progress has generated by now, as the
        one-step iterations it stands for would have as each ended: a router in the response path sees every token
        as it streams back, and the loads it routes by must not depend on how the simulator merges steps. Called
        before each routing decision; a run whose steps done have not changed since is skipped. O(decoding
        requests) when a step ended since, else O(1)."""
        run = self._decode
        if run is None or self._on_progress is None:
            return
        elapsed_ms = (self.env.now - run.start) * 1000.0
        if elapsed_ms + 1e-9 < run.due_ms:  # (decode_steps_done's tolerance)
            return
        lat = self.latency
        done = decode_steps_done(lat, run.u0, run.du, run.steps, elapsed_ms, run.reported)
        run.due_ms = decode_run_ms(lat, run.u0, run.du, done + 1) if done < run.steps else math.inf
        if done == run.reported:
            return
        run.reported = done
        for job in self.running:
            # (a request whose KV was received makes its first token in a run of one step: told when it ends)
            if job.prefill_left == 0 and job.generated:
                self._on_progress(job, job.generated + done)

    def _interrupt_decode(self) -> None:
        run = self._decode
        assert run is not None
        elapsed_ms = (self.env.now - run.start) * 1000.0
        done = decode_steps_done(self.latency, run.u0, run.du, run.steps, elapsed_ms)
        cut = min(done + 1, run.steps)  # finish the iteration in progress
        if cut >= run.steps:
            return
        run.timer.cancel()
        run.steps = cut
        run.timer = self.env.at(run.start + decode_run_ms(self.latency, run.u0, run.du, cut) / 1000.0,
                                self._end_decode_run)

    def _end_decode_run(self) -> None:
        run = self._decode
        assert run is not None
        self._decode = None
        # Every decoder got a token per step: the first at the end of the run's first step, each later one a step
        # later, steps that lengthen (or not) with the utilisation each added token brings.
        lat, u0, du = self.latency, run.u0, run.du
        first_at = run.start + lat.decode_ms(u0) / 1000.0
        later_max = decode_step_max_ms(lat, u0 + du, du, run.steps - 1) / 1000.0
        jobs = [j for j in self.running if j.prefill_left == 0]
        later: Sequence[float] = ()
        if run.steps > 1 and any(j.gaps is not None for j in jobs):
            later = [lat.decode_ms(u0 + k * du) / 1000.0 for k in range(1, run.steps)]
        for job in jobs:
            self._advance(job, run.steps, first_at, later_max, later)
        self._flush()
        self._iterate()


@dataclass(slots=True)
class Cluster:
    """Workers plus the shared pool, if any."""

    cfg: ClusterConfig  # configuration
    workers: list[SimWorker] = field(default_factory=list)  # by index
    pool: PageStore | None = None  # shared external store

    @property
    def caches(self) -> list[TieredCache]:
        return [w.cache for w in self.workers]

    def report_progress(self) -> None:
        """Every worker's decode progress up to now, told to the router (:meth:`SimWorker.report_progress`)."""
        for w in self.workers:
            w.report_progress()


def build_cluster(cfg: ClusterConfig, env: Environment, on_event: Callable[[int, EventBatch], None],
                  on_first_token: Callable[[Job], None], on_finish: Callable[[Job], None],
                  latency: LatencyModel | None = None, on_progress: Callable[[Job, int], None] | None = None,
                  on_prefilled: Callable[[Job], None] | None = None) -> Cluster:
    """The workers; disaggregated, ``on_prefilled`` hears each prompt a prefill worker computed (see the module
    docstring: it hands the job to a decode worker's :meth:`SimWorker.receive`)."""
    pages = max(1, cfg.l3_tokens // cfg.page_size)
    pool = PageStore(pages, shared=True) if cfg.l3 == "external" else None
    cluster = Cluster(cfg, pool=pool)
    decode_cfg = cfg.decode_config() if cfg.disaggregated else cfg
    link = KvLink(env, cfg.kv_link_gbps, cfg.kv_link_sharing) if cfg.disaggregated else None
    for i in range(cfg.workers):
        role = cfg.role(i)
        if role == "decode":
            cluster.workers.append(SimWorker(i, env, decode_cfg, None, on_event, on_first_token, on_finish, latency,
                                             on_progress, role, kv_link=link))
            continue
        store = pool if pool is not None else (PageStore(pages) if cfg.l3 == "disk" else None)
        cluster.workers.append(SimWorker(i, env, cfg, store, on_event, on_first_token, on_finish, latency,
                                         on_progress, role, on_prefilled))
    if pool is not None:
        sharing = [w for w in cluster.workers if w.role != "decode"]
        for w in sharing:
            w.peers = [p for p in sharing if p is not w]
    return cluster
