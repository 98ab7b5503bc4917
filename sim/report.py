"""Reports of compared runs: terminal table, JSON summary, per-request CSV, PNG plots."""

from __future__ import annotations

import csv
import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.sim.metrics import RequestRecord, RunSummary

_COLUMNS = [
    ("policy", "policy", "{}"),
    ("done", "requests", "{}"),
    ("unfin", "unfinished", "{}"),
    ("rej", "rejected", "{}"),
    ("hit", "hit_rate", "{:.3f}"),
    ("device", "hit_device", "{:.3f}"),
    ("host", "hit_host", "{:.3f}"),
    ("storage", "hit_storage", "{:.3f}"),
    ("recomp", "recomputed", "{:.3f}"),
    ("TTFT p50 s", "ttft_p50", "{:.3f}"),
    ("p90", "ttft_p90", "{:.3f}"),
    ("p99", "ttft_p99", "{:.3f}"),
    ("tok/s", "throughput_tok_s", "{:.0f}"),
    ("imbal", "load_imbalance", "{:.2f}"),
    ("idx MAE", "index_mae_blocks", "{:.2f}"),
]


def table(summaries: Sequence[RunSummary]) -> str:
    """A fixed-width comparison table."""
    rows = [[h for h, _, _ in _COLUMNS]]
    for s in summaries:
        d = s.as_dict()
        rows.append([("-" if isinstance(d[k], float) and math.isnan(d[k]) else f.format(d[k])) for _, k, f in _COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_json(path: Path, summaries: Sequence[RunSummary], meta: dict[str, Any]) -> None:
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else v

    runs = [{k: clean(v) for k, v in s.as_dict().items()} for s in summaries]
    path.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2, default=str))


#: Columns of requests.csv, one row per request and run.
CSV_FIELDS = ["policy", "request_id", "worker", "arrival", "input_tokens", "output_tokens", "ttft", "e2e", "queue",
              "device_tokens", "host_tokens", "storage_tokens", "recomputed_tokens", "predicted_blocks",
              "actual_blocks", "usable_blocks", "rejected"]


def csv_row(policy: str, r: RequestRecord) -> list[object]:
    """One row of :data:`CSV_FIELDS`."""
    return [policy, r.request_id, r.worker, f"{r.arrival:.6f}", r.input_tokens, r.output_tokens,
            f"{r.ttft:.6f}", f"{r.e2e:.6f}", f"{r.queue:.6f}", r.device_tokens, r.host_tokens,
            r.storage_tokens, r.recomputed_tokens, r.predicted_blocks, r.actual_blocks,
            r.usable_blocks, int(r.rejected)]


class CsvRecords:
    """Rows of one run's records written as they come (a ``simulate`` sink), without a header, so the
    parts of several runs concatenate into one requests.csv (:func:`join_csv`)."""

    def __init__(self, path: Path, policy: str) -> None:
        self.policy = policy  # the first column of every row
        self._file = open(path, "w", newline="")  # noqa: SIM115 (closed by __exit__)
        self._writer = csv.writer(self._file)

    def write(self, r: RequestRecord) -> None:
        self._writer.writerow(csv_row(self.policy, r))

    def __enter__(self) -> CsvRecords:
        return self

    def __exit__(self, *_: object) -> None:
        self._file.close()


def join_csv(path: Path, parts: Sequence[Path]) -> None:
    """requests.csv from the header and ``parts`` (written by :class:`CsvRecords`) in order; the parts are
    removed. O(total size), in 1 MiB copies."""
    with open(path, "w", newline="") as out:
        csv.writer(out).writerow(CSV_FIELDS)
        for part in parts:
            with open(part, newline="") as f:
                shutil.copyfileobj(f, out, 1 << 20)
            part.unlink()


def plot(out_dir: Path, summaries: Sequence[RunSummary], ttfts: dict[str, Sequence[float]],
         title: str) -> list[Path]:
    """Stacked hit-rate bars per tier and CDFs of the completed requests' TTFT (``ttfts``: seconds, per run,
    as :attr:`kvtier.sim.run.RunResult.ttft` holds them); returns the PNG paths."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    names = [s.policy for s in summaries]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names)), 4.2))
    bottom = np.zeros(len(names))
    for label, key, color in [("device", "hit_device", "#1b7837"), ("host", "hit_host", "#7fbf7b"),
                              ("storage", "hit_storage", "#d9f0d3"), ("recomputed", "recomputed", "#bbbbbb")]:
        vals = np.array([getattr(s, key) for s in summaries])
        ax.bar(names, vals, bottom=bottom, label=label, color=color, edgecolor="black", linewidth=0.4)
        bottom += vals
    ax.set_ylabel("share of prompt tokens")
    ax.set_ylim(0, 1.0)
    ax.set_title(f"Prompt tokens by source: {title}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    p = out_dir / "hit_rate_by_tier.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, values in ttfts.items():
        ttft = np.sort(np.asarray(values, dtype=float))
        if len(ttft):
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    p = out_dir / "ttft_cdf.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths
