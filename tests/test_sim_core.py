"""The discrete-event core: order, ties, cancellation, failures."""

from __future__ import annotations

import pytest

from kvtier.sim.core import Environment


def test_time_then_priority_then_scheduling_order() -> None:
    env = Environment()
    seen: list[str] = []
    env.at(2.0, lambda: seen.append("t2"))
    env.at(1.0, lambda: seen.append("t1-late"), priority=1)
    env.at(1.0, lambda: seen.append("t1-a"))
    env.at(1.0, lambda: seen.append("t1-b"))
    env.at(1.0, lambda: seen.append("t1-urgent"), priority=-1)
    env.run()
    assert seen == ["t1-urgent", "t1-a", "t1-b", "t1-late", "t2"]
    assert env.now == 2.0 and env.processed == 5


def test_callbacks_schedule_more_and_cancel() -> None:
    env = Environment()
    seen: list[float] = []
    t = env.at(5.0, lambda: seen.append(-1.0))

    def tick() -> None:
        seen.append(env.now)
        if env.now < 3:
            env.after(1.0, tick)
        else:
            t.cancel()

    env.at(0.0, tick)
    env.run()
    assert seen == [0.0, 1.0, 2.0, 3.0]


def test_run_until_stops_and_resumes() -> None:
    env = Environment()
    seen: list[int] = []
    for i in range(5):
        env.at(float(i), lambda i=i: seen.append(i))  # type: ignore[misc]
    env.run(until=2.5)
    assert seen == [0, 1, 2] and env.now == 2.5
    env.run()
    assert seen == [0, 1, 2, 3, 4]


def test_failures_propagate_and_past_is_refused() -> None:
    env = Environment()

    def boom() -> None:
        raise RuntimeError("worker exploded")

    env.at(1.0, boom)
    with pytest.raises(RuntimeError, match="exploded"):
        env.run()
    with pytest.raises(ValueError, match="before now"):
        env.at(0.5, lambda: None)
    with pytest.raises(ValueError, match="negative"):
        env.after(-1, lambda: None)


def test_a_reserved_sequence_number_runs_where_it_would_have_up_front() -> None:
    env = Environment(reserved=2)
    seen: list[str] = []
    env.at(1.0, lambda: seen.append("ordinary"))  # scheduled first, but after every reserved number

    def first() -> None:
        seen.append("reserved 0")
        env.at(1.0, lambda: seen.append("reserved 1"), seq=1)  # scheduled late, at its reserved place

    env.at(1.0, first, seq=0)
    env.run()
    assert seen == ["reserved 0", "reserved 1", "ordinary"]
    with pytest.raises(ValueError, match="not a reserved sequence number"):
        env.at(2.0, lambda: None, seq=2)


def test_first_turns_arrive_by_time_whatever_their_order_in_the_trace() -> None:
    from kvtier.sim.cluster import ClusterConfig
    from kvtier.sim.run import RunConfig, simulate
    from kvtier.sim.trace import Request

    trace = [Request("late", 2.0, 600, 4, [1, 2]), Request("early", 1.0, 600, 4, [1, 3]),
             Request("tie", 2.0, 600, 4, [1, 4])]
    res = simulate(trace, ClusterConfig.of(workers=2, page_size=64, device_tokens=8192), RunConfig("kv_all"))
    assert [r.request_id for r in res.records] == ["early", "late", "tie"]  # by time, then trace order
    assert [r.arrival for r in res.records] == [1.0, 2.0, 2.0]
