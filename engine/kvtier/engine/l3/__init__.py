"""The engine's L3 store: KV pages in real files, local or shared by many engines.

* :mod:`~kvtier.engine.l3.storage` -- :class:`PageStore`: reserve, commit, read, evict pages; crash-safe writes;
* :mod:`~kvtier.engine.l3.pagetree` -- the store's pages as a tree, so the store stays prefix-closed (only leaves
  are evicted; no committed page outlives its parent);
* :mod:`~kvtier.engine.l3.pagedir` -- the directory of page files and its sync policy;
* :mod:`~kvtier.engine.l3.pagefile` -- one page file's header and layout, checked on read.

Imports only :mod:`kvtier.wire.protocol` and :mod:`kvtier.util`: a store may be opened without an engine.
"""
