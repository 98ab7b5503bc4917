"""L3 file store benchmark: what each ``--l3-sync`` policy costs, and what checking every read costs.

Writes ``--pages`` pages of ``--page-kib`` KiB through :class:`PageStore` in copy batches of
``--batch`` pages (as the engine's write-behind does), once per sync policy, into a fresh
directory under ``--dir`` (default: the system's temporary folder; point it at the disk you mean
to use, since tmpfs makes fsync free). Then reads every page back verified (xxh3 over header and
payload) and, for scale, reads the same files raw. Printed: pages/s and MB/s per policy, and
the verified against the raw read rate. Each figure is the median of ``--repeat`` runs.

    python bench/l3_bench.py [--pages 2000] [--page-kib 256] [--batch 16] [--dir PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchargs import count, directory

from kvtier.engine.hashing import ROOT_DIGEST, event_hash, page_digest
from kvtier.engine.l3.pagedir import SyncPolicy
from kvtier.engine.l3.pagefile import Layout
from kvtier.engine.l3.pagetree import PageMeta
from kvtier.engine.l3.storage import PageStore
from kvtier.hardware.links import DEFAULT_STORAGE_LINK, STORAGE_LINKS
from kvtier.wire import pack_tokens


def page_chain(pages: int) -> list[tuple[str, PageMeta]]:
    """A chain of ``pages`` pages of 16 tokens each: their keys (digests, as an engine's) and metadata."""
    out: list[tuple[str, PageMeta]] = []
    parent = ROOT_DIGEST
    for i in range(pages):
        tokens = pack_tokens([i] * 16)
        digest = page_digest(parent, tokens)
        out.append((digest.hex(), PageMeta(event_hash(digest), parent.hex() or None,
                                           event_hash(parent) if parent else None, tokens, i)))
        parent = digest
    return out


def write_run(root: Path, sync: SyncPolicy, pages: int, payload: bytes, batch: int) -> tuple[float, PageStore]:
    store = PageStore(pages + 1, root, layout=Layout("bench", 16), owner="bench", sync=sync)
    store.attach("bench", lambda keys: None)
    chain = page_chain(pages)
    t0 = time.perf_counter()
    for lo in range(0, pages, batch):
        keys = [key for key, _ in chain[lo:lo + batch]]
        for key, meta in chain[lo:lo + batch]:
            if not store.begin_write(key, meta):
                raise RuntimeError(f"page {key}: no room, though the store holds the whole chain")
        store.write_pages([(k, payload) for k in keys])
        for k in keys:
            if not store.commit(k, "bench"):
                raise RuntimeError(f"page {k}: not committed")
    return time.perf_counter() - t0, store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=count(), default=2000)
    ap.add_argument("--page-kib", type=count(), default=256, help="KV bytes per page, KiB")
    ap.add_argument("--batch", type=count(), default=16, help="pages per copy op")
    ap.add_argument("--repeat", type=count(), default=3)
    ap.add_argument("--dir", type=directory, default=None, help="where to write (default: a temporary folder)")
    a = ap.parse_args()
    payload = os.urandom(a.page_kib * 1024)
    mb = a.pages * len(payload) / 1e6
    print(f"L3 store: {a.pages} pages x {a.page_kib} KiB ({mb:.0f} MB) in batches of {a.batch}, "
          f"median of {a.repeat}")
    store: PageStore | None = None
    for sync in SyncPolicy:
        times = []
        for _ in range(a.repeat):
            root = Path(tempfile.mkdtemp(prefix="kvtier-l3-", dir=a.dir))
            try:
                dt, store = write_run(root, sync, a.pages, payload, a.batch)
                times.append(dt)
                if sync is SyncPolicy.NONE and len(times) == a.repeat:
                    keys = [key for key, _ in page_chain(a.pages)]
                    t0 = time.perf_counter()
                    for k in keys:
                        store.read_page(k)
                    verified = time.perf_counter() - t0
                    assert store.pages_path is not None
                    t0 = time.perf_counter()
                    for k in keys:
                        (store.pages_path / k).read_bytes()
                    raw = time.perf_counter() - t0
            finally:
                if store is not None:
                    store.close()
                shutil.rmtree(root, ignore_errors=True)
        t = statistics.median(times)
        print(f"  write --l3-sync {sync.value:<5}  {a.pages / t:9.0f} pages/s  {mb / t:8.0f} MB/s")
    print(f"  read verified         {a.pages / verified:9.0f} pages/s  {mb / verified:8.0f} MB/s "
          f"(raw read of the same files {mb / raw:.0f} MB/s: checking costs {verified / raw:.2f}x)")
    print(f"  target: none (no peer store to compare with; the simulator's default storage link, "
          f"{DEFAULT_STORAGE_LINK}, is {STORAGE_LINKS[DEFAULT_STORAGE_LINK].gbps:g} GB/s)")


if __name__ == "__main__":
    main()
