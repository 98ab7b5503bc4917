"""Latency and transfer-time models shared by the router's TTFT estimate and the simulator."""

from __future__ import annotations

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
