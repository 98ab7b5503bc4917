"""Reports of compared runs: terminal table, JSON summary, per-request CSV, PNG plots."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvtier.sim.metrics import RequestRecord, RunSummary, Slo, goodput_count

#: The comparison table: (heading, RunSummary field, format, scale). Shares are of prompt tokens; times in seconds
#: unless the heading says ms; "-" where a figure does not apply (no SLO given, no prediction made).
_COLUMNS = [
    ("policy", "policy", "{}", 1.0),
    ("done", "requests", "{}", 1.0),
    ("unfin", "unfinished", "{}", 1.0),
    ("rej", "rejected", "{}", 1.0),
    ("hit", "hit_rate", "{:.3f}", 1.0),
    ("device", "hit_device", "{:.3f}", 1.0),
    ("host", "hit_host", "{:.3f}", 1.0),
    ("storage", "hit_storage", "{:.3f}", 1.0),
    ("TTFT p50 s", "ttft_p50", "{:.3f}", 1.0),
    ("p90", "ttft_p90", "{:.3f}", 1.0),
    ("p99", "ttft_p99", "{:.3f}", 1.0),
    ("TPOT p90 ms", "tpot_p90", "{:.1f}", 1e3),
    ("e2e p99 s", "e2e_p99", "{:.2f}", 1.0),
    ("goodput", "goodput", "{:.3f}", 1.0),
    ("tok/s", "throughput_tok_s", "{:.0f}", 1.0),
    ("imbal", "load_imbalance", "{:.2f}", 1.0),
    ("idx MAE", "index_mae_blocks", "{:.2f}", 1.0),
]


#: The event path's counters (RunSummary.extra), shown when any run lost batches: (heading, key).
_WIRE_COLUMNS = [("lost", "events_lost"), ("replays", "replay_requests"), ("dumps", "dumps"),
                 ("partial", "partial_marks")]


def table(summaries: Sequence[RunSummary], first: str = "policy") -> str:
    """A fixed-width comparison table; ``first``: the heading of the first column (a sweep's is its grid point).
    When any run lost event batches, its loss and recovery counters follow."""
    wire = [c for c in _WIRE_COLUMNS if any(s.extra.get("events_lost") for s in summaries)]
    rows = [[first] + [h for h, _, _, _ in _COLUMNS[1:]] + [h for h, _ in wire]]
    for s in summaries:
        d = s.as_dict()
        rows.append([("-" if isinstance(d[k], float) and math.isnan(d[k]) else f.format(d[k] * x if x != 1.0 else d[k]))
                     for _, k, f, x in _COLUMNS] + [str(s.extra.get(k, 0)) for _, k in wire])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def overloaded(s: RunSummary) -> str | None:
    """Why a run's cluster could not keep up, or None: most of the median request's TTFT was spent queued before
    its prefill (arrivals outpaced the workers), or, disaggregated, the median request handed off waited over a
    second for room on its decode worker once its prompt was computed (the decode pool is short, whatever else
    makes up the TTFT: its share of it is not asked), which no routing policy fixes."""
    if not s.requests:
        return None
    if s.queue_p50 > 1.0 and s.queue_p50 > 0.5 * s.ttft_p50:
        return (f"{s.policy}: overloaded: the median request waited {s.queue_p50:.1f} s in queue of a "
                f"{s.ttft_p50:.1f} s TTFT; arrivals outpace the cluster (more workers, a larger --time-scale or "
                f"fewer requests)")
    if s.decode_queue_p50 > 1.0:  # (False where nan: aggregated)
        return (f"{s.policy}: overloaded: the median request handed to a decode worker waited "
                f"{s.decode_queue_p50:.1f} s there for room (the median TTFT: {s.ttft_p50:.1f} s); the decode pool "
                f"cannot keep up (more decode workers, a larger --time-scale or fewer requests)")
    return None


def rejections(s: RunSummary) -> str | None:
    """What a run's rejected requests mean, or None if it rejected none: each needs room for its prompt and output
    on a worker's device (disaggregated: on a prefill worker's and on a decode worker's; ``extra["rejected_decode"]``
    counts those that fit the first alone), which no routing policy makes."""
    if not s.rejected:
        return None
    decode = int(s.extra.get("rejected_decode", 0))
    head = f"{s.policy}: {s.rejected} of {s.total} requests rejected: their prompt and output do not fit"
    dec = "--decode-device-tokens, which defaults to --device-tokens"
    if not decode:
        return f"{head} a worker's device (--device-tokens)"
    if decode == s.rejected:
        return f"{head} a decode worker's device ({dec})"
    return (f"{head} a worker's device: {s.rejected - decode} a prefill worker's (--device-tokens), {decode} a decode "
            f"worker's ({dec})")


def run_warnings(summaries: Sequence[RunSummary]) -> list[str]:
    """What the runs' tables show only as numbers and no routing policy fixes (:func:`overloaded`,
    :func:`rejections`), one line each, in run order: what the CLI prints as warnings, and notebooks print too."""
    return [why for s in summaries for why in (overloaded(s), rejections(s)) if why]


#: What a sweep plots, one PNG each: (RunSummary field, axis label).
SWEEP_MEASURES = [("hit_rate", "hit rate"), ("ttft_p90", "TTFT p90 (s)"), ("tpot_p90", "TPOT p90 (s)"),
                  ("e2e_p99", "e2e p99 (s)"), ("goodput", "goodput")]


def write_sweep(out_dir: Path, rows: Sequence[dict[str, Any]], axes: Sequence[str], plots: bool) -> list[Path]:
    """``sweep.csv`` (one row per grid point: its settings, then every scalar summary field) and, with ``plots``,
    one line plot per measure of :data:`SWEEP_MEASURES`: the first grid axis along x, a line per combination of
    the others. A point whose first axis does not apply (None: an aggregated point of a link axis) is drawn across
    the plot as a dashed level. Returns the paths written."""
    keys = list(rows[0]) if rows else []
    path = out_dir / "sweep.csv"
    with whole(path) as part, open(part, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for r in rows:
            w.writerow(["" if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in
                        (r[k] for k in keys)])
    written = [path]
    if not plots or not rows or not axes:
        return written
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, rest = axes[0], list(axes[1:])
    for field, label in SWEEP_MEASURES:
        if all(r.get(field) is None for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        lines: dict[tuple[Any, ...], list[tuple[Any, float]]] = {}
        for r in rows:
            lines.setdefault(tuple(r[a] for a in rest), []).append((r[x], math.nan if r[field] is None else r[field]))
        categorical = any(isinstance(v, str) for pts in lines.values() for v, _ in pts)
        legend = bool(rest) or any(r[x] is None for r in rows)
        for key, pts in lines.items():
            name = ", ".join(f"{a}={v}" if v is not None else f"{a} n/a" for a, v in zip(rest, key, strict=True))
            level = [y for v, y in pts if v is None]
            pts = [(v, y) for v, y in pts if v is not None]
            if pts:
                xs = [str(v) for v, _ in pts] if categorical else [v for v, _ in pts]
                ax.plot(xs, [y for _, y in pts], marker="o", label=name)
            for y in level:  # (the same at every x)
                ax.axhline(y, linestyle="--", color="0.4", label=f"{name} ({x} n/a)" if name else f"{x} n/a")
        ax.set_xlabel(x)
        ax.set_ylabel(label)
        ax.set_title(f"{label} across {x}", fontsize=10)
        ax.grid(alpha=0.3)
        if legend:
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"sweep_{field}.png"
        with whole(p) as part:
            fig.savefig(part, dpi=110, format="png")
        plt.close(fig)
        written.append(p)
    return written


def write_json(path: Path, summaries: Sequence[RunSummary], meta: dict[str, Any]) -> None:
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else v

    runs = [{k: clean(v) for k, v in s.as_dict().items()} for s in summaries]
    path.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2, default=str))


#: The plots :func:`write_sweep` may write in its directory.
SWEEP_PLOTS = tuple(f"sweep_{field}.png" for field, _ in SWEEP_MEASURES)


def remove_stale(out_dir: Path, names: Sequence[str], written: Sequence[Path]) -> list[Path]:
    """Removes the files of ``names`` in ``out_dir`` that this run did not write (``written``): an earlier run's
    plots (of another trace, other policies or an SLO this one lacks) would sit beside this run's results as if
    they were its own. Returns the paths removed. O(names)."""
    mine = {p.resolve() for p in written}
    gone = []
    for name in names:
        p = out_dir / name
        if p.resolve() not in mine and p.is_file():
            p.unlink()
            gone.append(p)
    return gone


#: The plots :func:`plot` writes in its directory.
PLOTS = ("hit_rate_by_tier.png", "ttft_cdf.png", "ttft_tpot_pareto.png", "goodput_vs_slo.png")

#: Columns of requests.csv, one row per request and run.
CSV_FIELDS = ["policy", "request_id", "worker", "arrival", "input_tokens", "output_tokens", "ttft", "e2e", "queue",
              "device_tokens", "host_tokens", "storage_tokens", "recomputed_tokens", "predicted_blocks",
              "actual_blocks", "usable_blocks", "rejected", "ttst", "tpot", "max_itl", "decode_worker",
              "decode_cached_tokens", "transferred_tokens", "prefill_end", "decode_queue"]


def _s(x: float) -> str:
    return "" if math.isnan(x) else f"{x:.6f}"


def _since(t: float, arrival: float) -> str:
    """Seconds from ``arrival`` to ``t``, empty where ``t`` never came (-1: rejected, or unfinished at the end)."""
    return f"{t - arrival:.6f}" if t >= 0 else ""


def csv_row(policy: str, r: RequestRecord) -> list[object]:
    """One row of :data:`CSV_FIELDS` (a latency that does not apply, such as a one-token answer's TPOT, or the TTFT
    of a request that got no token, is empty)."""
    return [policy, r.request_id, r.worker, f"{r.arrival:.6f}", r.input_tokens, r.output_tokens,
            _since(r.first_token, r.arrival), _since(r.finish, r.arrival), _since(r.prefill_start, r.arrival),
            r.device_tokens, r.host_tokens,
            r.storage_tokens, r.recomputed_tokens, r.predicted_blocks, r.actual_blocks,
            r.usable_blocks, int(r.rejected), _s(r.ttst), _s(r.tpot), _s(r.max_itl if r.max_itl >= 0 else math.nan),
            r.decode_worker, r.decode_cached_tokens, r.transferred_tokens, _since(r.prefill_end, r.arrival),
            _s(r.decode_queue)]


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


class ItlSeries:
    """Each completed request's inter-token gaps as one JSONL line (a ``simulate`` ``itl_sink``):
    ``{"policy", "request_id", "itl_s": [seconds, ...]}``."""

    def __init__(self, path: Path, policy: str) -> None:
        self.policy = policy
        self._file = open(path, "w")  # noqa: SIM115 (closed by __exit__)

    def write(self, request_id: str, gaps: list[float]) -> None:
        self._file.write(json.dumps({"policy": self.policy, "request_id": request_id,
                                     "itl_s": [round(g, 9) for g in gaps]}) + "\n")

    def __enter__(self) -> ItlSeries:
        return self

    def __exit__(self, *_: object) -> None:
        self._file.close()


@contextlib.contextmanager
def whole(path: Path) -> Iterator[Path]:
    """A hidden part file beside ``path`` to write, renamed to ``path`` once what it wraps is done, removed if it
    fails or is interrupted: ``path`` is written whole or not at all (a run stopped mid-write leaves no truncated
    plot or table). O(1)."""
    with wholes([path]) as (part,):
        yield part


@contextlib.contextmanager
def wholes(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """:func:`whole` of several files at once: their parts are renamed into place together, once what it wraps is
    done (a stopped run leaves none of them beside the others half-written), or all removed. A symbolic link is
    kept: the file it names is the one replaced. A device or a FIFO (``/dev/stdout`` on a terminal, a pipe) is
    written through, not staged: a rename would replace it with a regular file. O(files)."""
    targets = [_staged_at(p) for p in paths]
    parts = [t.with_name(f".{t.name}.part") if t is not None else p for p, t in zip(paths, targets, strict=True)]
    try:
        yield parts
        for part, target in zip(parts, targets, strict=True):
            if target is not None:
                os.replace(part, target)
    except BaseException:
        for part, target in zip(parts, targets, strict=True):
            if target is not None:
                part.unlink(missing_ok=True)
        raise


def _staged_at(path: Path) -> Path | None:
    """The regular file ``path`` names, links followed (a new one where none is yet), which :func:`wholes` replaces;
    None where it is written through: a device, a FIFO or a socket, or a file reached through a process's open
    descriptor (``/dev/stdout``, ``/proc/self/fd/2``: another holder of that file would go on writing to the one a
    rename replaced, or to none where it was deleted). O(links followed)."""
    if _through_descriptor(path):
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there yet: made where the path (or the link in it) leads
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path)) if stat.S_ISREG(mode) else None


def _through_descriptor(path: Path) -> bool:
    """Whether ``path``, or a symbolic link it leads through, is under ``/proc`` or ``/dev/fd``. O(links)."""
    p = os.path.abspath(path)
    for _ in range(40):  # (the kernel's own limit on links followed)
        if p.startswith(("/proc/", "/dev/fd/")):
            return True
        if not os.path.islink(p):
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return False


def join_files(path: Path, parts: Sequence[Path], header: bytes = b"") -> None:
    """``path`` made of ``header`` then ``parts`` in order; the parts are removed. O(total size), in 1 MiB
    copies."""
    with open(path, "wb") as out:
        out.write(header)
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
            part.unlink()


def join_csv(path: Path, parts: Sequence[Path]) -> None:
    """requests.csv from the header and ``parts`` (written by :class:`CsvRecords`) in order; the parts are
    removed. O(total size), in 1 MiB copies."""
    head = io.StringIO(newline="")
    csv.writer(head).writerow(CSV_FIELDS)
    join_files(path, parts, head.getvalue().encode())


def _save(fig: Any, path: Path) -> Path:
    """Lays ``fig`` out, writes it to ``path`` and frees it. Titles and x labels name the trace and cluster, which
    may be longer than the plot is wide: they are wrapped to the width of their axes, never cut."""
    import textwrap

    import matplotlib.pyplot as plt

    for ax in fig.axes:
        width_pt = ax.get_position().width * fig.get_figwidth() * 72
        for text in (ax.title, ax.xaxis.label):
            # (a character of these fonts averages about 0.6 of the font size)
            text.set_text(textwrap.fill(text.get_text(), max(20, int(width_pt / (0.6 * text.get_fontsize())))))
    fig.tight_layout()
    with whole(path) as part:
        fig.savefig(part, dpi=120, format="png")
    plt.close(fig)
    return path


class Latencies(Protocol):
    """Per completed request, in seconds, as :class:`kvtier.sim.run.RunResult` holds them."""

    ttft: Sequence[float]
    tpot: Sequence[float]  # nan for a one-token answer
    e2e: Sequence[float]


#: How far the goodput plot moves the SLO: from 4x tighter to 4x looser than its base.
SLO_FACTORS = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)


def base_slo(slo: Slo, runs: Sequence[Latencies]) -> Slo:
    """The SLO the goodput plot tightens and loosens: the one given, or else the p90 of TTFT, TPOT and e2e of the
    first run (a comparison's first policy, round robin by default) that completed a request, so that it passes 90%
    on each alone there (no bound where none did: every completed request meets it)."""
    done = [r for r in runs if len(r.ttft)]
    if slo or not done:
        return slo
    import numpy as np

    r = done[0]

    def p90(xs: Sequence[float]) -> float | None:
        a = np.asarray(xs, dtype=float)
        a = a[~np.isnan(a)]
        return float(np.quantile(a, 0.9)) if len(a) else None
    return Slo(p90(r.ttft), p90(r.tpot), p90(r.e2e))


def goodput_curve(slo: Slo, run: Latencies, total: int) -> list[float]:
    """The share of ``total`` requests meeting ``slo`` scaled by each of :data:`SLO_FACTORS`. O(factors * n)."""
    return [goodput_count(slo.scaled(f), run.ttft, run.tpot, run.e2e) / max(total, 1) for f in SLO_FACTORS]


def _line(i: int) -> dict[str, Any]:
    """The ``i``-th policy's colour, line style and marker, the same in every plot: no two of 20 policies look alike,
    so curves that nearly coincide stay told apart."""
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i % 4], "marker": "osD^v<>"[(i // 4) % 7]}


def _roomy(labels: Sequence[tuple[str, float, float]], ax: Any,
           height_pt: float = 9.0) -> list[tuple[str, float, float, int]]:
    """Of ``labels`` (text, x, y), to be written to the right of their points, those that overlap no other label,
    with their index (text widths estimated at 4.5 points a character, the labels' size). O(labels^2)."""
    ax.autoscale_view()
    to_pt = 72.0 / ax.figure.dpi
    boxes = []
    for text, *point in labels:
        x, y = (v * to_pt for v in ax.transData.transform(point))
        boxes.append((x, x + 5 + 4.5 * len(text), y))
    return [(text, x, y, i) for i, (text, x, y) in enumerate(labels)
            if not any(j != i and boxes[i][0] < b[1] and b[0] < boxes[i][1] and abs(boxes[i][2] - b[2]) < height_pt
                       for j, b in enumerate(boxes))]


def plot(out_dir: Path, summaries: Sequence[RunSummary], runs: Sequence[Latencies], title: str,
         slo: Slo | None = None) -> list[Path]:
    """Stacked hit-rate bars per tier, CDFs of the completed requests' TTFT, the Pareto view (TTFT p90 against
    TPOT p90, one point per policy) and goodput as the SLO tightens (:func:`base_slo`); returns the PNG paths."""
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
        if key in ("hit_host", "hit_storage"):  # thin slices get their share written beside them
            for i, (v, b) in enumerate(zip(vals, bottom, strict=True)):
                if 0 < v < 0.03:
                    ax.annotate(f"{label} {v:.1%}", (i, b + v), xytext=(12, 0), textcoords="offset points",
                                fontsize=6, va="center", arrowprops={"arrowstyle": "-", "lw": 0.4})
        bottom += vals
    ax.set_ylabel("share of prompt tokens")
    ax.set_ylim(0, 1.0)
    ax.set_title(f"Prompt tokens by source: {title}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", rotation=30)
    paths.append(_save(fig, out_dir / PLOTS[0]))

    fig, ax = plt.subplots(figsize=(8.2, 4.2))
    for i, (name, values) in enumerate((s.policy, r.ttft) for s, r in zip(summaries, runs, strict=True)):
        ttft = np.sort(np.asarray(values, dtype=float))
        if len(ttft):
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name, linewidth=1.2, ms=3,
                    markevery=max(1, len(ttft) // 8), **_line(i))
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {title}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    else:  # (a legend of nothing is a matplotlib warning on stderr)
        ax.text(0.5, 0.5, "no request completed", transform=ax.transAxes, ha="center", va="center")
    paths.append(_save(fig, out_dir / PLOTS[1]))

    fig, ax = plt.subplots(figsize=(8.2, 4.6))
    points = [(s.policy, s.ttft_p90 * 1e3, s.tpot_p90 * 1e3, i) for i, s in enumerate(summaries)
              if math.isfinite(s.ttft_p90) and math.isfinite(s.tpot_p90)]
    for name, x, y, i in points:  # (each policy its colour and marker, as its line in the other plots)
        ax.scatter(x, y, s=40, zorder=3, color=_line(i)["color"], marker=_line(i)["marker"], label=name)
    xs = [x for _, x, _, _ in points]
    wide = bool(xs) and min(xs) > 0 and max(xs) > 20 * min(xs)  # one policy far out squeezes the rest together
    if wide:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    # Points named beside them where the name has room; the legend names every one.
    for name, x, y, _ in _roomy([(name, x, y) for name, x, y, _ in points], ax):
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    if points:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_xlabel("TTFT p90 (ms, log scale)" if wide else "TTFT p90 (ms)")
    ax.set_ylabel("TPOT p90 (ms)")
    ax.set_title(f"Pareto view, lower left is better: {title}", fontsize=10)
    ax.grid(True, alpha=0.3)
    paths.append(_save(fig, out_dir / PLOTS[2]))

    slo = slo or Slo()
    base = base_slo(slo, runs)
    fig, ax = plt.subplots(figsize=(8.2, 4.6))
    for i, (s, r) in enumerate(zip(summaries, runs, strict=True)):
        ax.plot(SLO_FACTORS, goodput_curve(base, r, s.total), ms=3, label=s.policy, **_line(i))
    ax.set_xscale("log")
    ax.set_xticks(SLO_FACTORS)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(f"SLO scale (1x: {base.describe()}{'' if slo else ', p90 of ' + summaries[0].policy})")
    ax.set_ylabel("goodput (share of requests meeting every bound)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Goodput as the SLO tightens: {title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)  # (beside the curves, not over them)
    paths.append(_save(fig, out_dir / PLOTS[3]))
    return paths
