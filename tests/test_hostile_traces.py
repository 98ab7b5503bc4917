"""Hostile trace files are refused in bounded memory, each with one :class:`TraceError` naming the file and line.

What is forced here: a line far past the cap with no newline (a sparse file, so the test writes nothing), a record
with more hash ids than any prompt may have, a line nested 200,000 deep, integers too big for a float, and CSV
fields past the csv module's own limit. The old readers read the long line whole, allocated per hash id, raised
RecursionError and OverflowError, or let csv.Error escape.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from kvtier.sim import trace as trace_module
from kvtier.sim.source import MooncakeFile
from kvtier.sim.trace import (
    HASH_BLOCK,
    MAX_DEPTH,
    MAX_HASH_IDS,
    MAX_LINE_BYTES,
    MAX_TOKENS,
    TraceError,
    load_azure,
    load_mooncake,
    load_trace,
)

GOOD = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def sparse(path: Path, head: bytes, size: int) -> Path:
    """``head`` then zero bytes up to ``size``, without a newline: a sparse file, nothing written past ``head``."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def peak_mib(fn: Any, *args: Any) -> tuple[BaseException | None, float]:
    """What ``fn(*args)`` raised, and the most Python memory it held at once (MiB)."""
    tracemalloc.start()
    try:
        fn(*args)
        raised: BaseException | None = None
    except BaseException as exc:
        raised = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak / 2**20


@pytest.mark.parametrize("loader", [load_mooncake, lambda p: MooncakeFile(p).index(), load_azure])
def test_a_64_mib_line_without_newline_is_refused_without_reading_it(tmp_path: Path, loader: Any) -> None:
    size = 64 * 2**20
    assert size >= MAX_LINE_BYTES * 4  # the file is far past the cap, so reading it whole would show
    head = (HEADER if loader is load_azure else GOOD).encode()
    path = sparse(tmp_path / ("t.csv" if loader is load_azure else "t.jsonl"), head, size)
    raised, peak = peak_mib(loader, path)
    assert isinstance(raised, TraceError), raised
    assert f"t.{path.suffix[1:]}:2: line is longer than the cap of {MAX_LINE_BYTES:,} bytes" in str(raised)
    assert peak < 3 * MAX_LINE_BYTES / 2**20, f"{peak:.1f} MiB held to refuse a {size >> 20} MiB line"


def test_a_line_at_the_cap_is_read(tmp_path: Path) -> None:
    """The cap counts the newline: a record padded to exactly MAX_LINE_BYTES loads."""
    record = GOOD.rstrip("\n")[:-1] + ', "pad": "'
    line = record + "x" * (MAX_LINE_BYTES - len(record) - 3) + '"}\n'
    assert len(line.encode()) == MAX_LINE_BYTES
    (tmp_path / "t.jsonl").write_text(line)
    assert load_mooncake(tmp_path / "t.jsonl")[0].hash_ids == [1]
    (tmp_path / "u.jsonl").write_text(line[:-2] + ' }\n')
    with pytest.raises(TraceError, match=r"u\.jsonl:1: line is longer than the cap"):
        load_mooncake(tmp_path / "u.jsonl")


def record(**kw: Any) -> str:
    obj: dict[str, Any] = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    obj.update(kw)
    return json.dumps(obj)


@pytest.mark.parametrize("line,fragment", [
    # as many hash ids as the tokens claim, one block past the cap
    (record(input_length=(MAX_HASH_IDS + 1) * HASH_BLOCK, hash_ids=list(range(MAX_HASH_IDS + 1))),
     f"input_length {(MAX_HASH_IDS + 1) * HASH_BLOCK} is past the cap of {MAX_TOKENS:,} tokens"),
    (record(hash_ids=[7] * (MAX_HASH_IDS + 1)),
     f"hash_ids has {MAX_HASH_IDS + 1} ids, past the cap of {MAX_HASH_IDS:,}"),
    (record(output_length=10**10), f"output_length 10000000000 is past the cap of {MAX_TOKENS:,} tokens"),
    # integers no float holds: math.isfinite and the division by the block size raised OverflowError
    (record(input_length=10**400), "input_length 1000000000"),
    (record(timestamp=10**400), "timestamp must be a finite non-negative number of ms up to"),
    (record(think_s=10**400), "think_s must be a non-negative number of seconds up to"),
    # json refuses integers past 4,300 digits with a plain ValueError, not a JSONDecodeError
    ('{"timestamp": ' + "9" * 5000 + "}", "not JSON"),
    ("[" * 200_000 + "]" * 200_000, f"nested deeper than {MAX_DEPTH} levels"),
    ('{"a": ' + "[" * 200_000, f"nested deeper than {MAX_DEPTH} levels"),
    ('{"a": ' + "{\"b\": " * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 2), f"nested deeper than {MAX_DEPTH}"),
])
def test_hostile_records_are_named(tmp_path: Path, line: str, fragment: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + line + "\n")
    with pytest.raises(TraceError) as info:
        load_mooncake(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2: ") and fragment in message, message
    assert "\n" not in message and len(message) < 400, message  # one line, however big the value


def test_what_the_caps_allow_loads(tmp_path: Path) -> None:
    """A prompt of MAX_TOKENS tokens in MAX_HASH_IDS blocks, nesting at MAX_DEPTH, and brackets inside strings
    (which are not nesting) all load."""
    deep: Any = 1
    for _ in range(MAX_DEPTH - 1):  # the record itself is one level
        deep = [deep]
    lines = [record(input_length=MAX_TOKENS, output_length=MAX_TOKENS, hash_ids=list(range(MAX_HASH_IDS))),
             record(extra=deep), record(request_id="[{" * 10_000), record(request_id='\\"[' * 10_000)]
    (tmp_path / "t.jsonl").write_text("".join(line + "\n" for line in lines))
    reqs = load_mooncake(tmp_path / "t.jsonl")
    assert len(reqs[0].hash_ids) == MAX_HASH_IDS and reqs[0].input_length == MAX_TOKENS
    assert reqs[2].request_id == "[{" * 10_000 and reqs[3].request_id == '\\"[' * 10_000
    assert [r.request_id for r in MooncakeFile(tmp_path / "t.jsonl")][2] == "[{" * 10_000


def test_too_deep_an_extra_field_is_refused(tmp_path: Path) -> None:
    deep: Any = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    (tmp_path / "t.jsonl").write_text(record(extra=deep) + "\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:1: JSON nested deeper than {MAX_DEPTH} levels"):
        load_mooncake(tmp_path / "t.jsonl")


def test_a_streamed_line_that_became_hostile_after_indexing_is_named(tmp_path: Path) -> None:
    """MooncakeFile reads each line again when its request arrives: a file rewritten meanwhile gets the same caps
    (a 64 MiB line at an indexed offset is not read whole, nor a deep one parsed)."""
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + GOOD)
    src = MooncakeFile(path).index()
    sparse(path, GOOD.encode(), 64 * 2**20)
    raised, peak = peak_mib(list, src)
    assert isinstance(raised, TraceError) and "request 1 changed after the trace was read" in str(raised), raised
    assert "line is longer than the cap" in str(raised) and peak < 3 * MAX_LINE_BYTES / 2**20, peak
    path.write_text(GOOD + "[" * 200_000 + "\n")
    with pytest.raises(TraceError, match=r"request 1 changed after the trace was read: .*nested deeper than"):
        list(src)


@pytest.mark.parametrize("row,fragment", [
    ("2023-11-16 18:15:47,10000000000,1", f"ContextTokens 10000000000 is past the cap of {MAX_TOKENS:,} tokens"),
    ("2023-11-16 18:15:47," + "1" * 30 + ",1", "ContextTokens 111111111111111111111111111111 is past the cap"),
    ("2023-11-16 18:15:47,10,10000000000", f"GeneratedTokens 10000000000 is past the cap of {MAX_TOKENS:,}"),
    # past csv's own field limit (131,072 characters): named as not CSV, not let out as a csv.Error traceback
    ("2023-11-16 18:15:47,10,1," + "x" * 200_000, "not CSV: field larger than field limit"),
    ("x" * 100_000 + ",10,1", "TIMESTAMP '" + "x" * 36 + "... is not an ISO date"),
])
def test_hostile_azure_rows_are_named(tmp_path: Path, row: str, fragment: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(HEADER + "2023-11-16 18:15:46,12,3\n" + row + "\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3: ") and fragment in message, message
    assert "\n" not in message and len(message) < 400, message


def test_the_caps_are_stated_where_the_formats_are() -> None:
    """The README's trace formats give each cap's value, and the module's docstring points to them."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for value in (f"at most {MAX_LINE_BYTES >> 20} MiB", f"at most {MAX_TOKENS:,}", f"at most {MAX_HASH_IDS:,}",
                  f"at most {MAX_DEPTH} deep"):
        assert value in readme, value
    assert trace_module.__doc__ is not None and "MAX_LINE_BYTES" in trace_module.__doc__
