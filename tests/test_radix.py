"""The radix tree's page comparison: ``common_pages`` (one memcmp, else a binary search) against the page-by-page
definition."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.hashing import PageDigests
from kvtier.engine.radix import Node, RadixTree
from kvtier.wire import pack_tokens

PS = 4


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.data())
def test_common_pages_is_the_run_of_equal_pages(data: st.DataObject) -> None:
    tree = RadixTree(page_size=PS)
    s = tree.stride
    ids = st.integers(0, 1)  # two token ids: runs agree often and part at any page
    n = data.draw(st.integers(1, 12))
    child = Node(tree.root, pack_tokens(data.draw(st.lists(ids, min_size=n * PS, max_size=n * PS))),
                 PageDigests(bytes(32 * n)), [0] * n)
    pages = data.draw(st.integers(1, 14))
    pos = data.draw(st.integers(0, pages - 1))
    query = bytearray(pack_tokens(data.draw(st.lists(ids, min_size=pages * PS, max_size=pages * PS))))
    query[pos * s:(pos + 1) * s] = child.tokens[:s]  # the caller found the child by its first page
    k = 1
    while k < min(n, pages - pos) and child.tokens[k * s:(k + 1) * s] == query[(pos + k) * s:(pos + k + 1) * s]:
        k += 1
    assert tree.common_pages(child, bytes(query), pos, pages) == k
