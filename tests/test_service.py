"""The indexer service end to end: real publishers, real sockets, real HTTP."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.indexer.index.keys import key_backend
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.service import persist
from kvtier.indexer.service.app import ConfigError, IndexerService, ServiceConfig, load_config, parse_endpoint
from kvtier.indexer.service.exposition import Family, render
from kvtier.sim.cli import main as cli_main
from kvtier.wire import BlockRemoved, BlockStored, EventBatch, Publisher, StorageTier, tokenarray, window_group
from kvtier.wire.notices import StreamId
from kvtier.wire.protocol import WorkerId
from tests.test_multiprocess import ROOT

BS = 4
TOKS = list(range(1000, 1032))  # 8 blocks


def stored(hashes: list[int], parent: int | None, lo: int, medium: str = "GPU", **group: Any) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=TOKS[lo * BS:(lo + len(hashes)) * BS], block_size=BS, medium=medium, **group)


def post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


class Clock:
    """A clock moved by the test (``IndexerService(clock=..., request_clock=...)``): nothing it times depends on how
    fast the machine runs."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def replaced_by_a_directory(snapshot: Path) -> bool:
    """Puts a directory where a service's snapshot file is, so that the rename over it fails (as a full disk would
    fail the write); False where a snapshot was written between the removal and the directory (the service's loop
    writes without a lock): ``wait_for`` it. O(1)."""
    snapshot.unlink(missing_ok=True)
    try:
        snapshot.mkdir()
    except FileExistsError:
        return False
    return True


def wait_for(cond: Callable[[], bool], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
def cluster() -> Iterator[tuple[list[Publisher], IndexerService]]:
    pubs = [Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(3)]
    eps = [parse_endpoint(f"w{i}={p.endpoint},replay={p.replay_endpoint}") for i, p in enumerate(pubs)]
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0",
                                       replay_timeout_s=1.0))
    svc.start()
    yield pubs, svc
    svc.stop()
    for p in pubs:
        p.close()


def overlaps(svc: IndexerService) -> dict[str, Any]:
    code, body = post(svc.address + "/query", {"token_ids": TOKS})
    assert code == 200
    return body


def test_query_metrics_health_end_to_end(cluster: tuple[list[Publisher], IndexerService]) -> None:
    (p0, p1, p2), svc = cluster
    p0.publish(EventBatch(ts=time.time(), events=[stored([1, 2, 3], None, 0)]))
    p1.publish(EventBatch(ts=time.time(), events=[stored([11, 12, 13, 14, 15, 16], None, 0, "CPU_PINNED")]))
    p1.publish(EventBatch(ts=time.time(), events=[stored([11], None, 0)]))
    p2.publish(EventBatch(ts=time.time(), events=[stored([21, 22], None, 0, "EXTERNAL")]))
    wait_for(lambda: (b := overlaps(svc))["workers"]["w1"]["device"] == 1 and b["shared_pool"] == 2
             and b["workers"]["w0"]["device"] == 3 and not any(w["recovering"] for w in b["workers"].values()))
    body = overlaps(svc)
    assert body["total_blocks"] == 8
    ok = {"partial": False, "recovering": False, "dead": False, "window_kv": "untracked"}
    assert body["workers"]["w0"] == {"device": 3, "host": 3, "disk": 3, "external": 3, **ok}
    assert body["workers"]["w1"] == {"device": 1, "host": 6, "disk": 6, "external": 6, **ok}
    assert body["workers"]["w2"] == {"device": 0, "host": 0, "disk": 0, "external": 2, **ok}
    assert body["recommended"] == "w1" and set(body["costs"]) == {"w0", "w1", "w2"}
    text = get(svc.address + "/metrics")
    assert 'kvtier_blocks{worker="w1",tier="host"} 6' in text
    assert 'kvtier_events_applied_total{worker="w0"} 1' in text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # the reference parser
    assert families["kvtier_events_applied"].type == "counter"
    assert families["kvtier_blocks"].type == "gauge" and families["kvtier_blocks"].documentation
    got = {(s.labels["worker"], s.labels["tier"]): s.value for s in families["kvtier_blocks"].samples}
    assert got[("w1", "host")] == 6 and got[("w2", "external")] == 2
    assert text.count("# TYPE kvtier_blocks ") == 1  # one family, not one per worker
    m = json.loads(get(svc.address + "/metrics?format=json"))
    assert m["workers"]["w0"]["apply_lag_seconds"] >= 0
    # Startup's objects are frozen out of the collector's passes, which are counted from start.
    assert gc.get_freeze_count() > 0 and 0 <= m["gc_pause_max_seconds"] <= m["gc_pause_seconds"]
    assert families["kvtier_gc_pause_max_seconds"].type == "gauge"
    passes = {s.labels["generation"]: s.value for s in families["kvtier_gc_passes"].samples}
    assert set(passes) == {"young", "full"}
    assert json.loads(get(svc.address + "/health")) == {"status": "ok", "workers": 3, "partial_workers": [],
                                                        "recovering_workers": [], "dead_workers": [],
                                                        "http_loop": "uvloop" if find_spec("uvloop") else "asyncio",
                                                        "keys": key_backend(load=False), "loop_restarts": 0,
                                                        "restored_from": None}
    assert key_backend(load=False) != "not loaded"  # the service loaded its key chain at start
    assert tokenarray._KERNELS.backend is not None  # and its token-array kernels (warmed once loaded)
    p0.publish(EventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[3, 2], medium="GPU")]))
    wait_for(lambda: overlaps(svc)["workers"]["w0"]["device"] == 1)


def test_gap_is_replayed_and_unknown_parent_is_an_orphan(cluster: tuple[list[Publisher], IndexerService]) -> None:
    (p0, _, _), svc = cluster
    p0.publish(EventBatch(ts=time.time(), events=[stored([1], None, 0)]))
    wait_for(lambda: overlaps(svc)["workers"]["w0"]["device"] == 1)
    p0.live_filter = lambda s: s != 1  # seq 1 never arrives live
    p0.publish(EventBatch(ts=time.time(), events=[stored([2], 1, 1)]))
    p0.publish(EventBatch(ts=time.time(), events=[stored([3], 2, 2)]))
    wait_for(lambda: overlaps(svc)["workers"]["w0"]["device"] == 3)
    # (the replayed batch is applied before the answer's end marker, at which the gap counts as filled)
    wait_for(lambda: json.loads(get(svc.address + "/metrics?format=json"))["workers"]["w0"]["gaps_filled"] == 1)
    m = json.loads(get(svc.address + "/metrics?format=json"))["workers"]["w0"]
    assert m["gaps"] == 1 and m["gaps_filled"] == 1 and m["events_rejected"] == 0
    # A store whose parent the engine never published, then a valid store in the same batch: the
    # orphan is held (no resync: a replay would bring the same store again), the valid one applies.
    p0.live_filter = None
    p0.publish(EventBatch(ts=time.time(), events=[stored([9], 99, 3), stored([4], 3, 3)]))
    wait_for(lambda: overlaps(svc)["workers"]["w0"]["device"] == 4)
    time.sleep(0.3)
    m = json.loads(get(svc.address + "/metrics?format=json"))["workers"]["w0"]
    assert m["unknown_parents"] == 1 and m["orphan_blocks"] == 1 and m["resyncs"] == 0
    assert not m["partial"] and m["events_rejected"] == 0


def test_bad_queries_get_400(cluster: tuple[list[Publisher], IndexerService]) -> None:
    _, svc = cluster
    for body in [{"tokens": [1]}, {"token_ids": ["a"]}, [1, 2], {"token_ids": [1], "lora_name": 3},
                 {"token_ids": [-1]}]:
        code, resp = post(svc.address + "/query", body)
        assert code == 400 and resp["error"]
    for ids, where in (([-1], 0), ([5, 6, 2**32], 2), ([1, 2**64], 1)):  # the range, checked as ids are packed
        code, resp = post(svc.address + "/query", {"token_ids": ids})
        assert code == 400 and f"$.token_ids[{where}]" in resp["error"], resp
    code, _ = post(svc.address + "/nope", {})
    assert code == 404


def test_config_file_and_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "indexer.toml"
    cfg.write_text('block_size = 32\nlisten = "127.0.0.1:0"\n[[endpoints]]\nworker = "a"\n'
                   'endpoint = "tcp://127.0.0.1:5557"\nreplay_endpoint = "tcp://127.0.0.1:5558"\n'
                   'dp_rank = 2\nsupports_dump = true\n')
    c = load_config(cfg)
    assert c.block_size == 32 and c.endpoints[0].dp_rank == 2 and c.endpoints[0].supports_dump
    (tmp_path / "bad.toml").write_text('colour = "blue"\n')
    with pytest.raises(ConfigError, match=r"unknown settings \['colour'\]$"):  # (nothing like it: no guess)
        load_config(tmp_path / "bad.toml")
    # A typo, or the command line's spelling of an endpoint option, gets the name meant
    (tmp_path / "typo.toml").write_text('blocksize = 16\n')
    with pytest.raises(ConfigError, match=r"settings \['blocksize'\]; did you mean 'blocksize' -> 'block_size'"):
        load_config(tmp_path / "typo.toml")
    (tmp_path / "cli.toml").write_text('[[endpoints]]\nworker = "a"\nendpoint = "tcp://h:1"\nreplay = "tcp://h:2"\n'
                                       'dump = true\n')
    with pytest.raises(ConfigError, match="did you mean 'dump' -> 'supports_dump', 'replay' -> 'replay_endpoint'"):
        load_config(tmp_path / "cli.toml")
    (tmp_path / "bad2.toml").write_text('[[endpoints]]\nworker = "a"\n')
    with pytest.raises(ConfigError, match=r"endpoints\[0\]"):
        load_config(tmp_path / "bad2.toml")
    assert parse_endpoint("w=tcp://h:1,replay=tcp://h:2,dp=3,dump").dp_rank == 3
    with pytest.raises(ConfigError, match="no dump without a replay endpoint"):  # the request would go nowhere
        parse_endpoint("w=tcp://h:1,dump")
    (tmp_path / "bad3.toml").write_text('[[endpoints]]\nworker = "a"\nendpoint = "tcp://h:1"\nsupports_dump = true\n')
    with pytest.raises(ConfigError, match=r"endpoints\[0\]: .*no dump without a replay endpoint"):
        load_config(tmp_path / "bad3.toml")
    assert cli_main(["indexer"]) == 2
    assert cli_main(["indexer", "--endpoint", "oops"]) == 2
    # Addresses ZMQ would take and never connect to, or refuse only once the service runs: refused here.
    for bad, says in [("w=tcp://127.0.0.1:99999", "port in 1..65535"), ("w=http://h:1", "expected tcp://"),
                      ("w=tcp://*:5557", "host name or address"), ("w=tcp://a b:5557", "host name or address"),
                      ("w=tcp://h:1,replay=tcp://h", "port in 1..65535"), ("w=ipc://", "nothing after ipc://"),
                      ("w=ipc:///" + "x" * 107, "longer than 107 bytes")]:
        with pytest.raises(ConfigError, match=rf"endpoint {re.escape(repr(bad))}: .*{says}"):
            parse_endpoint(bad)
    assert parse_endpoint("w=ipc:///tmp/kv.sock").endpoint == "ipc:///tmp/kv.sock"
    (tmp_path / "bad4.toml").write_text('[[endpoints]]\nworker = "a"\nendpoint = "tcp://h:0"\n')
    with pytest.raises(ConfigError, match=r"endpoints\[0\]: 'tcp://h:0': expected tcp://HOST:PORT"):
        load_config(tmp_path / "bad4.toml")
    # A snapshot that could never be written is refused at start, not logged every 30 s from then on.
    eps = [parse_endpoint("w=tcp://127.0.0.1:1")]
    for path, says in [(tmp_path / "no" / "x.snap", "does not exist"), (tmp_path, "is a directory")]:
        with pytest.raises(ConfigError, match=f"snapshot .*{says}"):
            IndexerService(ServiceConfig(endpoints=eps, block_size=BS, snapshot_path=str(path)))


def test_metrics_cover_all_tiers(cluster: tuple[list[Publisher], IndexerService]) -> None:
    _, svc = cluster
    m = json.loads(get(svc.address + "/metrics?format=json"))
    assert set(m["workers"]["w0"]["blocks"]) == {t.name.lower() for t in StorageTier}


def test_exposition_escapes_labels_and_help() -> None:
    fam = Family("kvtier_x_total", "counter", 'counts "things"\\ across\nlines')
    odd = 'w"0\\a\nb'
    fam.add(3, worker=odd)
    fam.add(1.5, worker="plain")
    (parsed,) = text_string_to_metric_families(render([fam]))
    assert parsed.name == "kvtier_x" and parsed.type == "counter"
    assert parsed.documentation == 'counts "things"\\ across\nlines'
    assert [(s.labels["worker"], s.value) for s in parsed.samples] == [(odd, 3), ("plain", 1.5)]


def test_query_says_how_each_worker_window_kv_is_known() -> None:
    """An SWA model (window of two blocks): a worker announcing window KV is ``tracked``, one that sends no
    window events has it ``inferred`` from its stores; both answer their usable prefix beside the raw one."""
    pubs = [Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
    eps = [parse_endpoint(f"w{i}={p.endpoint},replay={p.replay_endpoint}") for i, p in enumerate(pubs)]
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", replay_timeout_s=1.0,
                                       window_tokens=2 * BS))
    svc.start()
    try:
        win = window_group(2 * BS)
        # Both cache the first 6 blocks; w0 says its window KV sits on blocks 2 and 3, w1 says nothing.
        pubs[0].publish(EventBatch(ts=time.time(), events=[stored([1, 2, 3, 4, 5, 6], None, 0),
                                                           stored([3, 4], 2, 2, **win)]))
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([11, 12, 13, 14, 15, 16], None, 0)]))
        wait_for(lambda: overlaps(svc)["workers"]["w1"]["raw"]["device"] == 6
                 and overlaps(svc)["workers"]["w0"]["window_kv"] == "tracked")
        body = overlaps(svc)
        w0, w1 = body["workers"]["w0"], body["workers"]["w1"]
        assert (w0["window_kv"], w0["device"], w0["raw"]["device"], w0["window_blocks"]) == ("tracked", 4, 6, 2)
        assert (w1["window_kv"], w1["device"], w1["raw"]["device"], w1["window_blocks"]) == ("inferred", 6, 6, 2)
        assert body["window_inferred"] == ["w1"]
    finally:
        svc.stop()
        for p in pubs:
            p.close()


def test_a_snapshot_inferred_with_another_window_is_refused(tmp_path: Path) -> None:
    snap = tmp_path / "index.snap"
    persist.save(snap, TieredIndex(BS, window_tokens=2 * BS), {})
    eps = [parse_endpoint("w0=tcp://127.0.0.1:1")]
    with pytest.raises(ConfigError, match="window_tokens 8, the service's is 0"):
        IndexerService(ServiceConfig(endpoints=eps, block_size=BS, snapshot_path=str(snap), window_tokens=0))
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, snapshot_path=str(snap), window_tokens=2 * BS))
    assert svc.restored_from == str(snap) and svc.index.window_tokens == 2 * BS


@pytest.mark.parametrize("position", [["w0", 0, 0, None], ["w0", 0, -3, None], ["w0", -1, 2, None],
                                      ["w0", 0, 1 << 63, None], [7, 0, 2, None], ["w0", 0, 2, "digest"]])
def test_a_snapshot_with_an_impossible_stream_position_is_refused(tmp_path: Path, position: list[Any]) -> None:
    """save() writes a stream's next seq after a batch it applied: a position it cannot have written (damage, or
    another writer) is refused naming the file, not taken to the event loop, which would die on it."""
    import msgspec

    snap = tmp_path / "index.snap"
    index = TieredIndex(BS).snapshot()
    snap.write_bytes(msgspec.msgpack.encode({"version": persist.VERSION, "index": index, "positions": [position],
                                             "checksum": persist._checksum(index, [position])}))
    with pytest.raises(ValueError, match=f"snapshot {snap}: stream position"):
        persist.load(snap, BS)


def test_a_damaged_snapshot_file_is_refused_whole(tmp_path: Path) -> None:
    """A byte of a saved snapshot changed (bit rot, a torn copy) where its format cannot tell: inside a block key, or
    a stream's position. The index restored from it would hold a block nobody has, or resume a stream at the wrong
    seq; the file's checksum refuses it in one line naming the file."""
    import msgspec

    index = TieredIndex(BS)
    index.apply(StreamId(WorkerId("w0")), BlockStored(block_hashes=[1, 2], token_ids=list(range(2 * BS)),
                                                       block_size=BS))
    snap = tmp_path / "index.snap"
    persist.save(snap, index, {StreamId(WorkerId("w0")): (7, 12345)})
    assert len(persist.load(snap, BS)[0]) == 2
    good = snap.read_bytes()
    obj = msgspec.msgpack.decode(good)
    key = msgspec.msgpack.decode(obj["index"])["workers"][0]["keys"][:8]  # the first block's key, as written
    position = msgspec.msgpack.encode(["w0", 0, 7, 12345])
    for at in (good.index(key) + 3, good.index(position) + position.index(7, 4)):  # a key's byte; the seq 7
        damaged = bytearray(good)
        damaged[at] ^= 0x10
        snap.write_bytes(bytes(damaged))
        with pytest.raises(ValueError, match=f"snapshot {snap}: damaged: its checksum does not match"):
            persist.load(snap, BS)


def test_a_snapshot_file_without_its_checksum_is_refused_and_an_older_one_is_read(tmp_path: Path) -> None:
    """A file of this format always carries its checksum: one whose checksum entry was lost or renamed (the damage
    the checksum cannot see) is refused, not restored unchecked. A file written before checksums (version 1, none)
    is still read."""
    import msgspec

    snap = tmp_path / "index.snap"
    persist.save(snap, TieredIndex(BS), {StreamId(WorkerId("w0")): (7, 12345)})
    good = snap.read_bytes()
    snap.write_bytes(good.replace(b"checksum", b"checksuM"))
    with pytest.raises(ValueError, match=f"snapshot {snap}: no checksum"):
        persist.load(snap, BS)
    obj = msgspec.msgpack.decode(good)
    snap.write_bytes(msgspec.msgpack.encode({"version": 1, "index": obj["index"], "positions": obj["positions"]}))
    assert persist.load(snap, BS)[1] == {StreamId(WorkerId("w0")): (7, 12345)}


@pytest.mark.parametrize("lacks", ["index", "positions"])
def test_a_snapshot_file_lacking_a_field_names_it(tmp_path: Path, lacks: str) -> None:
    """A file of the version without checksums that lacks a field said only the field's name (``'index'``)."""
    import msgspec

    snap = tmp_path / "index.snap"
    obj: dict[str, Any] = {"version": 1, "index": TieredIndex(BS).snapshot(), "positions": []}
    del obj[lacks]
    snap.write_bytes(msgspec.msgpack.encode(obj))
    with pytest.raises(ValueError, match=f"^snapshot {snap}: no '{lacks}' field, which a snapshot holds"):
        persist.load(snap, BS)


def test_a_snapshot_file_nested_past_the_decoders_depth_is_one_line(tmp_path: Path) -> None:
    snap = tmp_path / "index.snap"
    snap.write_bytes(b"\x83\xa7version\x01\xa5index" + b"\x91" * 200_000 + b"\xc0\xa9positions\x90")
    with pytest.raises(ValueError, match=f"snapshot {snap}: "):
        persist.load(snap, BS)


def test_a_snapshot_write_that_fails_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk fails the write: the previous snapshot stays whole, and the part written does not hold its
    space (one snapshot's worth a failure) until the next start."""
    import errno

    snap = tmp_path / "index.snap"
    persist.save(snap, TieredIndex(BS), {})
    before = snap.read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    index = TieredIndex(BS)
    index.apply(StreamId(WorkerId("w0")), stored([1, 2, 3], None, 0))
    with pytest.raises(OSError, match="No space"):
        persist.save(snap, index, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.snap"] and snap.read_bytes() == before


def test_a_snapshot_through_a_symbolic_link_replaces_the_file_it_names(tmp_path: Path) -> None:
    """``--snapshot`` given as a link (to a volume's file): the write renamed a regular file over the link, and the
    file it named was never written again."""
    (tmp_path / "vol").mkdir()
    real, link = tmp_path / "vol" / "index.snap", tmp_path / "index.snap"
    link.symlink_to(real)
    index = TieredIndex(BS)
    index.apply(StreamId(WorkerId("w0")), stored([1, 2, 3], None, 0))
    persist.save(link, index, {})
    assert link.is_symlink() and len(persist.load(real, BS)[0]) == 3
    index.apply(StreamId(WorkerId("w0")), stored([4], 3, 3))
    persist.save(link, index, {})
    assert link.is_symlink() and len(persist.load(real, BS)[0]) == 4
    assert sorted(p.name for p in (tmp_path / "vol").iterdir()) == ["index.snap"]  # (no temporary file left)


def test_a_snapshot_link_into_a_missing_directory_is_refused_at_start(tmp_path: Path) -> None:
    """The start checked the link's own directory, where nothing is written: every snapshot, the last one at stop
    included, then failed."""
    link = tmp_path / "index.snap"
    link.symlink_to(tmp_path / "gone" / "index.snap")
    with pytest.raises(ValueError, match=f"snapshot {link}: directory {tmp_path / 'gone'} does not exist"):
        persist.check_path(link)


def test_a_start_removes_the_temporary_files_of_writers_that_are_gone(tmp_path: Path) -> None:
    """A writer that crashed mid-write (killed, the machine lost) left its temporary file: the next start removes
    them. It holds the path (a second service is refused), so every writer's is a gone one's, its own pid's and a
    live process's too (a pid says nothing across containers); a file of another name stays."""
    snap = tmp_path / "index.snap"
    names = {f".index.snap.tmp-{pid}" for pid in (1, os.getpid(), os.getppid())} | {
        ".index.snap.tmp-7-0123abcd", ".index.snap.tmp-x", ".other.snap.tmp-1"}
    for n in names:
        (tmp_path / n).write_bytes(b"part of a snapshot")
    IndexerService(ServiceConfig(endpoints=[parse_endpoint("w0=tcp://127.0.0.1:1")], block_size=BS,
                                 snapshot_path=str(snap)))
    assert {p.name for p in tmp_path.iterdir()} == {".index.snap.tmp-x", ".other.snap.tmp-1", ".index.snap.lock"}


def test_a_second_service_on_a_snapshot_path_is_refused_until_the_first_stops(tmp_path: Path) -> None:
    """Two services on one snapshot path (two containers on a shared volume, each service pid 1) wrote the same
    temporary file: each renamed it while the other wrote into it, leaving a torn snapshot at the path that the next
    start refuses, and each start removed the other's write in progress. A running service now holds the path."""
    from kvtier.indexer.service.app import preflight

    snap = tmp_path / "index.snap"
    cfg = ServiceConfig(endpoints=[parse_endpoint("w0=tcp://127.0.0.1:1")], block_size=BS, listen="127.0.0.1:0",
                        snapshot_path=str(snap))
    first = IndexerService(cfg)
    first.start()
    try:
        in_use = f"snapshot {snap}: in use by another indexer \\(it holds the lock on {tmp_path}/.index.snap.lock\\)"
        with pytest.raises(ConfigError, match=in_use):
            preflight(cfg)
        with pytest.raises(ConfigError, match=in_use):
            IndexerService(cfg)
    finally:
        first.stop()
    again = IndexerService(cfg)
    again.start()
    again.stop()
    assert snap.is_file()


def test_writers_of_one_path_with_one_pid_never_share_a_temporary_file(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers named their temporary file by pid alone, and two containers' services are both pid 1: the second
    truncated and wrote the file the first was writing and renamed it into place, and the first's rename then
    failed (or, interleaved, left a torn file at the path)."""
    snap = tmp_path / "index.snap"
    monkeypatch.setattr(os, "getpid", lambda: 1)
    gate, entered, sync = threading.Event(), threading.Event(), os.fsync

    def held_fsync(fd: int) -> None:
        if threading.current_thread().name == "first":
            entered.set()
            assert gate.wait(10)
        sync(fd)

    monkeypatch.setattr(os, "fsync", held_fsync)
    index, failed = TieredIndex(BS), []
    index.apply(StreamId(WorkerId("w0")), stored([1, 2, 3], None, 0))

    def first_write() -> None:
        try:
            persist.save(snap, index, {})
        except OSError as exc:
            failed.append(exc)

    first = threading.Thread(target=first_write, name="first")
    first.start()
    assert entered.wait(10)
    persist.save(snap, TieredIndex(BS), {})  # the second writer, whole, while the first is mid-write
    gate.set()
    first.join(10)
    assert not failed and len(persist.load(snap, BS)[0]) == 3  # the first's rename came last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.snap"]


def _sigterm_after_a_batch(snap: Path, before_stop: Callable[[], object] = lambda: None) -> tuple[int, str]:
    """``kvtier indexer`` with snapshot ``snap`` applies one batch of 3 blocks, then (after ``before_stop``) is sent
    SIGTERM: its exit status and stderr."""
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
        proc, address = _indexer_process(pub, snap)
        try:
            pub.publish(EventBatch(ts=time.time(), events=[stored([1, 2, 3], None, 0)]))
            wait_for(lambda: post(address + "/query", {"token_ids": TOKS})[1]["workers"]["w0"]["device"] == 3,
                     timeout=30)
            before_stop()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill() if proc.poll() is None else None
    return proc.returncode, err


def test_sigterm_stops_the_service_cleanly_with_its_last_snapshot(tmp_path: Path) -> None:
    """Supervisors (Kubernetes, systemd) stop a process with SIGTERM: the service stops as on Ctrl-C, exit 0, its
    snapshot written, so that the next start resumes instead of rebuilding every worker (not the signal's default:
    exit 143, and the blocks applied since the last periodic snapshot lost)."""
    snap = tmp_path / "index.snap"
    code, err = _sigterm_after_a_batch(snap)
    assert code == 0, err
    index, positions = persist.load(snap, BS)
    assert index.find_matches(TOKS).workers[StreamId(WorkerId("w0"))].device == 3
    assert positions[StreamId(WorkerId("w0"))][0] == 1  # resumes after the one batch applied


def test_a_stop_whose_last_snapshot_cannot_be_written_exits_non_zero(tmp_path: Path) -> None:
    """The snapshot written on stop failed (its directory removed meanwhile, a full disk): the process exited 0, so
    a supervisor took the stop for clean and the next start came up cold. It says why on stderr and exits 1."""
    snap = tmp_path / "gone" / "index.snap"
    snap.parent.mkdir()
    code, err = _sigterm_after_a_batch(snap, before_stop=lambda: shutil.rmtree(snap.parent))  # (its lock file too)
    assert code == 1, err
    assert err.splitlines()[-1].startswith(f"kvtier indexer: stopped without its last snapshot: snapshot to {snap} "
                                           "failed"), err


@pytest.mark.parametrize("where", ["start", "banner"])
def test_a_stop_signal_during_start_or_the_banner_still_stops_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str) -> None:
    """A supervisor may stop the process the moment it sees the banner, while ``print`` has not returned yet, or
    while the service is still starting. The signal is forced at each point here: serve returns as on any stop,
    no KeyboardInterrupt escapes, and a service that started writes its snapshot."""
    from kvtier.indexer.service import app

    started = app.IndexerService.start
    stopped: list[bool] = []

    def start(self: IndexerService) -> None:
        if where == "start":
            raise KeyboardInterrupt  # before anything started
        started(self)

    def stop(self: IndexerService) -> None:
        stopped.append(True)
        original_stop(self)

    original_stop = app.IndexerService.stop
    monkeypatch.setattr(app.IndexerService, "start", start)
    monkeypatch.setattr(app.IndexerService, "stop", stop)
    if where == "banner":
        def banner(*args: object, **kwargs: object) -> None:
            raise KeyboardInterrupt  # the signal lands inside print
        monkeypatch.setattr("builtins.print", banner)
    snap = tmp_path / "index.snap"
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
        cfg = ServiceConfig(endpoints=[parse_endpoint(f"w0={pub.endpoint},replay={pub.replay_endpoint}")],
                            block_size=BS, listen="127.0.0.1:0", snapshot_path=str(snap))
        app.serve(cfg)  # returns: no KeyboardInterrupt escapes
    assert stopped == [True]
    assert snap.exists() == (where == "banner")  # a service that never started has nothing to save


@pytest.mark.parametrize(("first", "second"), [(signal.SIGTERM, signal.SIGTERM), (signal.SIGTERM, signal.SIGHUP),
                                               (signal.SIGHUP, signal.SIGTERM)])
def test_a_second_sigterm_while_it_stops_does_not_cut_the_stop_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     first: int, second: int) -> None:
    """A supervisor may signal again while the service stops (``timeout`` signals the process and then its
    group, so it gets SIGTERM twice): that one is ignored, and the stop runs to its end, snapshot written, with no
    KeyboardInterrupt out of the stop and the caller's SIGTERM handler back after it. Both signals are real ones,
    sent to this process, the first once the service is up, the second from inside its stop. SIGHUP (the terminal
    closed) stops it as SIGTERM does: during a stop it cut the stop short, with no last snapshot."""
    from kvtier.indexer.service import app

    started, original_stop = app.IndexerService.start, app.IndexerService.stop
    stops: list[bool] = []

    def start(self: IndexerService) -> None:
        started(self)
        os.kill(os.getpid(), first)

    def stop(self: IndexerService) -> None:
        os.kill(os.getpid(), second)
        original_stop(self)
        stops.append(True)

    monkeypatch.setattr(app.IndexerService, "start", start)
    monkeypatch.setattr(app.IndexerService, "stop", stop)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    snap = tmp_path / "index.snap"
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
        cfg = ServiceConfig(endpoints=[parse_endpoint(f"w0={pub.endpoint},replay={pub.replay_endpoint}")],
                            block_size=BS, listen="127.0.0.1:0", snapshot_path=str(snap))
        app.serve(cfg)  # returns: no KeyboardInterrupt escapes
    assert stops == [True] and snap.exists()
    assert {sig: signal.getsignal(sig) for sig in before} == before  # the caller's handlers are back


def test_the_indexer_says_why_it_is_quiet_while_its_kernels_compile(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A first start after an install compiles the index's kernels (half a minute on 2 cores) before the service
    can print anything else: a notice says why it is quiet, and another when the kernels are ready. The loading is
    made to outlast the notice's delay here: it ends only once the notice is out."""
    from kvtier.indexer.service import app
    from kvtier.sim import cli

    said = threading.Event()
    monkeypatch.setattr(cli, "KERNEL_NOTICE_S", 0.0)
    monkeypatch.setattr(app, "load_kernels", lambda: said.wait(10))
    monkeypatch.setattr(app, "serve", lambda cfg, load, inputs: load())
    real_print = print

    def print_then_go(*args: Any, **kwargs: Any) -> None:
        real_print(*args, **kwargs)
        said.set()
    monkeypatch.setattr("builtins.print", print_then_go)
    assert cli_main(["indexer", "--endpoint", "w0=tcp://127.0.0.1:1"]) == 0
    err = capsys.readouterr().err
    assert "kvtier: loading the index's compiled kernels (the first start after an install compiles them" in err
    assert "kvtier: kernels ready after" in err


def test_a_stop_signal_while_the_kernels_load_stops_cleanly(tmp_path: Path) -> None:
    """A first start compiles the kernels for half a minute or more: a supervisor's SIGTERM then ends the process as
    at any other time (serve returns, exit 0), not by the signal's default (exit 143). The signal is real, sent
    to this process from inside the loading."""
    from kvtier.indexer.service import app

    loaded: list[bool] = []

    def load() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the handler interrupts this at once)
        loaded.append(True)

    cfg = ServiceConfig(endpoints=[parse_endpoint("w0=tcp://127.0.0.1:1")], block_size=BS, listen="127.0.0.1:0",
                        snapshot_path=str(tmp_path / "index.snap"))
    app.serve(cfg, load)  # returns: no KeyboardInterrupt escapes, and nothing was started to stop
    assert not loaded and not (tmp_path / "index.snap").exists()


def _indexer_process(pub: Publisher, snap: Path) -> tuple[subprocess.Popen[str], str]:
    """``kvtier indexer`` on one publisher with a snapshot file, and its HTTP address once it serves."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier", "indexer", "--endpoint", f"w0={pub.endpoint},replay={pub.replay_endpoint}",
         "--block-size", str(BS), "--listen", "127.0.0.1:0", "--snapshot", str(snap)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    address = re.search(r"HTTP on (http://\S+)", proc.stdout.readline())
    if not address:
        proc.kill()
        raise AssertionError(f"the service did not start: {proc.communicate(timeout=30)[1]}")
    return proc, address[1]


def test_the_service_restarts_from_a_snapshot_of_thousands_of_blocks(tmp_path: Path) -> None:
    """The default build restarts from its own snapshot: a worker's engine hashes are written back one by one into
    a compiled table that grows many times over, with no ``IndexError`` (which would make every restart of a
    service past 48 blocks a worker exit 1, and a supervisor crash-loop). The restarted service resumes the
    stream and answers every block."""
    snap, n = tmp_path / "index.snap", 3000
    toks = list(range(n * BS))
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
        for run in range(2):
            proc, address = _indexer_process(pub, snap)
            try:
                if run == 0:
                    pub.publish(EventBatch(ts=time.time(), events=[BlockStored(
                        block_hashes=[-(1 << 62) + 7919 * i for i in range(n)], parent_block_hash=None,
                        token_ids=toks, block_size=BS, medium="GPU")]))
                wait_for(lambda a=address: post(a + "/query", {"token_ids": toks})[1]["workers"]["w0"]["device"] == n,
                         timeout=30)
                assert json.loads(get(address + "/health"))["restored_from"] == (str(snap) if run else None)
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=30)
            finally:
                proc.kill() if proc.poll() is None else None
            assert proc.returncode == 0, err
    index, _ = persist.load(snap, BS)
    assert index.find_matches(toks).workers[StreamId(WorkerId("w0"))].device == n


def test_latency_histograms_say_where_a_slow_answer_waited(cluster: tuple[list[Publisher], IndexerService],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A query that finds the index lock held (as a long event batch would hold it) waits for it on the HTTP
    loop: the wait shows in the lock-wait histogram, in the request's own time and as loop lag. The lock is held
    ``hold_s`` from when the query asks for it (on a loaded machine the query may come late)."""
    (p0, _, _), svc = cluster
    p0.publish(EventBatch(ts=time.time(), events=[stored([1, 2, 3], None, 0)]))
    wait_for(lambda: overlaps(svc)["workers"]["w0"]["device"] == 3)
    before = json.loads(get(svc.address + "/metrics?format=json"))["latency"]
    hold_s = 0.3
    asking, timed_lock = threading.Event(), svc._timed_lock

    @contextlib.contextmanager
    def timed() -> Iterator[None]:
        asking.set()
        with timed_lock():
            yield

    monkeypatch.setattr(svc, "_timed_lock", timed)
    with svc._lock:
        answer: list[dict[str, Any]] = []
        t = threading.Thread(target=lambda: answer.append(overlaps(svc)))
        t.start()
        assert asking.wait(10.0)
        t0 = time.monotonic()
        time.sleep(hold_s)
    t.join(5)
    assert answer and time.monotonic() - t0 >= hold_s
    lat = json.loads(get(svc.address + "/metrics?format=json"))["latency"]
    assert lat["query_seconds"]["count"] > before["query_seconds"]["count"]
    assert lat["lock_wait_seconds"]["max"] >= hold_s * 0.8
    assert lat["query_seconds"]["max"] >= hold_s * 0.8
    assert lat["http_loop_lag_seconds"]["max"] >= hold_s * 0.5  # the loop could not run meanwhile
    assert lat["apply_hold_seconds"]["count"] >= 1 and lat["apply_wait_seconds"]["count"] >= 1  # the batch above
    assert lat["route_seconds"]["count"] == 0
    families = {f.name: f for f in text_string_to_metric_families(get(svc.address + "/metrics"))}
    for name in ("kvtier_request_seconds", "kvtier_lock_wait_seconds", "kvtier_apply_wait_seconds",
                 "kvtier_apply_hold_seconds", "kvtier_http_loop_lag_seconds"):
        assert families[name].type == "histogram" and families[name].documentation
    counts = {s.labels["endpoint"]: s.value for s in families["kvtier_request_seconds"].samples
              if s.name == "kvtier_request_seconds_count"}
    assert counts["route"] == 0 and counts["query"] >= lat["query_seconds"]["count"]


def test_request_bodies_parse_alike_from_bytes_and_objects() -> None:
    """A prompt reaches packed tokens straight from its JSON (kvtier.wire.tokenarray.decode_json_tokens); the
    other fields, the errors and their paths are what decoding the whole body with msgspec gave."""
    from kvtier.indexer.service.app import parse_body
    from kvtier.wire.protocol import pack_tokens

    body = {"token_ids": [5, 0, 2**32 - 1, 70000], "lora_name": "a", "mm_items": [{"identifier": "x", "offset": 1,
                                                                                     "length": 2}]}
    for given in (body, json.dumps(body).encode(), json.dumps(body, indent=2).encode()):
        req, tokens = parse_body(given)
        assert tokens == pack_tokens(body["token_ids"]) and req.lora_name == "a" and req.mm_items[0].length == 2
    for bad, says in (({"token_ids": "abc"}, "Expected `array`, got `str` - at `$.token_ids`"),
                      ({"token_ids": [1, "2"]}, "Expected `int`, got `str` - at `$.token_ids[1]`"),
                      ({"token_ids": [1, 2.5]}, "Expected `int`, got `float` - at `$.token_ids[1]`"),
                      ({"token_ids": [1, 2**32]}, "token id 4294967296 is not in [0, 2**32) - at `$.token_ids[1]`"),
                      ({"lora_name": "a"}, "missing required field `token_ids`"),
                      ({"token_ids": [1], "lora_name": 3}, "Expected `str | null`, got `int` - at `$.lora_name`")):
        for given in (bad, json.dumps(bad).encode()):
            with pytest.raises(ValueError, match=re.escape(says)):
                parse_body(given)
    with pytest.raises(ValueError, match=r"bad request body: .*object"):  # no JSON form at all
        parse_body({"token_ids": [object()]})


def test_a_body_that_is_not_utf8_says_so_and_where() -> None:
    """JSON is UTF-8: a string with another encoding's bytes is refused by a line naming the first bad byte and
    its place in the body (counted in the body's bytes, not within the string)."""
    from kvtier.indexer.service.app import parse_body
    from kvtier.indexer.service.requestbody import parse_finish

    for parse, body, at in ((parse_body, b'{"token_ids": [1, 2], "lora_name": "ok\xff"}', 38),
                            (parse_body, b'{"request_id": "r\xc3", "token_ids": [1]}', 17),
                            (parse_finish, b'{"\xff": 1}', 2)):
        with pytest.raises(ValueError, match=re.escape(f"body is not JSON: invalid UTF-8 at byte {at} (0x")):
            parse(body)


def test_a_lone_surrogate_escape_is_named_not_called_truncated() -> None:
    """A string escaping the first half of a UTF-16 surrogate pair (``\\ud800``) and ending before the second half
    is malformed JSON. Near the body's end msgspec calls that "Input data was truncated", of a body that is whole;
    the line names the escape and its byte instead. A truncated body is still called truncated."""
    from kvtier.indexer.service.app import parse_body
    from kvtier.indexer.service.requestbody import parse_finish

    for parse, body, at in ((parse_body, b'{"token_ids": [1], "lora_name": "a\\ud800"}', 34),
                            (parse_body, b'{"token_ids": [1], "lora_name": "\\ud83d\\ude00\\uDBFF"}', 45),
                            (parse_finish, b'{"\\ud800": 1}', 2)):
        says = f"body is not JSON: unpaired utf-16 surrogate escape (byte {at})"
        with pytest.raises(ValueError, match=re.escape(says)):
            parse(body)
    with pytest.raises(ValueError, match="body is not JSON: Input data was truncated"):
        parse_body(b'{"token_ids": [1], "lora_name": "a')
    req, _ = parse_body(b'{"token_ids": [1], "lora_name": "\\ud83d\\ude00"}')  # a whole pair is a character
    assert req.lora_name == "\U0001f600"
    req, _ = parse_body(b'{"token_ids": [1], "lora_name": "a\\\\ud800"}')  # an escaped backslash, then letters
    assert req.lora_name == "a\\ud800"


def test_engines_of_another_page_size_make_health_say_so(cluster: tuple[list[Publisher], IndexerService]) -> None:
    """An indexer started with --block-size unlike the engines' page size rejects every store and indexes nothing;
    /health must not say ok: it says degraded, which workers, and what to set."""
    (p0, _, _), svc = cluster
    p0.publish(EventBatch(ts=time.time(), events=[BlockStored(block_hashes=[1], parent_block_hash=None,
                                                              token_ids=TOKS[:4 * BS], block_size=4 * BS)]))
    wait_for(lambda: json.loads(get(svc.address + "/health")).get("wrong_block_size_workers") == ["w0"])
    health = json.loads(get(svc.address + "/health"))
    assert health["status"] == "degraded" and "set --block-size to the engines' page size" in health["block_size_error"]
    # Once that worker's stores have the index's block size again (its engine restarted with the right page size),
    # health says so: a rejection long past does not keep the service degraded.
    p0.publish(EventBatch(ts=time.time(), events=[BlockStored(block_hashes=[2], parent_block_hash=None,
                                                              token_ids=TOKS[:BS], block_size=BS)]))
    wait_for(lambda: "wrong_block_size_workers" not in json.loads(get(svc.address + "/health")))


def test_the_service_regains_hot_prefixes_an_sglang_engine_never_announces_again() -> None:
    """The endpoint says which engine publishes (engine=sglang|vllm|kvtier; a dump-capable one is kvtier's): the
    service declares what that engine keeps prefix-closed, so after a loss for good a new device store under the
    dropped hot prefix makes a probe answer its whole depth again on SGLang, and nothing is regained on vLLM."""
    eps = [parse_endpoint("s=tcp://127.0.0.1:1,replay=tcp://127.0.0.1:2,engine=sglang"),
           parse_endpoint("v=tcp://127.0.0.1:3,engine=vllm"),
           parse_endpoint("k=tcp://127.0.0.1:4,replay=tcp://127.0.0.1:5,dump"),
           parse_endpoint("u=tcp://127.0.0.1:6")]
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0"))
    streams = {n: StreamId(WorkerId(n)) for n in "svku"}
    assert svc.index.prefix_closed(streams["s"]) == {StorageTier.DEVICE}
    assert svc.index.prefix_closed(streams["k"]) == {StorageTier.DEVICE, StorageTier.HOST}
    assert svc.index.prefix_closed(streams["v"]) == svc.index.prefix_closed(streams["u"]) == set()
    hashes = [-(1 << 62) - i for i in range(1, 9)]
    for n in "sv":
        svc.index.apply(streams[n], BlockStored(block_hashes=hashes[:6], parent_block_hash=None,
                                                token_ids=TOKS[:6 * BS], block_size=BS, medium="GPU"))
        svc.index.clear_worker(streams[n], partial=True)  # a loss past the publisher's replay buffer
        svc.index.apply(streams[n], BlockStored(block_hashes=hashes[6:7], parent_block_hash=hashes[5],
                                                token_ids=TOKS[6 * BS:7 * BS], block_size=BS, medium="GPU"))
    workers = svc.query({"token_ids": TOKS})["workers"]
    assert workers["s"]["device"] == 7 and workers["s"]["partial"]
    assert workers["v"]["device"] == 0
    with pytest.raises(ConfigError, match="engine 'tgi'"):
        parse_endpoint("x=tcp://127.0.0.1:7,engine=tgi")
