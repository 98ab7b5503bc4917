"""Latency and transfer-time models shared by the router's TTFT estimate and the simulator."""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
from dataclasses import dataclass
from typing import Protocol

from kvtier.util.infile import SETTINGS_BYTES, read_text
from kvtier.wire.protocol import StorageTier


class LatencyModel(Protocol):
    """Iteration times of one worker."""

    def prefill_ms(self, tokens: int) -> float:
        """Time of one forward pass computing ``tokens`` uncached prompt tokens."""
        ...

    def decode_ms(self, kv_utilization: float) -> float:
        """Time of one decode iteration at ``kv_utilization`` (active KV / device capacity)."""
        ...


#: The largest latency coefficient accepted, in size (ms, ms per token, ...): prices stay finite.
MAX_COEFFICIENT = 1e9


@dataclass(slots=True, frozen=True)
class MockerLatency:
    """NVIDIA Dynamo mocker's functional form, in milliseconds: prefill quadratic in uncached tokens,
    decode quadratic in KV utilisation. The defaults are the mocker's published fit (SPEC section 4);
    :func:`fit_latency` fits the same form to measured points (``kvtier fit-latency``)."""

    prefill_a: float = 4.209989e-7  # ms per token^2
    prefill_b: float = 1.518344e-2  # ms per token
    prefill_c: float = 16.50142  # ms per prefill pass
    decode_a: float = -25.74  # ms per utilisation^2
    decode_b: float = 54.01  # ms per utilisation
    decode_c: float = 5.74  # ms per decode iteration
    decode_floor: float = 1.0  # ms, lower bound of a decode iteration
    # KV tokens of the device pool the decode utilisation was measured against; 0: none stated, the utilisation
    # of whatever pool it is used with (the mocker's published fit states none)
    kv_pool_tokens: int = 0

    def for_pool(self, tokens: int) -> MockerLatency:
        """This fit for a device KV pool of ``tokens``: a decode step costs what the same KV in use cost where it
        was measured, so utilisation ``u`` of this pool is ``u * tokens / kv_pool_tokens`` of the measured one (the
        decode coefficients rescale). Unchanged where the fit states no pool."""
        if not self.kv_pool_tokens or tokens == self.kv_pool_tokens:
            return self
        k = tokens / self.kv_pool_tokens
        return dataclasses.replace(self, decode_a=self.decode_a * k * k, decode_b=self.decode_b * k,
                                   kv_pool_tokens=tokens)

    def check_bounded(self) -> None:
        """``ValueError`` unless every coefficient, and the decode floor, is at most :data:`MAX_COEFFICIENT` in size:
        larger ones (a fit to absurd points, a hand-written file) overflow prices to infinity or NaN, where routing
        can no longer tell workers apart. O(1)."""
        for name in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c", "decode_floor"):
            v = getattr(self, name)
            if not abs(v) <= MAX_COEFFICIENT:
                raise ValueError(f"its {name} is {v:.3g}; a latency coefficient must be at most {MAX_COEFFICIENT:.0e} "
                                 "in size")

    def check_prefill(self, max_tokens: int) -> None:
        """``ValueError`` unless a prefill of every size from 1 to ``max_tokens`` tokens takes a positive time under
        this fit: a quadratic fitted to few or odd points may bend below zero inside that range, where simulated time
        would run backwards and a router's price turn into a credit. O(1): a quadratic's lowest value over a range
        is at an end or at its vertex."""
        a, b = self.prefill_a, self.prefill_b
        at = {1, max_tokens}
        if a > 0 and 1 < -b / (2 * a) < max_tokens:
            vertex = -b / (2 * a)
            at.update((math.floor(vertex), math.ceil(vertex)))
        worst = min(sorted(at), key=self.prefill_ms)
        if not self.prefill_ms(worst) > 0:
            raise ValueError(f"its prefill fit gives {self.prefill_ms(worst):.3g} ms for {worst} tokens; a prefill "
                             f"of 1 to {max_tokens} tokens must take more than 0 ms")

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.prefill_a * tokens * tokens + self.prefill_b * tokens + self.prefill_c

    def decode_ms(self, kv_utilization: float) -> float:
        u = min(max(kv_utilization, 0.0), 1.0)
        return max(self.decode_floor, self.decode_a * u * u + self.decode_b * u + self.decode_c)


@dataclass(slots=True, frozen=True)
class ModelPreset:
    """KV geometry of a model: what one token of KV cache costs in bytes, per kind of layer.

    Hybrid models mix full-attention layers, whose KV every later token attends to, with sliding-window
    layers, which attend to the last ``window_tokens`` only: a cached prefix is reusable where its full KV
    is there and the window before its end still has window KV (SGLang's SWA radix cache).
    """

    name: str  # e.g. "llama-3.1-8b"
    num_layers: int  # full-attention layers holding KV
    num_kv_heads: int  # KV heads per layer (GQA)
    head_dim: int  # dimension per head
    dtype_bytes: int = 2  # bf16
    swa_layers: int = 0  # sliding-window layers (0: a full-attention model)
    window_tokens: int = 0  # their window, tokens
    source: str = ""  # where the geometry comes from

    @property
    def bytes_per_token(self) -> int:
        """Full-attention KV per token (what every cached page carries)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V

    @property
    def window_bytes_per_token(self) -> int:
        """Sliding-window KV per token (kept for the window before a prefix's end only)."""
        return 2 * self.swa_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-3.1-8b", 32, 8, 128),  # 128 KiB/token, full attention (the control)
        ModelPreset("llama-3.1-70b", 80, 8, 128),  # 320 KiB/token
        ModelPreset("qwen2.5-7b", 28, 4, 128),  # 56 KiB/token
        # Hybrid models, from their public config.json (layer_types / sliding_window_pattern):
        # 24 layers alternating sliding (window 128) and full, 8 KV heads of 64: 24 KiB/token each kind.
        ModelPreset("gpt-oss-20b", 12, 8, 64, swa_layers=12, window_tokens=128,
                    source="openai/gpt-oss-20b config.json: 24 layers, layer_types alternate, sliding_window 128"),
        # 36 layers alternating, 8 KV heads of 64: 36 KiB/token each kind.
        ModelPreset("gpt-oss-120b", 18, 8, 64, swa_layers=18, window_tokens=128,
                    source="openai/gpt-oss-120b config.json: 36 layers, layer_types alternate, sliding_window 128"),
        # 62 layers, every sixth global (10 full, 52 sliding, window 1024), 16 KV heads of 128:
        # 80 KiB/token full, 416 KiB/token window.
        ModelPreset("gemma-3-27b", 10, 16, 128, swa_layers=52, window_tokens=1024,
                    source="google/gemma-3-27b config.json: 62 layers, sliding_window_pattern 6, sliding_window 1024"),
        ModelPreset("tiny", 2, 2, 16),  # for tests: 256 B/token
        ModelPreset("tiny-swa", 2, 2, 16, swa_layers=2, window_tokens=128),  # for tests: 256 B/token each kind
    )
}


def trailing_kv_bytes(tokens: int, bytes_per_token: int, window_bytes_per_token: int = 0,
                      window_tokens: int = 0) -> int:
    """KV bytes to move for ``tokens`` tokens that end a prompt: every token's full-attention KV, and a hybrid
    model's sliding-window KV for the last ``window_tokens`` of them (all a later token attends to: SGLang's
    TRAILING_PAGES). A load into device memory and a prefill-to-decode transfer move the same. O(1)."""
    tokens = max(0, tokens)
    return tokens * bytes_per_token + min(tokens, window_tokens) * window_bytes_per_token


@dataclass(slots=True, frozen=True)
class TransferModel:
    """Time to bring cached KV into device memory, per source tier."""

    bytes_per_token: int  # from a ModelPreset (full-attention KV)
    host_to_device_gbps: float = 54.0  # GB/s, hardware.GPU_LINKS["h100-pcie5"]
    storage_to_host_gbps: float = 7.45  # GB/s, hardware.STORAGE_LINKS["nvme-gen4"]
    external_to_host_gbps: float = 7.45  # GB/s, a pool reached at the storage link's speed
    window_bytes_per_token: int = 0  # SWA models: window KV per token, moved for the trailing window only
    window_tokens: int = 0  # SWA models: the window

    @classmethod
    def for_model(cls, preset: ModelPreset, **links: float) -> TransferModel:
        return cls(preset.bytes_per_token, window_bytes_per_token=preset.window_bytes_per_token,
                   window_tokens=preset.window_tokens, **links)

    def load_ms(self, tier: StorageTier, tokens: int) -> float:
        """Milliseconds to load ``tokens`` tokens of KV from ``tier`` into device memory (with SWA, the
        window KV of their last ``window_tokens`` too: SGLang's TRAILING_PAGES)."""
        if tier is StorageTier.DEVICE or tokens <= 0:
            return 0.0
        nbytes = trailing_kv_bytes(tokens, self.bytes_per_token, self.window_bytes_per_token, self.window_tokens)
        ms = nbytes / (self.host_to_device_gbps * 1e6)
        if tier is StorageTier.DISK:
            ms += nbytes / (self.storage_to_host_gbps * 1e6)
        elif tier is StorageTier.EXTERNAL:
            ms += nbytes / (self.external_to_host_gbps * 1e6)
        return ms


def _quadratic_sum(a: float, b: float, c: float, u0: float, du: float, n: int) -> float:
    """``sum(a*u*u + b*u + c for u = u0 + k*du, k < n)`` in O(1)."""
    s1 = n * (n - 1) / 2  # sum of k
    s2 = (n - 1) * n * (2 * n - 1) / 6  # sum of k^2
    return a * (n * u0 * u0 + 2 * u0 * du * s1 + du * du * s2) + b * (n * u0 + du * s1) + c * n


def decode_run_ms(model: LatencyModel, u0: float, du: float, steps: int) -> float:
    """Time of ``steps`` decode iterations whose utilisation starts at ``u0`` and rises by ``du`` per step
    (each running request adds a token of KV per iteration).

    O(1) for :class:`MockerLatency` wherever its floor cannot bind (always, for the published fit, whose
    minimum over [0, 1] is 5.74 ms); otherwise, and for other models, the exact sum in O(steps).
    """
    if steps <= 0:
        return 0.0
    if isinstance(model, MockerLatency):
        # Utilisation is clamped at 1: split the run where it gets there.
        below = steps if du <= 0 else min(steps, max(0, math.ceil((1.0 - u0) / du)))
        if u0 >= 1.0:
            below = 0
        a, b, c = model.decode_a, model.decode_b, model.decode_c
        # The run's utilisations below 1 lie in [0, 1): a fit whose floor binds nowhere there needs no check.
        if below == 0 or _floor_free(a, b, c, model.decode_floor) or _lowest(
                (a, b, c), max(u0, 0.0), max(u0 + du * max(below - 1, 0), 0.0)) >= model.decode_floor:
            run = _quadratic_sum(a, b, c, u0, du, below) if below else 0.0
            # (Runs rarely reach full utilisation: the clamped part is skipped, not multiplied by 0.)
            return run + (steps - below) * model.decode_ms(1.0) if below < steps else run
    return math.fsum(model.decode_ms(u0 + k * du) for k in range(steps))


def _poly(q: tuple[float, float, float], u: float) -> float:
    return q[0] * u * u + q[1] * u + q[2]


def _lowest(q: tuple[float, float, float], lo: float, hi: float) -> float:
    """The quadratic's minimum over [lo, hi]. O(1)."""
    vertex = -q[1] / (2 * q[0]) if q[0] else lo
    return min(_poly(q, lo), _poly(q, hi), _poly(q, vertex) if lo <= vertex <= hi else math.inf)


@functools.lru_cache(maxsize=64)
def _floor_free(a: float, b: float, c: float, floor: float) -> bool:
    """Whether the decode fit ``a*u*u + b*u + c`` stays at or above ``floor`` over all of [0, 1] (the published
    fit's minimum there is 5.74 ms, its floor 1 ms). O(1), once per fit: keyed by its four numbers, which hash
    faster than the whole model (decode runs ask this ~15 times per simulated request)."""
    return _lowest((a, b, c), 0.0, 1.0) >= floor


def decode_step_max_ms(model: LatencyModel, u0: float, du: float, steps: int) -> float:
    """The longest of such a run's ``steps`` iterations (0 for none): the largest inter-token gap it gives each of
    its requests. O(1) for :class:`MockerLatency`, whose step is a quadratic of the utilisation, clamped to [0, 1]
    and floored, so that its largest value over the run lies at an end or beside the parabola's vertex; otherwise
    O(steps)."""
    if steps <= 0:
        return 0.0
    if isinstance(model, MockerLatency):
        ks = {0, steps - 1}
        a, b = model.decode_a, model.decode_b
        if a < 0 and du > 0:  # concave: the vertex may lie inside the run
            k = (-b / (2 * a) - u0) / du
            if 0 <= k <= steps - 1:
                ks.update((math.floor(k), min(steps - 1, math.ceil(k))))
        return max(model.decode_ms(u0 + k * du) for k in ks)
    return max(model.decode_ms(u0 + k * du) for k in range(steps))


def decode_steps_done(model: LatencyModel, u0: float, du: float, steps: int, elapsed_ms: float,
                      at_least: int = 0) -> int:
    """How many whole iterations of such a run have completed ``elapsed_ms`` after it began (at most
    ``steps``; ``at_least`` of them known done). O(log(steps - at_least)) evaluations of :func:`decode_run_ms`."""
    lo, hi = at_least, steps
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_run_ms(model, u0, du, mid) <= elapsed_ms + 1e-9:
            lo = mid
        else:
            hi = mid - 1
    return lo


#: Iteration-time fits by name (``--latency NAME``; a fit JSON from ``kvtier fit-latency`` is taken too).
LATENCY_PRESETS: dict[str, MockerLatency] = {
    # NVIDIA Dynamo mocker's published fit (SPEC section 4), borrowed: the default.
    "dynamo-mocker": MockerLatency(),
    # Measured: bench/gpu_latency.py on one NVIDIA H200 (141 GB, driver 580.159, torch 2.11 + CUDA 13), a
    # Llama-3.1-8B-shaped model with random bf16 weights, eager prefill and CUDA-graph decode; fitted by
    # `kvtier fit-latency bench/data/gpu_latency_h200_llama-3.1-8b.csv --kv-pool-tokens 875422` (every point:
    # 11 prefill, 46 decode; rmse 4.8 and 2.9 ms). The pool is 0.9 of the H200's memory less weights and 4 GiB.
    "h200-llama-3.1-8b": MockerLatency(4.2209781088944336e-07, 0.026373971651130163, 0.7603929817660651,
                                       -2.401749159691438, 27.06315586710595, 8.827822163133117,
                                       kv_pool_tokens=875_422),
}
DEFAULT_LATENCY = "dynamo-mocker"


def resolve_latency(spec: str) -> MockerLatency:
    """A preset of :data:`LATENCY_PRESETS` by name, or a fit JSON file (:func:`latency_from_json`). ``ValueError``
    names what was wrong (an unknown name that is no file lists the presets)."""
    if spec in LATENCY_PRESETS:
        return LATENCY_PRESETS[spec]
    if not os.path.lexists(spec):
        raise ValueError(f"{spec}: No such file, nor a latency preset ({', '.join(LATENCY_PRESETS)})")
    try:
        text = read_text(spec, SETTINGS_BYTES, "a fit JSON")
    except ValueError as exc:
        raise ValueError(f"{spec}: {exc}") from None
    try:
        return latency_from_json(text)
    except ValueError as exc:
        raise ValueError(f"{spec}: {exc}") from None


#: The largest x (tokens, or a utilisation) a fit takes: far past any pass, and squared far from overflow.
_FIT_MAX_X = 1e12


def fit_latency(prefill: list[tuple[float, float]], decode: list[tuple[float, float]],
                kv_pool_tokens: int = 0) -> MockerLatency:
    """Least-squares fit of the mocker's functional form to measured points.

    ``prefill``: (uncached tokens in the pass, ms); ``decode``: (KV utilisation in [0, 1], ms), of a device pool of
    ``kv_pool_tokens`` tokens if given (see :meth:`MockerLatency.for_pool`). Each needs at least 3 points. A decode
    set may be empty: the default decode fit is then kept.
    Raises ``ValueError`` naming what is missing or out of range.
    """
    import numpy as np

    def quadratic(points: list[tuple[float, float]], what: str) -> tuple[float, float, float]:
        if len(points) < 3:
            raise ValueError(f"fitting {what} needs at least 3 points, got {len(points)}")
        xs = np.array([x for x, _ in points], dtype=float)
        ys = np.array([y for _, y in points], dtype=float)
        if not (np.isfinite(xs).all() and np.isfinite(ys).all()) or (ys <= 0).any() or (xs < 0).any():
            raise ValueError(f"{what} points must be finite, x >= 0 and ms > 0")
        if (xs > _FIT_MAX_X).any():  # (x squared must not overflow: lstsq would never return)
            raise ValueError(f"{what} points must have x at most {_FIT_MAX_X:g}")
        if len(set(xs.tolist())) < 3:
            raise ValueError(f"fitting {what} needs at least 3 distinct x values")
        a, b, c = np.linalg.lstsq(np.stack([xs * xs, xs, np.ones_like(xs)], axis=1), ys, rcond=None)[0]
        return float(a), float(b), float(c)

    pa, pb, pc = quadratic(prefill, "prefill")
    default = MockerLatency()
    da, db, dc = quadratic(decode, "decode") if decode else (default.decode_a, default.decode_b, default.decode_c)
    if any(u > 1 for u, _ in decode):
        raise ValueError("decode utilisation must be in [0, 1]")
    if kv_pool_tokens < 0:
        raise ValueError(f"kv_pool_tokens must be >= 0, got {kv_pool_tokens}")
    fit = MockerLatency(pa, pb, pc, da, db, dc, kv_pool_tokens=kv_pool_tokens)
    fit.check_bounded()
    fit.check_prefill(max(1, math.ceil(max(x for x, _ in prefill))))  # at least over the measured passes
    return fit


#: Cap on a CSV of measured points: a few hundred thousand rows.
POINTS_BYTES = 16 << 20


def load_latency_points(path: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Reads measured points from a CSV with columns ``kind,x,ms``: ``kind`` is ``prefill`` (x = tokens)
    or ``decode`` (x = KV utilisation). Raises ``ValueError`` naming the file and line of a bad row."""
    import csv

    prefill: list[tuple[float, float]] = []
    decode: list[tuple[float, float]] = []
    try:
        text = read_text(path, POINTS_BYTES, "a CSV of kind,x,ms")
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        if reader.fieldnames is None or not {"kind", "x", "ms"} <= set(reader.fieldnames):
            raise ValueError(f"{path}:1: expected columns kind,x,ms, got {reader.fieldnames}")
        for lineno, row in enumerate(reader, 2):
            kind = (row["kind"] or "").strip()
            try:
                x, ms = float(row["x"]), float(row["ms"])
            except (TypeError, ValueError):
                got = f"{row['x']!r}, {row['ms']!r}"
                raise ValueError(f"{path}:{lineno}: x and ms must be numbers, got {got}") from None
            if kind == "prefill":
                prefill.append((x, ms))
            elif kind == "decode":
                decode.append((x, ms))
            else:
                raise ValueError(f"{path}:{lineno}: kind must be 'prefill' or 'decode', got {kind!r}")
    except csv.Error as exc:  # (a field past the csv module's limit, a NUL byte)
        raise ValueError(f"{path}:{reader.line_num + 1}: {exc}") from None  # (the line it was reading)
    return prefill, decode


def latency_to_json(model: MockerLatency) -> str:
    """The fit as JSON (what ``--latency`` reads)."""
    import json

    obj: dict[str, object] = {"prefill_ms": [model.prefill_a, model.prefill_b, model.prefill_c],
                              "decode_ms": [model.decode_a, model.decode_b, model.decode_c],
                              "decode_floor_ms": model.decode_floor}
    if model.kv_pool_tokens:
        obj["kv_pool_tokens"] = model.kv_pool_tokens
    return json.dumps(obj, indent=2) + "\n"


def latency_from_json(text: str) -> MockerLatency:
    """Inverse of :func:`latency_to_json`; ``ValueError`` says which field is wrong."""
    import json

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object with prefill_ms and decode_ms")
    coeffs: dict[str, list[float]] = {}
    for key in ("prefill_ms", "decode_ms"):
        v = obj.get(key)
        if (not isinstance(v, list) or len(v) != 3
                or not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in v)):
            raise ValueError(f"{key} must be a list of 3 finite numbers [a, b, c], got {v!r}")
        coeffs[key] = [float(x) for x in v]
    floor = obj.get("decode_floor_ms", 1.0)
    if not isinstance(floor, int | float) or isinstance(floor, bool) or not floor > 0:
        raise ValueError(f"decode_floor_ms must be a positive number, got {floor!r}")
    pool = obj.get("kv_pool_tokens", 0)
    if not isinstance(pool, int) or isinstance(pool, bool) or pool < 0:
        raise ValueError(f"kv_pool_tokens must be a whole number >= 0, got {pool!r}")
    (pa, pb, pc), (da, db, dc) = coeffs["prefill_ms"], coeffs["decode_ms"]
    model = MockerLatency(pa, pb, pc, da, db, dc, float(floor), pool)
    model.check_bounded()
    return model
