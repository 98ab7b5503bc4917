"""Measures a Llama-3.1-8B-shaped model's iteration times on this machine's GPU, for `kvtier fit-latency`.

The model is built from its shape with random bf16 weights (nothing is downloaded): 32 layers, hidden
4,096, 32 query heads and 8 KV heads of 128, SwiGLU MLP of 14,336, vocabulary 128,256, RMSNorm and
rotary embeddings; fused QKV and gate/up projections, as vLLM and SGLang load them.

* prefill: one prompt of T tokens, 512 to 32k, in eager PyTorch (flash attention through SDPA, KV written
  to the layer's cache, logits for the last token only), as an engine runs a prefill chunk;
* decode: one step of a batch of B = 1 to 256 sequences of C tokens of context each (q, k, v for the new
  token, KV appended, attention over the whole context, logits for every sequence), captured once in a
  CUDA graph and replayed, as engines run decode; with two attentions (Model.attend), keeping the faster.

Each point is the median of its timed runs (CUDA events) after a warm-up. Rows go to a CSV with the
columns ``kind,x,ms`` that `kvtier fit-latency` reads (prefill: x = tokens; decode: x = KV utilisation, the
batch's KV tokens over the KV capacity of the GPU) and, for the reader, ``batch,context,tokens``. The KV
capacity is what an engine would give its KV pool: ``--memory-fraction`` of the GPU's memory less the
weights and an activation reserve, divided by the model's KV bytes per token.

    python bench/gpu_latency.py -o gpu_latency.csv
    kvtier fit-latency gpu_latency.csv --kv-pool-tokens N -o fit.json   # N: the capacity it printed

``--tiny`` runs a two-layer toy of the same code on the CPU (how the tests check it).
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from benchargs import at_least, count, counts, fraction

from kvtier.hardware.latency import ModelPreset


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0

    @property
    def kv_bytes_per_token(self) -> int:
        return ModelPreset("", self.layers, self.kv_heads, self.head_dim).bytes_per_token  # K and V, bf16


LLAMA_3_1_8B = Shape()
TINY = Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=256)


class Model:
    """Weights of every layer, and the forward passes an engine runs."""

    def __init__(self, shape: Shape, device: torch.device, seed: int = 0) -> None:
        self.s = shape
        self.device = device
        g = torch.Generator(device=device).manual_seed(seed)
        dt = torch.bfloat16

        def w(*size: int) -> torch.Tensor:
            return (torch.randn(size, generator=g, device=device, dtype=dt) / math.sqrt(size[-1]))

        s = shape
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.embed = w(s.vocab, s.hidden)
        self.layers = [{"qkv": w(qkv, s.hidden), "o": w(s.hidden, s.heads * s.head_dim),
                        "gate_up": w(2 * s.mlp, s.hidden), "down": w(s.hidden, s.mlp),
                        "n1": torch.ones(s.hidden, device=device, dtype=dt),
                        "n2": torch.ones(s.hidden, device=device, dtype=dt)} for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=device, dtype=dt)
        self.lm_head = w(s.vocab, s.hidden)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim))
        self._inv_freq = inv

    def weight_bytes(self) -> int:
        ts = [self.embed, self.lm_head, self.norm] + [t for layer in self.layers for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; pos: [tokens]."""
        f = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = f.cos()[:, None, :].to(x.dtype), f.sin()[:, None, :].to(x.dtype)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    def _mlp(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        h = F.rms_norm(x, (self.s.hidden,), layer["n2"])
        gate, up = (h @ layer["gate_up"].T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ layer["down"].T

    def _qkv(self, x: torch.Tensor, layer: dict[str, torch.Tensor],
             pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.s
        h = F.rms_norm(x, (s.hidden,), layer["n1"])
        q, k, v = (h @ layer["qkv"].T).split([s.heads * s.head_dim, s.kv_heads * s.head_dim,
                                              s.kv_heads * s.head_dim], dim=-1)  # type: ignore[no-untyped-call]
        n = x.shape[0]
        q = self._rope(q.view(n, s.heads, s.head_dim), pos)
        k = self._rope(k.view(n, s.kv_heads, s.head_dim), pos)
        return q, k, v.view(n, s.kv_heads, s.head_dim)

    def prefill(self, ids: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        """One prompt; ``cache[layer]``: [2, kv_heads, >= T, head_dim]. Returns the last token's logits."""
        s = self.s
        t = ids.shape[0]
        pos = torch.arange(t, device=self.device)
        x = self.embed[ids]
        group = s.heads // s.kv_heads
        for layer, kv in zip(self.layers, cache, strict=True):
            q, k, v = self._qkv(x, layer, pos)
            kv[0, :, :t] = k.transpose(0, 1)
            kv[1, :, :t] = v.transpose(0, 1)
            # K/V repeated per query head, so every fused SDPA kernel takes it (as eager Llama code does)
            kk = kv[0, :, :t].repeat_interleave(group, dim=0)[None]
            vv = kv[1, :, :t].repeat_interleave(group, dim=0)[None]
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, is_causal=True)
            x = x + o[0].transpose(0, 1).reshape(t, -1) @ layer["o"].T
            x = self._mlp(x, layer)
        return F.rms_norm(x[-1:], (s.hidden,), self.norm) @ self.lm_head.T

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: str) -> torch.Tensor:
        """Decode attention of ``q`` [B, kv_heads, group, head_dim] over ``k``, ``v`` [B, kv_heads, context,
        head_dim]: the query heads sharing a KV head attend as a group of rows, so no KV is repeated and each cached
        K and V is read once, as a decode kernel does. ``sdpa``: PyTorch's fused kernel (one block per sequence and
        head: few blocks for small batches of long contexts); ``matmul``: scores, softmax, weighted sum through
        cuBLAS, which also splits the context across blocks."""
        if how == "sdpa":
            return F.scaled_dot_product_attention(q, k, v)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.s.head_dim ** -0.5
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)

    def decode(self, ids: torch.Tensor, context: int, cache: list[torch.Tensor], how: str = "sdpa") -> torch.Tensor:
        """One step for ``B`` sequences of ``context`` cached tokens; ``cache[layer]``: [2, B, kv_heads,
        context + 1, head_dim]. The new token's KV goes to position ``context``; ``how``: :meth:`attend`'s.
        Returns [B, vocab] logits."""
        s = self.s
        b = ids.shape[0]
        pos = torch.full((b,), context, device=self.device)
        x = self.embed[ids]
        group = s.heads // s.kv_heads
        for layer, kv in zip(self.layers, cache, strict=True):
            q, k, v = self._qkv(x, layer, pos)
            kv[0, :, :, context] = k
            kv[1, :, :, context] = v
            o = self.attend(q.view(b, s.kv_heads, group, s.head_dim), kv[0], kv[1], how)
            x = x + o.reshape(b, -1) @ layer["o"].T
            x = self._mlp(x, layer)
        return F.rms_norm(x, (s.hidden,), self.norm) @ self.lm_head.T


def _time(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    """Median ms of ``reps`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kv_capacity_tokens(model: Model, fraction: float, reserve_gib: float) -> int:
    """KV tokens an engine would pool on this GPU: ``fraction`` of its memory, less weights and a reserve."""
    total = torch.cuda.get_device_properties(model.device).total_memory
    free = fraction * total - model.weight_bytes() - reserve_gib * 2**30
    return max(0, int(free // model.s.kv_bytes_per_token))


def measure(model: Model, prefill_tokens: list[int], batches: list[int], contexts: list[int], capacity: int,
            reps: int, graphs: bool, out: Callable[[dict[str, Any]], None], attentions: list[str]) -> None:
    s = model.s
    cuda = model.device.type == "cuda"
    g = torch.Generator(device=model.device).manual_seed(1)
    for t in prefill_tokens:
        cache = [torch.empty((2, s.kv_heads, t, s.head_dim), device=model.device, dtype=torch.bfloat16)
                 for _ in range(s.layers)]
        ids = torch.randint(0, s.vocab, (t,), generator=g, device=model.device)
        with torch.inference_mode():
            ms = _time(functools.partial(model.prefill, ids, cache), reps, cuda)
        out({"kind": "prefill", "x": t, "ms": round(ms, 4), "batch": 1, "context": 0, "tokens": t,
             "attention": "sdpa"})
        cache.clear()
    for c in contexts:
        for b in batches:
            if b * (c + 1) > capacity:
                continue
            cache = [torch.zeros((2, b, s.kv_heads, c + 1, s.head_dim), device=model.device, dtype=torch.bfloat16)
                     for _ in range(s.layers)]
            ids = torch.randint(0, s.vocab, (b,), generator=g, device=model.device)
            best: tuple[float, str] | None = None
            for how in attentions:  # the faster attention is what an engine's kernel would at least match
                with torch.inference_mode():
                    step: Callable[[], object] = functools.partial(model.decode, ids, c, cache, how)
                    if graphs and cuda:
                        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            step()  # warm-up outside the capture (workspaces, autotuning)
                        torch.cuda.current_stream().wait_stream(side)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            step()
                        step = graph.replay
                    ms = _time(step, reps, cuda)
                    del step
                if best is None or ms < best[0]:
                    best = (ms, how)
            assert best is not None
            out({"kind": "decode", "x": round(b * (c + 1) / capacity, 6), "ms": round(best[0], 4), "batch": b,
                 "context": c, "tokens": b * (c + 1), "attention": best[1]})
            cache.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", default="gpu_latency.csv", help="CSV to write (kind,x,ms,...)")
    ap.add_argument("--prefill", type=counts(), default="512,1024,2048,3072,4096,6144,8192,12288,16384,24576,32768",
                    help="prompt lengths, tokens")
    ap.add_argument("--batches", type=counts(), default="1,2,4,8,16,32,64,128,256", help="decode batch sizes")
    ap.add_argument("--contexts", type=counts(), default="512,2048,3072,8192,13312,32768",
                    help="decode context lengths, tokens")
    ap.add_argument("--reps", type=count(), default=5, help="timed runs per point (the median is kept)")
    ap.add_argument("--memory-fraction", type=fraction, default=0.9, help="GPU memory an engine gives itself")
    ap.add_argument("--reserve-gib", type=at_least(0), default=4.0, help="kept out of the KV pool for activations")
    ap.add_argument("--eager-decode", action="store_true", help="decode without CUDA graphs")
    ap.add_argument("--decode-attention", default="sdpa,matmul",
                    help="decode attentions to time; each point keeps the fastest (Model.attend)")
    ap.add_argument("--tiny", action="store_true", help="a two-layer toy on the CPU (tests)")
    a = ap.parse_args(argv)
    if a.tiny:
        model, capacity = Model(TINY, torch.device("cpu")), 4096
    elif not torch.cuda.is_available():
        print("gpu_latency: needs a CUDA GPU (or --tiny for the CPU toy)", file=sys.stderr)
        return 2
    else:
        model = Model(LLAMA_3_1_8B, torch.device("cuda"))
        capacity = kv_capacity_tokens(model, a.memory_fraction, a.reserve_gib)
    name = torch.cuda.get_device_name() if model.device.type == "cuda" else "CPU"
    print(f"gpu_latency: {name}; model {model.s} ({model.weight_bytes() / 1e9:.1f} GB of weights); "
          f"KV capacity {capacity:,} tokens ({model.s.kv_bytes_per_token} bytes each); "
          f"decode {'eager' if a.eager_decode or a.tiny else 'in CUDA graphs'}", flush=True)
    rows: list[dict[str, Any]] = []

    def out(row: dict[str, Any]) -> None:
        rows.append(row)
        rate = f"{row['tokens'] / row['ms'] * 1e3:>10,.0f} tok/s"
        print(f"  {row['kind']:7} batch {row['batch']:>3} context {row['context']:>6} tokens {row['tokens']:>7} "
              f"x {row['x']:<9} {row['ms']:9.3f} ms {rate if row['kind'] == 'prefill' else row['attention']}",
              flush=True)

    attentions = a.decode_attention.split(",")
    if not attentions or not set(attentions) <= {"sdpa", "matmul"}:
        print(f"gpu_latency: --decode-attention takes sdpa and/or matmul, got {a.decode_attention!r}", file=sys.stderr)
        return 2
    measure(model, a.prefill, a.batches, a.contexts, capacity, a.reps,
            not (a.eager_decode or a.tiny), out, attentions)
    with open(a.output, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["kind", "x", "ms", "batch", "context", "tokens", "attention"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {a.output} ({len(rows)} points); fit it with: kvtier fit-latency {a.output} "
          f"--kv-pool-tokens {capacity}", file=sys.stderr)
    print("target: none set; the points are the measured latency model (kvtier fit-latency), no peer's to compare",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
