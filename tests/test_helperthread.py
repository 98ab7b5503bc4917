"""A process's helper thread (kvtier.util.helperthread): runs in order, and starts anew in a forked child."""

from __future__ import annotations

import multiprocessing
import queue
import threading

from kvtier.util.helperthread import HelperThread

HELPER = HelperThread("kvtier-test")


def _thread_name() -> str:
    return threading.current_thread().name


def _in_child(out: multiprocessing.Queue[object]) -> None:
    out.put(HELPER.submit(_thread_name).result(timeout=30))


def test_tasks_run_in_order_on_one_named_thread() -> None:
    done: list[int] = []
    futures = [HELPER.submit(done.append, i) for i in range(50)]
    names = {HELPER.submit(_thread_name).result(timeout=30) for _ in range(3)}
    assert [f.result(timeout=30) for f in futures] == [None] * 50 and done == list(range(50))
    assert len(names) == 1 and names.pop().startswith("kvtier-test")


def test_a_forked_child_starts_its_own_thread() -> None:
    HELPER.submit(int).result(timeout=30)  # the parent's thread is running
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[object] = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(out,))
    child.start()
    try:
        assert str(out.get(timeout=60)).startswith("kvtier-test"), "the child's task ran elsewhere"
    except queue.Empty:
        raise AssertionError("a forked child's task waited for its parent's thread") from None
    finally:
        child.join(timeout=30)
