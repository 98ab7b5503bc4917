"""Read-only views of an engine's cache: what an index holding every event would answer, and the state a resync
sends. Each reads the tree and the L3 link and changes nothing (no split, no LRU touch)."""

from __future__ import annotations

from kvtier.engine.dump import NodeRun, Snapshot
from kvtier.engine.events import EventLog
from kvtier.engine.l3link import L3Link
from kvtier.engine.radix import RadixTree
from kvtier.wire.codec import medium_spelling
from kvtier.wire.overlap import TierOverlap, window_cut
from kvtier.wire.protocol import PackedTokens, StorageTier


def peek(tree: RadixTree, l3: L3Link | None, tokens: PackedTokens, ok: list[bool] | None = None) -> TierOverlap:
    """Cumulative tier overlap of ``tokens`` in pages, with the index's semantics (a page in flight towards host
    is on no tier yet). Fills ``ok`` (if given) with, per page on device or host, whether its window KV is there
    too. O(prompt)."""
    s = tree.stride
    pages = len(tokens) // s
    node, pos = tree.root, 0
    last_digest = b""  # digest of the last matched page: the L3 chain continues from it
    device = -1
    while pos < pages:
        child = node.children.get(tree.page_key(tokens, pos))
        if child is None:
            break
        k = tree.common_pages(child, tokens, pos, pages)
        if child.device is None and device < 0:
            device = pos
        if child.device is None and child.host is None:
            break  # only in flight towards host: not announced on any tier yet
        if ok is not None:
            ok.extend([child.window_read] * k)
        pos += k
        node = child
        last_digest = child.digests[k - 1]
        if k < child.pages:
            break
    host = pos
    device = host if device < 0 else device
    disk = ext = host
    if l3 is not None and host < pages:
        run = l3.announced_run(last_digest, tokens[host * s:pages * s])
        if l3.store.shared:
            ext = host + run
        else:
            disk = ext = host + run
    return TierOverlap(device, host, disk, ext)


def usable(tree: RadixTree, l3: L3Link | None, window_pages: int, tokens: PackedTokens) -> TierOverlap:
    """:func:`peek` cut, per tier, to the prefix the engine can reuse: with SWA (``window_pages``), one whose last
    ``window_pages`` pages have window KV where each page is found (device pages on device, host pages on host;
    L3 pages always carry it). O(prompt)."""
    ok: list[bool] = []
    raw = peek(tree, l3, tokens, ok)
    if not window_pages:
        return raw
    ok.extend([True] * (raw.external - len(ok)))
    return TierOverlap(*(window_cut(ok, level, window_pages) for level in (raw.device, raw.host, raw.disk,
                                                                          raw.external)))


def residency(tree: RadixTree, l3: L3Link | None) -> dict[StorageTier, set[int]]:
    """Per tier, the event hashes of the pages the engine holds and has announced. O(pages)."""
    out: dict[StorageTier, set[int]] = {t: set() for t in StorageTier}
    for n in tree.nodes():
        if n.device is not None:
            out[StorageTier.DEVICE].update(n.hashes)
        if n.host is not None:
            out[StorageTier.HOST].update(n.hashes)
    if l3 is not None:
        out[l3.tier].update(l3.announced.values())
    return out


def window_residency(tree: RadixTree) -> dict[StorageTier, set[int]]:
    """Per tier (device, host), the event hashes of the pages whose window KV the engine holds there. O(pages)."""
    out: dict[StorageTier, set[int]] = {StorageTier.DEVICE: set(), StorageTier.HOST: set()}
    for n in tree.nodes():
        if n.swa is not None:
            out[StorageTier.DEVICE].update(n.hashes)
        if n.host is not None and n.host_swa:
            out[StorageTier.HOST].update(n.hashes)
    return out


def snapshot(tree: RadixTree, events: EventLog, l3: L3Link | None) -> Snapshot:
    """What a state dump sends, by reference (see :mod:`kvtier.engine.dump`). O(nodes + L3 pages)."""
    runs: list[NodeRun] = []
    windows: list[NodeRun] = []  # window KV: after every full-attention run, which they refer to
    dev, host = medium_spelling(StorageTier.DEVICE), medium_spelling(StorageTier.HOST)
    for n in tree.nodes():
        if n.device is not None:
            runs.append(NodeRun(n.hashes, n.parent_hash(), n.tokens, dev))
            if n.swa is not None and events.window_pages:
                windows.append(NodeRun(n.hashes, n.parent_hash(), n.tokens, dev))
        if n.host is not None:
            runs.append(NodeRun(n.hashes, n.parent_hash(), n.tokens, host))
            if n.host_swa and events.window_pages:
                windows.append(NodeRun(n.hashes, n.parent_hash(), n.tokens, host))
    window_tokens = events.window_tokens if windows else 0
    if l3 is None:
        return Snapshot(tree.page_size, runs, [], "", windows, window_tokens)
    return Snapshot(tree.page_size, runs, l3.announced_pages(), medium_spelling(l3.tier), windows, window_tokens)
