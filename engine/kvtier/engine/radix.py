"""Page-granular radix tree over token ids, with per-node tier residency.

A node holds a run of whole pages (``tokens``, packed as uint32 LE: ``page_size * 4`` bytes a
page) and the residency of those pages: device page ids, host page ids, and in-flight copies.
Children are keyed by their first page's packed tokens. ``match`` splits a node when a
query diverges inside it, so a node's pages always share one residency.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.engine.hashing import (
    DIGEST_BYTES,
    ROOT_DIGEST,
    PageDigests,
    chain,
    chain_hashes,
    event_hash,
    joined_hashes,
    page_digest,
)
from kvtier.engine.pool import PageId
from kvtier.wire.protocol import TOKEN_BYTES, PackedTokens, pack_tokens

_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Node:
    """A run of pages. Invariants are listed on :class:`RadixTree`."""

    parent: Node | None  # None only for the root
    tokens: PackedTokens  # page_size * pages token ids, packed (bytes compare and slice at C speed)
    digests: PageDigests  # SHA-256 chain digest per page
    hashes: list[int]  # event hash per page
    children: dict[bytes, Node] = field(default_factory=dict)  # by first page's packed tokens
    device: list[PageId] | None = None  # device pages (acknowledged), or None if not on device
    host: list[PageId] | None = None  # host pages (acknowledged backup), or None
    host_pending: list[PageId] | None = None  # host pages of an in-flight device->host copy
    loading: list[PageId] | None = None  # device pages of an in-flight host->device load
    evict_after_backup: bool = False  # write-back: free device pages once the backup lands
    want_backup: bool = False  # write-back: back up once the parent's copy lands
    swa: list[PageId] | None = None  # sliding-window KV pages (SWA models); None on device = tombstone
    host_swa: bool = False  # the host copy includes the sliding-window KV
    load_swa: bool = False  # a load-back in flight brings the window KV too (it ends a usable prefix)
    lock_ref: int = 0  # in-flight requests using this node or a descendant
    last_access: int = 0  # logical time of the last use (LRU)
    hits: int = 0  # prefix matches through this node (write_through_selective)
    node_id: int = field(default_factory=lambda: next(_ids))  # stable tie-break for LRU

    @property
    def pages(self) -> int:
        return len(self.hashes)

    def parent_hash(self) -> int | None:
        """Event hash of the page before this node's first page, None under the root."""
        p = self.parent
        return p.hashes[-1] if p is not None and p.hashes else None

    def parent_digest(self) -> bytes:
        p = self.parent
        return p.digests[-1] if p is not None and p.digests else ROOT_DIGEST

    def device_leaf(self) -> bool:
        return all(c.device is None and c.loading is None for c in self.children.values())

    @property
    def window_read(self) -> bool:
        """SWA: whether the copy a request reads these pages from has window KV (the device copy if there
        is one, else the host copy)."""
        return self.swa is not None if self.device is not None else self.host_swa


class RadixTree:
    """The tree; residency bookkeeping lives in :class:`engine.cache.TieredCache`.

    Invariants (asserted by :meth:`_check`):

    * every non-root node has >= 1 page and ``len(tokens) == pages * stride`` (bytes);
    * digests chain from the parent's last digest; hashes are their event hashes;
    * a child is keyed by its first page's tokens and points back at its parent;
    * device residency is prefix-closed: a node on device has its parent on device;
    * host residency is prefix-closed: a node with a host copy has a parent with one;
    * a node is on some tier (device, host, or a copy in flight), else it is removed.
    """

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.stride = page_size * TOKEN_BYTES  # bytes of packed tokens a page
        self.root = Node(None, b"", PageDigests(), [])
        self.clock = 0
        #: Called as on_split(front, back) after a split, so copies in flight cover both.
        self.on_split: Callable[[Node, Node], None] | None = None

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def page_key(self, tokens: PackedTokens, page: int) -> bytes:
        s = self.stride
        return tokens[page * s:(page + 1) * s]

    def match(self, tokens: Sequence[int] | PackedTokens) -> list[Node]:
        """Nodes covering the longest cached page prefix of ``tokens`` (ids, or packed), splitting
        the last one if the query diverges inside it. O(matched tokens)."""
        tokens = pack_tokens(tokens)
        now = self.tick()
        path = self.descend(self.root, tokens)
        for n in path:
            n.last_access = now
        return path

    def descend(self, node: Node, tokens: PackedTokens) -> list[Node]:
        """The nodes below ``node`` that hold ``tokens``' pages, as far as they are cached, parents first, the
        last one split where ``tokens`` diverge inside it: node ``i`` holds exactly the pages after those of the
        nodes before it. Touches no access time (:meth:`match` does). O(matched tokens)."""
        pages = len(tokens) // self.stride
        pos, path = 0, []
        while pos < pages:
            child = node.children.get(self.page_key(tokens, pos))
            if child is None:
                break
            k = self.common_pages(child, tokens, pos, pages)
            if k < child.pages:
                child = self.split(child, k)
            path.append(child)
            pos += k
            node = child
        return path

    def common_pages(self, child: Node, tokens: PackedTokens, pos: int, pages: int) -> int:
        """How many of ``child``'s pages equal ``tokens``' pages from page ``pos`` (of ``pages``).

        The caller found ``child`` by its first page, so the answer is at least 1. Compared in place (no slice
        is copied): the whole run in one memcmp, the common case; else a binary search for the first page
        that differs. O(k * page size).
        """
        s = self.stride
        m = min(child.pages, pages - pos)  # pages that could match
        if m <= 1:
            return 1
        start = pos * s
        mine = memoryview(child.tokens)
        if tokens.startswith(mine[:m * s], start):
            return m
        lo, hi = 1, m - 1  # the first lo pages match; the first hi + 1 do not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokens.startswith(mine[:mid * s], start):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def split(self, node: Node, k: int) -> Node:
        """Cuts ``node`` after ``k`` pages; returns the new front node (its parent now). O(pages)."""
        assert 0 < k < node.pages, f"split at {k} of a {node.pages}-page node"
        s = self.stride
        parent = node.parent
        assert parent is not None, "cannot split the root"

        def cut(pages: list[PageId] | None) -> tuple[list[PageId] | None, list[PageId] | None]:
            return (None, None) if pages is None else (pages[:k], pages[k:])

        front = Node(parent, node.tokens[:k * s], node.digests[:k], node.hashes[:k])
        front.device, node.device = cut(node.device)
        front.host, node.host = cut(node.host)
        front.host_pending, node.host_pending = cut(node.host_pending)
        front.loading, node.loading = cut(node.loading)
        front.swa, node.swa = cut(node.swa)
        front.host_swa, front.load_swa = node.host_swa, node.load_swa
        front.evict_after_backup = False  # only the evicted leaf frees its pages after backup
        front.want_backup = node.want_backup
        front.lock_ref, front.last_access, front.hits = node.lock_ref, node.last_access, node.hits
        node.tokens, node.digests, node.hashes = node.tokens[k * s:], node.digests[k:], node.hashes[k:]
        parent.children[front.tokens[:s]] = front
        front.children[node.tokens[:s]] = node
        node.parent = front
        if self.on_split is not None:
            self.on_split(front, node)
        return front

    def add_child(self, parent: Node, tokens: PackedTokens, digests: bytes = b"") -> Node:
        """A new node under ``parent`` for whole pages of ``tokens`` (no residency yet). ``digests``: their page
        digests joined, when the caller made them ahead (:attr:`Admission.digests`), else they are computed here;
        the first is checked against ``parent``'s chain, so digests cut at the wrong page raise. O(pages)."""
        s = self.stride
        assert tokens and len(tokens) % s == 0, f"{len(tokens)} bytes is not whole pages of {s}"
        key = tokens[:s]
        assert key not in parent.children, "a child with that first page exists"
        parent_digest = parent.digests[-1] if parent.digests else ROOT_DIGEST
        if digests:
            assert len(digests) == len(tokens) // s * DIGEST_BYTES, (
                f"{len(digests)} bytes of digests for {len(tokens) // s} pages")
            assert digests[:DIGEST_BYTES] == page_digest(parent_digest, key), (
                "the digests made ahead are not this page's under this parent: they went out of sync with the prompt")
            chained, hashes = joined_hashes(digests)
        else:
            chained, hashes = chain_hashes(parent_digest, tokens, self.page_size)
        node = Node(parent, tokens, chained, hashes)
        node.last_access = self.tick()
        parent.children[key] = node
        return node

    def remove(self, node: Node) -> None:
        """Unlinks a childless node."""
        assert not node.children, "removing a node that has children"
        assert node.parent is not None, "removing the root"
        del node.parent.children[node.tokens[:self.stride]]

    def nodes(self) -> list[Node]:
        """Every non-root node, parents before children. O(nodes)."""
        out: list[Node] = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def path_to_root(self, node: Node) -> list[Node]:
        """``node`` and its ancestors below the root, root-most first."""
        out = []
        n: Node | None = node
        while n is not None and n is not self.root:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def _check(self) -> None:
        ps, s = self.page_size, self.stride
        for n in self.nodes():
            p = n.parent
            assert p is not None, "non-root node without parent"
            assert n.pages >= 1 and len(n.tokens) == n.pages * s, f"node {n.node_id}: bad page count"
            assert len(n.digests) == n.pages, f"node {n.node_id}: digests out of sync"
            assert p.children.get(n.tokens[:s]) is n, f"node {n.node_id}: not keyed in its parent"
            assert n.digests == chain(n.parent_digest(), n.tokens, ps), f"node {n.node_id}: broken digest chain"
            assert n.hashes == [event_hash(d) for d in n.digests], f"node {n.node_id}: hashes out of sync"
            assert n.swa is None or n.device is not None, f"node {n.node_id}: window KV without device KV"
            assert not n.host_swa or n.host is not None or n.host_pending is not None, (
                f"node {n.node_id}: host window KV without a host copy")
            for name in ("device", "host", "host_pending", "loading", "swa"):
                pages = getattr(n, name)
                assert pages is None or len(pages) == n.pages, f"node {n.node_id}: {name} length"
            if n.device is not None and p is not self.root:
                assert p.device is not None, f"node {n.node_id} on device under a device-evicted parent"
            if n.host is not None and p is not self.root:
                assert p.host is not None, f"node {n.node_id} backed up under a parent without backup"
            assert (n.device is not None or n.host is not None or n.host_pending is not None
                    or n.loading is not None), f"node {n.node_id} is on no tier"
            assert n.lock_ref >= 0, f"node {n.node_id}: negative lock_ref"
