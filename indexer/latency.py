"""Latency and transfer-time models shared by the router's TTFT estimate and the simulator."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from kvtier.wire.protocol import StorageTier


class LatencyModel(Protocol):
    """Iteration times of one worker."""

    def prefill_ms(self, tokens: int) -> float:
        """Time of one forward pass computing ``tokens`` uncached prompt tokens."""
        ...

    def decode_ms(self, kv_utilization: float) -> float:
        """Time of one decode iteration at ``kv_utilization`` (active KV / device capacity)."""
        ...


@dataclass(slots=True, frozen=True)
class MockerLatency:
    """NVIDIA Dynamo mocker's published fit (SPEC section 4), in milliseconds."""

    prefill_a: float = 4.209989e-7  # ms per token^2
    prefill_b: float = 1.518344e-2  # ms per token
    prefill_c: float = 16.50142  # ms per prefill pass
    decode_a: float = -25.74  # ms per utilisation^2
    decode_b: float = 54.01  # ms per utilisation
    decode_c: float = 5.74  # ms per decode iteration
    decode_floor: float = 1.0  # ms, lower bound of a decode iteration

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.prefill_a * tokens * tokens + self.prefill_b * tokens + self.prefill_c

    def decode_ms(self, kv_utilization: float) -> float:
        u = min(max(kv_utilization, 0.0), 1.0)
        return max(self.decode_floor, self.decode_a * u * u + self.decode_b * u + self.decode_c)


@dataclass(slots=True, frozen=True)
class ModelPreset:
    """KV geometry of a model: what one token of KV cache costs in bytes."""

    name: str  # e.g. "llama-3.1-8b"
    num_layers: int  # transformer layers holding KV
    num_kv_heads: int  # KV heads per layer (GQA)
    head_dim: int  # dimension per head
    dtype_bytes: int = 2  # bf16

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-3.1-8b", 32, 8, 128),  # 128 KiB/token
        ModelPreset("llama-3.1-70b", 80, 8, 128),  # 320 KiB/token
        ModelPreset("qwen2.5-7b", 28, 4, 128),  # 56 KiB/token
        ModelPreset("tiny", 2, 2, 16),  # for tests: 256 B/token
    )
}


@dataclass(slots=True, frozen=True)
class TransferModel:
    """Time to bring cached KV into device memory, per source tier."""

    bytes_per_token: int  # from a ModelPreset
    host_to_device_gbps: float = 25.0  # GB/s, PCIe 5 x16 pinned copies in practice
    storage_to_host_gbps: float = 5.0  # GB/s, local NVMe
    external_to_host_gbps: float = 10.0  # GB/s, RDMA to a shared pool

    def load_ms(self, tier: StorageTier, tokens: int) -> float:
        """Milliseconds to load ``tokens`` tokens of KV from ``tier`` into device memory."""
        if tier is StorageTier.DEVICE or tokens <= 0:
            return 0.0
        nbytes = tokens * self.bytes_per_token
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
        lo, hi = max(u0, 0.0), max(u0 + du * max(below - 1, 0), 0.0)
        quad = (model.decode_a, model.decode_b, model.decode_c)
        vertex = -quad[1] / (2 * quad[0]) if quad[0] else lo
        lowest = min(_poly(quad, lo), _poly(quad, hi), _poly(quad, vertex) if lo <= vertex <= hi else math.inf)
        if below == 0 or lowest >= model.decode_floor:
            return (_quadratic_sum(*quad, u0, du, below) if below else 0.0) + (steps - below) * model.decode_ms(1.0)
    return math.fsum(model.decode_ms(u0 + k * du) for k in range(steps))


def _poly(q: tuple[float, float, float], u: float) -> float:
    return q[0] * u * u + q[1] * u + q[2]


def decode_steps_done(model: LatencyModel, u0: float, du: float, steps: int, elapsed_ms: float) -> int:
    """How many whole iterations of such a run have completed ``elapsed_ms`` after it began (at most
    ``steps``). O(log steps) evaluations of :func:`decode_run_ms`."""
    lo, hi = 0, steps
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_run_ms(model, u0, du, mid) <= elapsed_ms + 1e-9:
            lo = mid
        else:
            hi = mid - 1
    return lo
