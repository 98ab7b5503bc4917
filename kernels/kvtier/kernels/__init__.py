"""Compiled kernels and their loader: the numba leaf kernels kvtier's hot paths call, behind one loader.

* :mod:`~kvtier.kernels.jit` -- :class:`LazyKernels`, the one way any package loads a kernel module: compiled on
  first use, cached on disk, or ``None`` where numba is absent or ``KVTIER_JIT=0`` (callers then take their
  short pure-Python fallback, checked against its library in the tests);
* :mod:`~kvtier.kernels.kernelcache` -- where compiled kernels are cached, and when a cache is stale;
* :mod:`~kvtier.kernels.unaligned` -- unaligned little-endian loads and stores the kernels share;
* :mod:`~kvtier.kernels.tokenkernel` -- token-array packing (:mod:`kvtier.wire.tokenarray`);
* :mod:`~kvtier.kernels.keykernel` -- the router's block-key chain (:mod:`kvtier.indexer.index.keys`);
* :mod:`~kvtier.kernels.shakernel` -- SHA-256 page digests (:mod:`kvtier.engine.hashing`);
* :mod:`~kvtier.kernels.bankkernel`, :mod:`~kvtier.kernels.aheadkernel` -- a trace's token bank and its keys and
  digests computed ahead of the replay (:mod:`kvtier.sim.lookahead`);
* :mod:`~kvtier.kernels.pagecopy` -- the GPU kernel moving scattered KV pages between device and pinned host pools
  (:class:`kvtier.engine.datapath.TorchDataPath`); Triton, not numba, built on first use.

Each kernel module imports numpy, numba (or Triton) and its siblings here only: this package imports nothing else
of kvtier.
The index's own compiled half (:mod:`kvtier.indexer.index.tablekernel`) lives with the tables whose layout it
shares.
"""
