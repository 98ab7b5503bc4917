"""The tiered index: which worker holds which block key on which tier, in compiled tables.

=====================  ==============================================================================
module                 holds
=====================  ==============================================================================
``tiered``             :class:`TieredIndex`: workers, events in, overlap queries out, snapshots
``snapshot``           the snapshot format: each worker's blocks and the links as arrays (reads version 1 too)
``keys``               router block keys from token ids (SPEC section 2)
``masklayout``         a block's holders packed in one int: four bits (device, host, disk, pool) per slot
``keytable``           the compiled tables seen from Python: key -> mask, engine hash -> key
``tablekernel``        the tables' numba kernels: store, remove, clear, search, levels
``blockmasks``         what an event changes in the masks: one kernel call per event, rare cases block by block
``closure``            prefix-closure: loose blocks per (worker, tier) and the links (in the table) that find them
``levels``             a query's per-worker tier depths, read off the masks
``applier``            validating and applying one worker's events (parents, orphans, window KV)
``workerstate``        per-worker stream state; ``slots``: which mask slot each worker owns
``orphans``            stores whose parent is not known yet, held until it is
``windowkv``           window KV of sliding-window models
``relearn``            regaining a partial worker's prefixes after a loss for good
``keyrefs``            reference counts of routed prompts' keys (the router's in-flight bookkeeping)
``consumer``           what each subscriber delivery does to the index
=====================  ==============================================================================

Complexity (n blocks in a query or event, r runs of equal masks along a query, w workers holding its prefix):

=====================================  =====================================================================
operation                              cost
=====================================  =====================================================================
store / remove event                   O(n) in one kernel call (+ O(children) for loose tiers)
overlap query, every tier prefix-closed  O(r log n) table lookups, then O(r * words + w)
overlap query, some tier loose         O(n) lookups in one kernel call
drop a worker                          O(blocks of that worker)
snapshot: copy / encode                O(entries) in a few kernel calls / O(entries log entries) (sorted)
restore                                O(entries) in a few kernel calls
=====================================  =====================================================================

Invariants: a key present in the table has a non-zero mask; every block held on a tier without its parent there is
among that worker's loose blocks (so a binary search over a closed index is sound); each worker's engine-hash
table is injective. Imports :mod:`kvtier.wire`, :mod:`kvtier.kernels` and :mod:`kvtier.util` only: never aiohttp,
torch, routing or the service.
"""
