"""Request traces: Mooncake JSONL, Azure CSV, and seeded synthetic generators.

Mooncake records carry ``hash_ids`` of 512-token blocks and no tokens (kvtier's own traces may add
``session_id`` and ``think_s``, which the simulator uses to release a session's turns closed loop); the tokens of a
hash id are derived deterministically from it (:class:`TokenBank`), so equal ids give
equal tokens and distinct ids distinct ones. The last block of a request is partial:
``input_length - 512 * (len(hash_ids) - 1)`` tokens.

Every reader here takes files from anyone, so what one record may cost is capped before it is paid for
(:data:`MAX_LINE_BYTES`, :data:`MAX_DEPTH`, :data:`MAX_TOKENS`, :data:`MAX_HASH_IDS`): a line is read at most
the cap and one byte, its nesting measured before it is decoded, and a length checked before anything is
allocated per token or per block. Past a cap, the record is a :class:`TraceError` naming the file and line.
"""

from __future__ import annotations

import csv
import json
import math
import re
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

import numpy as np

from kvtier.kernels import jit
from kvtier.util.fields import Domain
from kvtier.wire.protocol import PackedTokens

HASH_BLOCK = 512  # tokens per Mooncake hash id
VOCAB = 128_000

#: Longest line of a JSONL or CSV trace, newline included: 4 MiB holds a record at :data:`MAX_HASH_IDS` hash ids
#: of 20 digits five times over, and a line read whole costs no more than this.
MAX_LINE_BYTES = 4 << 20
#: Most prompt tokens (``input_length``, ``ContextTokens``) and most tokens to generate (``output_length``,
#: ``GeneratedTokens``) of one request: 16,777,216, sixteen times a context window of a million tokens. A request
#: is simulated token by token, so a length is what it costs.
MAX_TOKENS = 1 << 24
#: Most hash ids of one record (the blocks of a :data:`MAX_TOKENS` prompt): 32,768.
MAX_HASH_IDS = MAX_TOKENS // HASH_BLOCK
#: Deepest nesting of arrays and objects in a JSONL line, the record itself counted: a record is 2 deep
#: (its ``hash_ids``); room is left for extra fields, which are ignored.
MAX_DEPTH = 32
#: The latest arrival a run takes, seconds (about 3.2 years), after ``--time-scale``, a trace's span (an Azure CSV's
#: too) and a closed-loop session's think times summed turn by turn (checked as each turn is released): the
#: simulator's clock is seconds in a float, whose step there is 15 ns; far past it a request's latencies would lose
#: their microseconds (at 1e15 s they came out 0).
MAX_ARRIVAL_S = 1e8
#: Largest ``timestamp`` (ms) and ``think_s`` (s) taken: a run's latest arrival.
MAX_TIMESTAMP_MS = MAX_ARRIVAL_S * 1000
MAX_THINK_S = MAX_ARRIVAL_S
#: A factor on a trace's arrival times (``--time-scale``, an engine's ``1 / --speed``) or a rate of arrivals
#: (``--rate``) as a setting takes: past these, arrivals leave what a run reaches or a float holds.
TIME_SCALE = Domain(float, lo=1e-6, hi=1e6)


class TraceError(ValueError):
    """A malformed trace; the message names the file and line."""


def check_scaled(arrival: float, time_scale: float, what: str) -> None:
    """:class:`TraceError` where the latest arrival, ``arrival`` seconds (of ``what``: a request or trace named), is
    past :data:`MAX_ARRIVAL_S` once ``time_scale`` multiplies it. O(1)."""
    if arrival * time_scale > MAX_ARRIVAL_S:
        how = f"--time-scale {time_scale:g} takes {what}, arriving at {arrival:g} s, to" if time_scale != 1.0 \
            else f"{what} arrives at"
        raise TraceError(f"{how} {arrival * time_scale:.3g} s: past {MAX_ARRIVAL_S:g} s, where the simulator's "
                         "clock (seconds in a float) no longer keeps a latency's microseconds")


@dataclass(slots=True)
class Request:
    """One request of a trace."""

    request_id: str  # unique in the trace
    arrival: float  # seconds since the trace start
    input_length: int  # prompt tokens
    output_length: int  # tokens to generate
    hash_ids: list[int]  # one per 512-token block of the prompt, the last one partial
    session: str | None = None  # conversation or agent loop it belongs to (turns in trace order)
    think_s: float | None = None  # seconds between the previous turn's last token and this turn

    def to_json(self) -> str:
        obj: dict[str, object] = {"timestamp": round(self.arrival * 1000), "input_length": self.input_length,
                                  "output_length": self.output_length, "hash_ids": self.hash_ids}
        if self.session is not None:
            obj["session_id"] = self.session
        if self.think_s is not None:
            obj["think_s"] = self.think_s
        return json.dumps(obj)


class TokenBank:
    """Deterministic token ids per hash id: token ``j`` of hash id ``h`` is a 64-bit mix of
    ``(seed, h, j)`` reduced to the vocabulary, computed for a whole request at once.

    A pure function of (seed, hash id): what it keeps (a bounded cache, on the numpy path only) never grows
    with the trace, so memory stays flat on million-request traces. Distinct hash ids get distinct 64-bit
    block keys (the mix is a bijection of uint64), and two blocks' tokens then agree only by chance, about
    one in 128,000 per position.
    """

    #: Packed blocks kept for reuse on the numpy path (2 KiB each): a session's turns repeat their predecessors'
    #: hash ids and system prompts repeat everywhere, so most of a request's blocks were made recently.
    CACHE_BLOCKS = 8192

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._seed_key = _mix(np.array([seed & _U64], dtype=np.uint64) + _GOLDEN)
        # hash id -> its 512 tokens packed; first in, first out, at most CACHE_BLOCKS (a pure function's
        # values, so what is evicted only costs a recomputation). An OrderedDict: a plain dict scans the
        # holes its evictions leave at the front on every later eviction.
        self._packed: OrderedDict[int, bytes] = OrderedDict()

    def kernel_args(self) -> tuple[np.uint64, np.ndarray, np.uint64]:
        """``(seed key, positions, vocabulary)``: what :func:`kvtier.kernels.bankkernel.blocks` takes after the hash
        ids to make this bank's token ids. O(1)."""
        return self._seed_key[0], _POSITIONS, _VOCAB

    def block(self, hash_id: int) -> np.ndarray:
        """The 512 token ids of one hash id (int64). O(512)."""
        return self._blocks([hash_id]).astype(np.int64)

    def _blocks(self, hash_ids: list[int]) -> np.ndarray:
        ids = np.array(hash_ids, dtype=np.uint64)
        k = _KERNELS.get()
        if k is not None:
            return k.blocks(ids, *self.kernel_args())  # type: ignore[no-any-return]
        keys = _mix(ids ^ self._seed_key)
        return (_mix(keys[:, None] + _POSITIONS[None, :]) % _VOCAB).ravel()

    def tokens(self, req: Request) -> list[int]:
        """The prompt's token ids. O(input_length)."""
        if not req.hash_ids:
            return []
        return self._blocks(req.hash_ids)[:req.input_length].tolist()  # type: ignore[no-any-return]

    def packed(self, req: Request) -> PackedTokens:
        """The same token ids packed (see :func:`kvtier.wire.pack_tokens`), without a Python int
        each; on the numpy path, blocks made for earlier requests are reused. O(input_length)."""
        if not req.hash_ids:
            return b""
        if _KERNELS.get() is not None:  # compiled: making every block again costs less than caching them
            return self._blocks(req.hash_ids)[:req.input_length].astype("<u4", copy=False).tobytes()
        cache = self._packed
        parts = [cache.get(h) for h in req.hash_ids]
        missing = [h for h, part in zip(req.hash_ids, parts, strict=True) if part is None]
        if missing:
            raw = self._blocks(missing).astype("<u4").tobytes()
            size = HASH_BLOCK * 4
            for j, h in enumerate(missing):
                cache[h] = raw[j * size:(j + 1) * size]
            parts = [cache[h] for h in req.hash_ids]
            for _ in range(len(cache) - self.CACHE_BLOCKS):
                cache.popitem(last=False)
        return b"".join(parts)[:req.input_length * 4]  # type: ignore[arg-type]


_U64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_POSITIONS = np.arange(1, HASH_BLOCK + 1, dtype=np.uint64) * _GOLDEN  # wraps mod 2**64, as intended
_VOCAB = np.uint64(VOCAB)
#: The compiled :func:`kvtier.kernels.bankkernel.blocks`, warmed with the argument types TokenBank passes.
_KERNELS = jit.LazyKernels("kvtier.kernels.bankkernel", lambda k: k.blocks(
    np.zeros(1, np.uint64), np.uint64(0), _POSITIONS, _VOCAB))


def bank_backend() -> str:
    """``"numba"`` when :class:`TokenBank` derives token ids with its compiled kernel, else ``"python (why)"``;
    loads the kernel now if it is not loaded yet. O(1) after the first call."""
    _KERNELS.get()
    return str(_KERNELS.backend)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def _integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a length


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _show(v: object) -> str:
    """``repr(v)``, cut to 40 characters: an error line stays one short line whatever the record held."""
    return _cut(repr(v))


def _cut(text: str) -> str:
    """``text`` cut to 40 characters, as :func:`_show` cuts what it shows."""
    return text if len(text) <= 40 else text[:37] + "..."


def _within(v: object, lo: float, hi: float) -> bool:
    """``v`` is an int or float (not a bool) in ``[lo, hi]``: NaN is not, and an integer too big for a float is
    compared exactly, never converted."""
    return _number(v) and lo <= v <= hi  # type: ignore[operator]


def read_line(f: BinaryIO) -> bytes:
    """The next line of ``f`` (b"" at the end), reading at most :data:`MAX_LINE_BYTES` and one byte: a longer line
    is a :class:`LineTooLong` with nothing more of it read."""
    raw = f.readline(MAX_LINE_BYTES + 1)
    if len(raw) > MAX_LINE_BYTES:
        raise LineTooLong(f"line is longer than the cap of {MAX_LINE_BYTES:,} bytes per record (MAX_LINE_BYTES)")
    return raw


class LineTooLong(ValueError):
    """A line past :data:`MAX_LINE_BYTES` (the caller names the file and line)."""


def _lines_at(path: Path) -> Iterator[tuple[int, str, int]]:
    """(line number, text, size in bytes) of a UTF-8 file, without the byte-order mark some tools write first
    (spreadsheets saving "CSV UTF-8"); a line that is not UTF-8, or is longer than :data:`MAX_LINE_BYTES`, is a
    :class:`TraceError` naming it. Memory: one line."""
    with open(path, "rb") as f:
        lineno = 0
        while True:
            lineno += 1
            try:
                raw = read_line(f)
            except LineTooLong as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None
            if not raw:
                return
            try:
                # (a reader seeking to line 1's offset reads the mark again: json.loads of bytes skips it)
                yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8"), len(raw)
            except UnicodeDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not UTF-8 (byte {raw[exc.start]:#04x} at column "
                                 f"{exc.start + 1})") from None


# A JSON string, or what is left of one the line does not close (possessive: linear on any input).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_OPEN = np.frombuffer(b"[{", np.uint8)
_DEPTH_CHUNK = 1 << 20  # brackets measured at a time (bounds the arrays of a line of brackets)


def _too_deep(text: str) -> bool:
    """Arrays and objects in ``text`` nest deeper than :data:`MAX_DEPTH` (brackets inside strings are text).
    Measured before decoding: json.loads recurses once per level. O(len(text)), in C; memory a few bytes per
    bracket, a chunk at a time."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False  # (the common case: no deeper than the openers it has)
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii")
    depth = 0
    for at in range(0, len(brackets), _DEPTH_CHUNK):
        codes = np.frombuffer(brackets, np.uint8, min(_DEPTH_CHUNK, len(brackets) - at), at)
        levels = np.cumsum(np.where(np.isin(codes, _OPEN), 1, -1)) + depth
        if int(levels.max()) > MAX_DEPTH:
            return True
        depth = int(levels[-1])
    return False


def decode_record(text: str | bytes, where: str) -> object:
    """One JSONL line decoded, refused (a :class:`TraceError` prefixed with ``where``) if it is not JSON or nests
    deeper than :data:`MAX_DEPTH`. O(len(text))."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise TraceError(f"{where}: not UTF-8 (byte {text[exc.start]:#04x} at column {exc.start + 1})") from None
    if _too_deep(text):
        raise TraceError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels (MAX_DEPTH)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:  # (its message names a column; the line is `where`'s)
        raise TraceError(f"{where}: not JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}") from None
    except ValueError as exc:  # e.g. an integer of more digits than int() takes
        raise TraceError(f"{where}: not JSON: {exc}") from None
    except RecursionError:  # (cannot happen past the depth check; one line all the same)
        raise TraceError(f"{where}: JSON nested too deep") from None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file (see :func:`_lines_at`)."""
    for lineno, text, _ in _lines_at(path):
        yield lineno, text


def request_from(obj: object, where: str) -> Request:
    """One Mooncake record (a decoded JSON line) checked and made a request (``request_id`` empty when the
    record has none). Raises :class:`TraceError` prefixed with ``where``."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {missing}")
    ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not _within(ts, 0, MAX_TIMESTAMP_MS):
        raise TraceError(f"{where}: timestamp must be a finite non-negative number of ms up to "
                         f"{MAX_TIMESTAMP_MS:g}, got {_show(ts)}")
    if not _integer(n_in) or n_in < 1 or not _integer(n_out) or n_out < 0:
        raise TraceError(f"{where}: input_length must be >= 1 and output_length >= 0 (integers), "
                         f"got {_show(n_in)} and {_show(n_out)}")
    for name, n in (("input_length", n_in), ("output_length", n_out)):
        if n > MAX_TOKENS:
            raise TraceError(f"{where}: {name} {_show(n)} is past the cap of {MAX_TOKENS:,} tokens (MAX_TOKENS)")
    if not isinstance(ids, list):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative 64-bit integers")
    if len(ids) > MAX_HASH_IDS:
        raise TraceError(f"{where}: hash_ids has {len(ids)} ids, past the cap of {MAX_HASH_IDS:,} (MAX_HASH_IDS)")
    if not all(_integer(h) and 0 <= h < 1 << 64 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative 64-bit integers")
    if len(ids) != math.ceil(n_in / HASH_BLOCK):
        raise TraceError(f"{where}: {len(ids)} hash_ids for {n_in} input tokens "
                         f"(expected ceil({n_in}/{HASH_BLOCK}) = {math.ceil(n_in / HASH_BLOCK)})")
    rid = obj.get("request_id")
    rid = "" if rid is None else rid  # (null: no id, as a record without one)
    if not isinstance(rid, str | int) or isinstance(rid, bool):
        raise TraceError(f"{where}: request_id must be a string or an integer, got {_show(rid)}")
    session, think = obj.get("session_id"), obj.get("think_s")
    if session is not None and (not isinstance(session, str | int) or isinstance(session, bool)):
        raise TraceError(f"{where}: session_id must be a string or an integer, got {_show(session)}")
    if think is not None and not _within(think, 0, MAX_THINK_S):
        raise TraceError(f"{where}: think_s must be a non-negative number of seconds up to {MAX_THINK_S:g}, "
                         f"got {_show(think)}")
    return Request(str(rid), float(ts) / 1000.0, n_in, n_out, list(ids),
                   None if session is None else str(session), None if think is None else float(think))


def read_mooncake(path: Path, limit: int | None = None) -> Iterator[tuple[int, int, Request]]:
    """``(index, byte offset of its line, request)`` of each record of a Mooncake JSONL file
    (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``), streamed, up to ``limit``.

    A record without ``request_id`` gets ``r<index>``. Raises :class:`TraceError` naming the line of the
    first malformed record, of a request id used twice, or of a timestamp that goes backwards (records
    must be in non-decreasing timestamp order). Memory: 8 bytes per record while no record names an id,
    then the ids.
    """
    # Generated ids r0, r1, ... cannot collide with each other, so ids are remembered only from the first
    # record that names its own (a million-line trace without ids keeps no set).
    seen: dict[str, int] | None = None  # request id -> line, once the file names an id
    generated = array("l")  # line of each record so far, while no id is named (to report a collision)
    prev: float | None = None
    n = offset = 0
    for lineno, line, size in _lines_at(path):
        at, offset = offset, offset + size
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        req = request_from(decode_record(line, where), where)
        if req.request_id and seen is None:
            seen = {f"r{i}": line_i for i, line_i in enumerate(generated)}
            generated = array("l")
        named = bool(req.request_id)
        if not named:
            req.request_id = f"r{n}"
        if seen is None:
            generated.append(lineno)
        else:
            if req.request_id in seen:
                raise TraceError(f"{where}: request_id {req.request_id!r} already used on line "
                                 f"{seen[req.request_id]}" if named else f"{where}: no request_id, and the one a "
                                 f"record without one gets, {req.request_id!r} (r<its index>), is line "
                                 f"{seen[req.request_id]}'s: give every record its own id, or none")
            seen[req.request_id] = lineno
        if prev is not None and req.arrival < prev:
            raise TraceError(f"{where}: timestamp goes backwards ({req.arrival * 1000:g} ms after "
                             f"{prev * 1000:g} ms)")
        prev = req.arrival
        yield n, at, req
        n += 1
        if limit is not None and n >= limit:
            break
    if not n:
        raise TraceError(f"{path}: no requests")


def load_mooncake(path: Path, limit: int | None = None) -> list[Request]:
    """The requests of a Mooncake JSONL file, in a list (:func:`read_mooncake` has the format and its
    checks; :class:`kvtier.sim.source.MooncakeFile` replays one without holding it)."""
    return [req for _, _, req in read_mooncake(path, limit)]


def _azure_time(text: str) -> datetime:
    """Azure's TIMESTAMP: ISO date and time, up to 7 fractional digits (cut to 6), an optional offset."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:?\d\d)?", text.strip())
    if not m:
        raise ValueError(f"TIMESTAMP {_show(text.strip())} is not an ISO date and time")
    frac = (m.group(2) or "0")[:6].ljust(6, "0")
    tz = m.group(3)
    try:
        return datetime.fromisoformat(f"{m.group(1)}.{frac}" + ("" if tz is None else tz.replace("Z", "+00:00")))
    except ValueError as exc:  # (a month 13, a day 45, an offset past a day)
        raise ValueError(f"TIMESTAMP {_show(text.strip())} is not a date and time: {exc}") from None


def _azure_count(row: dict[str, str], name: str) -> int:
    """A token count of an Azure row: ASCII digits (``int`` would also take ``1_000``, spaces inside and other
    scripts' digits), a sign allowed for the range check to refuse; shown cut, and refused as past the cap before
    ``int`` meets a number too long for it."""
    text = row[name].strip()
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError(f"{name} {_show(text)} is not an integer")
    if len(text.lstrip("+-").lstrip("0")) > len(str(MAX_TOKENS)):  # (shown as the cap check below shows it)
        raise ValueError(f"{name} {_cut(text)} is past the cap of {MAX_TOKENS:,} tokens (MAX_TOKENS)")
    return int(text)


def load_azure(path: Path, *, share_prefix_blocks: int = 0, groups: int = 8, seed: int = 0,
               limit: int | None = None) -> list[Request]:
    """Reads an Azure LLM trace CSV (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``).

    The trace has lengths only. Sharing is synthesised, documented and seeded: each
    request joins one of ``groups`` groups at random and its first
    ``share_prefix_blocks`` 512-token blocks are that group's (like a system prompt
    per application); all other blocks are unique. 0 keeps every prompt unique.
    """
    rng = np.random.default_rng(seed)
    out: list[Request] = []
    t0: datetime | None = None
    next_id = groups * max(share_prefix_blocks, 0)
    reader = csv.DictReader(line for _, line in _lines(path))
    need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    try:
        columns = reader.fieldnames
    except csv.Error as exc:
        raise TraceError(f"{path}:1: not CSV: {exc}") from None
    if columns is None or not set(need) <= set(columns):
        raise TraceError(f"{path}:1: expected columns {sorted(need)}, got {_show(columns)}")
    prev: datetime | None = None
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:  # e.g. a field past csv's own limit (131,072 characters)
            # (DictReader's own line_num moves only once a row is made: its reader's counts the failed one)
            raise TraceError(f"{path}:{reader.reader.line_num}: not CSV: {exc}") from None
        where = f"{path}:{reader.line_num}"
        missing = [k for k in need if row.get(k) is None]
        if missing:  # (a short row: csv leaves its last fields None)
            raise TraceError(f"{where}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing")
        try:
            ts = _azure_time(row["TIMESTAMP"])
        except (ValueError, TypeError, AttributeError) as exc:
            raise TraceError(f"{where}: {exc}") from None
        try:
            n_in, n_out = _azure_count(row, "ContextTokens"), _azure_count(row, "GeneratedTokens")
        except ValueError as exc:
            raise TraceError(f"{where}: {exc}") from None
        if n_in < 1 or n_out < 0:
            raise TraceError(f"{where}: ContextTokens must be >= 1 and GeneratedTokens >= 0")
        for name, n in (("ContextTokens", n_in), ("GeneratedTokens", n_out)):
            if n > MAX_TOKENS:  # (before its blocks get ids)
                raise TraceError(f"{where}: {name} {_show(n)} is past the cap of {MAX_TOKENS:,} tokens "
                                 "(MAX_TOKENS)")
        if prev is not None:
            if (ts.tzinfo is None) != (prev.tzinfo is None):
                raise TraceError(f"{where}: TIMESTAMP {_show(row['TIMESTAMP'].strip())} mixes time zones with "
                                 "earlier rows (some have an offset, some not)")
            if ts < prev:
                raise TraceError(f"{where}: TIMESTAMP goes backwards ({ts} after {prev})")
        prev = ts
        t0 = t0 or ts
        blocks = math.ceil(n_in / HASH_BLOCK)
        g = int(rng.integers(groups))
        shared = min(share_prefix_blocks, blocks - 1) if share_prefix_blocks > 0 else 0
        ids = [g * share_prefix_blocks + i for i in range(shared)]
        ids += list(range(next_id, next_id + blocks - shared))
        next_id += blocks - shared
        out.append(Request(f"r{len(out)}", (ts - t0).total_seconds(), n_in, n_out, ids))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise TraceError(f"{path}: no requests")
    return out


def is_azure(path: Path | str) -> bool:
    """Whether a trace file is an Azure CSV (lengths only) rather than Mooncake JSONL: by its extension, in any
    case (``.csv``, ``.CSV``). O(1)."""
    return Path(path).suffix.lower() == ".csv"


def load_trace(path: Path, limit: int | None = None) -> list[Request]:
    """Mooncake JSONL or Azure CSV, by extension (:func:`is_azure`)."""
    if is_azure(path):
        return load_azure(path, limit=limit)
    return load_mooncake(path, limit=limit)


def write_mooncake(requests: Iterable[Request], path: Path) -> int:
    """Writes ``requests`` as Mooncake JSONL as they come; returns how many. O(1) memory."""
    n = 0
    with open(path, "w") as f:
        for r in requests:
            f.write(r.to_json() + "\n")
            n += 1
    return n


def prefix_reuse(requests: list[Request], page_size: int) -> float:
    """Token-weighted prefix reuse with an unbounded cache, from hash ids alone.

    A request reuses, block by block, what an earlier request with the same leading
    hash ids had cached: full pages only (a partial trailing page is never cached).
    """
    seen: dict[tuple[int, ...], int] = {}  # prefix of hash ids -> cached tokens of its last block
    reused = total = 0
    for r in requests:
        total += r.input_length
        lengths = [HASH_BLOCK] * (len(r.hash_ids) - 1) + [r.input_length - HASH_BLOCK * (len(r.hash_ids) - 1)]
        matching = True
        for j in range(len(r.hash_ids)):
            key = tuple(r.hash_ids[:j + 1])
            mine = lengths[j] // page_size * page_size
            if matching:
                take = min(seen.get(key, 0), mine)
                reused += take
                matching = take == HASH_BLOCK
            seen[key] = max(seen.get(key, 0), mine)
    return reused / total if total else 0.0
