"""Routing-policy plugins: one protocol (filter, score, pick) for the simulator and the service.

A plugin is any object with a ``name`` and the three methods of :class:`RoutingPolicy`. The router
hands it a :class:`RouteContext` per request: the index's overlaps per worker and tier, the
router's in-flight load bookkeeping, which workers are partial (events lost for good), the prompt's
keys. ``filter`` narrows the candidates, ``score`` costs each (lower is better), ``pick`` chooses.
:class:`PolicyBase` keeps every worker and picks the lowest score, so most plugins write ``score``
only; one that learns from its own routing history also has ``routed`` (:func:`note_routed`), and one that draws
at random keeps its ``random.Random`` as ``rng``, whose draws a query takes back
(:meth:`~kvtier.indexer.routing.router.Router.peek_keys`). The same object
serves ``kvtier replay/compare --policy SPEC`` and ``kvtier indexer --policy
SPEC``, where SPEC is ``package.module:attr``, ``path/to/file.py:attr``, or the name of an entry
point in the group ``kvtier.policies``; ``attr`` is a policy object, or a class or factory called
with no arguments. See ``examples/fresh_first_policy.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol, TypeVar, cast, runtime_checkable

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.routing.load import LoadView, WorkerLoad
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import OverlapScores, TierOverlap

ENTRY_POINT_GROUP = "kvtier.policies"
_NONE = TierOverlap(0, 0, 0, 0)


@dataclass(slots=True, frozen=True)
class RouteContext:
    """What a policy may look at for one request."""

    num_tokens: int  # prompt length
    block_size: int  # tokens per block
    keys: Sequence[BlockKey]  # the prompt's block keys, from the root
    overlaps: OverlapScores  # per worker, leading blocks held per tier (cumulative levels)
    loads: LoadView  # in-flight requests per worker, as the router booked them
    partial: frozenset[StreamId]  # workers whose index lost events for good (what they show is a lower bound)
    guarded: bool = True  # a user's plugin: :meth:`load` hands it copies (kvtier's own policies read the loads as is)

    def overlap(self, worker: StreamId) -> TierOverlap:
        """The worker's overlaps (zero if the index does not know it). O(1)."""
        return self.overlaps.workers.get(worker, _NONE)

    def load(self, worker: StreamId) -> WorkerLoad:
        """The worker's in-flight load: for a user's plugin a copy, so that one that adjusts it changes no booking.
        O(1)."""
        load = self.loads.load(worker)
        return dataclasses.replace(load) if self.guarded else load


@runtime_checkable
class RoutingPolicy(Protocol):
    """A routing policy: filter the candidates, score each (lower is better), pick one."""

    name: str

    def filter(self, ctx: RouteContext, workers: list[StreamId]) -> list[StreamId]:
        """The workers worth scoring (a non-empty subset of ``workers``)."""
        ...

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        """The cost of sending the request to ``worker``; lower is better."""
        ...

    def pick(self, ctx: RouteContext, scores: dict[StreamId, float]) -> StreamId:
        """The chosen worker, one of ``scores``' keys."""
        ...


class PolicyBase:
    """Keeps every worker and picks the lowest score (the first listed among equals); subclasses
    write :meth:`score`."""

    name = "plugin"

    def filter(self, ctx: RouteContext, workers: list[StreamId]) -> list[StreamId]:
        return workers

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        raise NotImplementedError(f"{type(self).__name__} must define score()")

    def pick(self, ctx: RouteContext, scores: dict[StreamId, float]) -> StreamId:
        return min(scores, key=lambda w: scores[w])


def is_plugin_spec(spec: str) -> bool:
    """True if ``spec`` names a plugin (``module:attr`` or an installed entry point), not a built-in."""
    return ":" in spec or any(ep.name == spec for ep in entry_points(group=ENTRY_POINT_GROUP))


class PluginError(LookupError):
    """A plugin failed while routing: one of its methods raised, its filter kept no worker (or one it was not
    offered), it scored a worker with something other than a number, or it picked a worker it did not score. The
    plugin's fault, not the request's: named in one line (the CLI exits 2, the service answers 500)."""


#: What a plugin's code may raise that is its failure, named in one line: any error, and SystemExit (a plugin that
#: calls sys.exit must not end a run silently, or leave the service's event loop without an answer). Off the main
#: thread (the service's HTTP thread) anything at all: no signal's KeyboardInterrupt lands there, and one the plugin
#: raised, or an asyncio.CancelledError (no await runs inside a plugin's call), killed that thread or dropped the
#: connection unanswered.
_FAULTS = (Exception, SystemExit)

_P = TypeVar("_P", bound=type)
#: kvtier's own policy classes (:func:`own_policy`), exactly: a user's subclass of one is a user's plugin.
_OWN: set[type] = set()


def own_policy(cls: _P) -> _P:
    """Marks ``cls`` (a class decorator) as one of kvtier's own policies: its exceptions are bugs to surface with
    their traceback, not a plugin's failure to name in one line (:func:`_faults`)."""
    _OWN.add(cls)
    return cls


def is_own(policy: object) -> bool:
    """Whether ``policy`` is one of kvtier's own (:func:`own_policy`), not a user's plugin (whatever its module is
    named: the ``kvtier`` namespace is open to other packages). O(1)."""
    return type(policy) in _OWN


def _faults(policy: object) -> tuple[type[BaseException], ...]:
    """What to take as ``policy``'s failure: everything for a user's plugin (a Ctrl-C on the main thread excepted,
    see :data:`_FAULTS`); nothing for kvtier's own policies (:func:`is_own`)."""
    if is_own(policy):
        return ()
    return _FAULTS if threading.current_thread() is threading.main_thread() else (BaseException,)


def _label(policy: object) -> str:
    """``policy``'s name as errors quote it; its class's where reading the name raises (a property may). O(1)."""
    faults = _faults(policy) or _FAULTS  # (kvtier's own have a plain name)
    try:
        return repr(policy.name)  # type: ignore[attr-defined]
    except faults:  # (whatever its code raises: the error being reported is another)
        return f"{type(policy).__name__} (its name raised)"


#: Characters of a plugin's message or value quoted in an error, so that the error stays one short line.
_QUOTED = 300


def _brief(text: str) -> str:
    """``text`` on one line, cut to :data:`_QUOTED` characters."""
    text = " ".join(text.split())
    return text if len(text) <= _QUOTED else f"{text[:_QUOTED]}... ({len(text):,} characters)"


def _failed(exc: BaseException, policy: object = None) -> str:
    """What a plugin's own code raised, in one short line: its type and message, and where it raised
    (:func:`_where`)."""
    return _brief(f"{type(exc).__name__}: {exc}") + _where(exc, policy)


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Where code that is no plugin's lives besides kvtier: the standard library and installed packages (absolute
    directories, each ending in a separator). Once per process."""
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(str(Path(d).resolve()) + os.sep for d in dirs if d and os.path.isabs(d))


def _where(exc: BaseException, policy: object = None) -> str:
    """`` (file.py, line N, in function)``: the line of the plugin's code ``exc`` came from, which the one-line error
    would otherwise lose: the innermost frame in the file of ``policy``'s class (a library it called may have raised
    beneath it), else the innermost one outside kvtier's modules, the standard library and installed packages (an
    error at import); empty if there is none, for a ``SyntaxError`` (its message names its line), or if the frames
    cannot be read: the location only adds to the message. O(frames + modules)."""
    if isinstance(exc, SyntaxError):
        return ""
    try:
        frames = traceback.extract_tb(exc.__traceback__)
        home = getattr(sys.modules.get(type(policy).__module__), "__file__", None) if policy is not None else None
        mine = [f for f in frames if home is not None and f.filename == home]
        if not mine:
            ours = {getattr(m, "__file__", None) for name, m in list(sys.modules.items())
                    if name.partition(".")[0] == "kvtier"}
            libraries = _library_dirs()
            mine = [f for f in frames if not f.filename.startswith("<") and f.filename not in ours
                    and not str(Path(f.filename).resolve()).startswith(libraries)]
        if not mine:
            return ""
        f = mine[-1]
        return f" ({Path(f.filename).name}, line {f.lineno}, in {f.name})"
    except Exception:  # (a frame's file gone, the working directory deleted: the message stands without it)
        return ""


def unloadable(spec: str) -> str | None:
    """What keeps ``spec`` from naming a plugin, found without running any of its code (a file that is not there, a
    name that is neither module:attr nor an entry point's), else None: :func:`load_policy` may still fail. O(entry
    points)."""
    if ":" in spec:
        mod_name = spec.rpartition(":")[0]
        return f"policy {spec!r}: no such file {mod_name}" if mod_name.endswith(".py") and \
            not Path(mod_name).is_file() else None
    if not is_plugin_spec(spec):  # (no ':' here: no entry point has that name)
        return f"policy {spec!r}: not module:attr, and no {ENTRY_POINT_GROUP!r} entry point has that name"
    return None


def load_policy(spec: str) -> RoutingPolicy:
    """The policy ``spec`` names (see the module docstring). ``ValueError`` naming what went wrong, whatever the
    plugin's code raised while it loaded (a syntax error, an exception at import or in its constructor), or what it
    lacks."""
    if (problem := unloadable(spec)) is not None:
        raise ValueError(problem)
    target: object
    if ":" in spec:
        mod_name, _, attr = spec.rpartition(":")
        file = None
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            file = importlib.util.spec_from_file_location(f"kvtier_plugin_{path.stem}", path)
            if file is None or file.loader is None or not path.is_file():
                raise ValueError(f"policy {spec!r}: no such file {mod_name}")
        try:
            if file is not None and file.loader is not None:
                module = importlib.util.module_from_spec(file)
                file.loader.exec_module(module)
            else:
                module = importlib.import_module(mod_name)
            target = getattr(module, attr)
        except _FAULTS as exc:  # no such module or attribute, or the plugin's own module failed to run
            raise ValueError(f"policy {spec!r}: {_failed(exc)}") from None
    else:
        eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        try:
            target = eps[0].load()
        except _FAULTS as exc:
            raise ValueError(f"policy {spec!r}: entry point failed to load: {_failed(exc)}") from None
    # A class (which itself has the methods, unbound) or a factory is called; an instance is used as is.
    policy = target
    if isinstance(target, type) or (callable(target) and not isinstance(target, RoutingPolicy)):
        try:
            policy = target()
        except _FAULTS as exc:
            raise ValueError(f"policy {spec!r}: {getattr(target, '__name__', 'it')}() failed: {_failed(exc)}") from None
    try:
        protocol = isinstance(policy, RoutingPolicy)  # (reads each attribute: a property may raise)
    except _FAULTS as exc:
        raise ValueError(f"policy {spec!r}: reading its attributes raised {_failed(exc)}") from None
    if not protocol:
        raise ValueError(f"policy {spec!r}: {type(policy).__name__} lacks name, filter, score or pick")
    plugin = cast(RoutingPolicy, policy)
    if getattr(type(plugin), "score", None) is PolicyBase.score:  # (PolicyBase's own raises at the first request)
        raise ValueError(f"policy {spec!r}: {type(plugin).__name__} defines no score()")
    try:
        name = plugin.name
    except _FAULTS as exc:
        raise ValueError(f"policy {spec!r}: reading its name raised {_failed(exc)}") from None
    # Tables, plots and files are labelled by it: one printable line.
    if not isinstance(name, str) or not name or not name.isprintable():
        raise ValueError(f"policy {spec!r}: its name must be a non-empty printable string, got {_brief(repr(name))}")
    return plugin


def _subset(got: object, of: Collection[StreamId], faults: tuple[type[BaseException], ...]) -> bool:
    """Whether a plugin's ``got`` is a non-empty collection of members of ``of`` (False for anything else, an
    unhashable item included, or one whose code raises ``faults``)."""
    if not isinstance(got, Collection):  # (a generator: the check would use it up)
        return False
    try:
        return bool(got) and set(got) <= set(of)
    except faults:  # (an item's __hash__ or __eq__, or the collection's own __len__, is the plugin's code too)
        return False


def route_with(
    policy: RoutingPolicy, ctx: RouteContext, workers: list[StreamId]
) -> tuple[StreamId, dict[StreamId, float]]:
    """Runs a policy's three steps, checking what each returns. :class:`PluginError` for whatever a step raises
    (a ``ValueError`` in a plugin's score is its bug, not a bad request) or returns out of protocol. The worker
    returned is the one scored (a plugin may pick an equal tuple). O(workers) plugin calls."""
    faults = _faults(policy)
    try:
        kept = policy.filter(ctx, workers)
    except faults as exc:
        raise PluginError(f"policy {_label(policy)}: filter() raised {_failed(exc, policy)}") from exc
    if not _subset(kept, workers, faults):
        raise PluginError(f"policy {_label(policy)}: filter kept {_brief(repr(kept))}, expected a non-empty subset "
                          "of the workers")
    try:
        scores = {w: float(policy.score(ctx, w)) for w in kept}
    except faults as exc:  # its own error, or a score float() does not take
        raise PluginError(f"policy {_label(policy)}: score() raised {_failed(exc, policy)}") from exc
    nan = [w for w, v in scores.items() if math.isnan(v)]  # (min() over a NaN depends on the workers' order)
    if nan:
        raise PluginError(f"policy {_label(policy)}: score() returned NaN for {_brief(', '.join(map(str, nan)))}")
    try:
        chosen = policy.pick(ctx, scores)
    except faults as exc:
        raise PluginError(f"policy {_label(policy)}: pick() raised {_failed(exc, policy)}") from exc
    if not _subset([chosen], scores, faults):
        raise PluginError(f"policy {_label(policy)}: picked {_brief(repr(chosen))}, not a scored worker")
    if type(chosen) is not StreamId:  # (an equal tuple, say: the scored worker is named, never the plugin's object)
        chosen = next(w for w in scores if w == chosen)
    return chosen, scores


@own_policy
class RoundRobinPolicy(PolicyBase):
    """Every worker in turn, ignoring caches and load (the baseline with no router state). The turn moves when a
    request is booked (:meth:`routed`), so a query, which books nothing, takes none."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        return 0.0

    def pick(self, ctx: RouteContext, scores: dict[StreamId, float]) -> StreamId:
        workers = sorted(scores)
        return workers[self._turn % len(workers)]

    def routed(self, keys: Sequence[BlockKey], num_tokens: int, worker: StreamId) -> None:
        self._turn += 1


@own_policy
class LeastLoadedPolicy(PolicyBase):
    """The worker with the fewest running requests, then the fewest active blocks (no cache awareness)."""

    name = "least_loaded"

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        load = ctx.load(worker)
        return load.running * 1e9 + load.active_blocks


def note_routed(policy: RoutingPolicy | None, keys: Sequence[BlockKey], num_tokens: int, worker: StreamId) -> None:
    """Tells ``policy`` that a request it routed was booked on ``worker``, if it has a ``routed(keys, num_tokens,
    worker)`` method: a policy that learns from its own routing history (what it sent where) learns it there, not in
    ``pick``, so that a query which books nothing (``POST /query``) teaches it nothing. :class:`PluginError` for
    whatever the hook raises: callers call it before they book anything, so that a failing hook books nothing."""
    hook = getattr(policy, "routed", None)
    if hook is not None:
        try:
            hook(keys, num_tokens, worker)
        except _faults(policy) as exc:
            raise PluginError(f"policy {_label(policy)}: routed() raised {_failed(exc, policy)}") from exc


#: kvtier's cache-blind policies as plugins, so the service runs them by name too.
BUILTIN = {"round_robin": RoundRobinPolicy, "least_loaded": LeastLoadedPolicy}
