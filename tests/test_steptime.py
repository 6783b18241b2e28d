"""Step-time accounting on synthetic timelines with answers computed by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointing.errors import CheckpointConfigError
from checkpointing.observe.steptime import StepClock


class Timeline:
    """Drive a StepClock with explicit times: steps back to back from t = 100 s."""

    def __init__(self, clock: StepClock) -> None:
        self.clock, self.t, self.step = clock, 100.0, 0

    def steps(self, *durations: float) -> None:
        for d in durations:
            self.clock.begin_step(self.step, self.t)
            self.t += d
            self.clock.end_step(self.step, self.t)
            self.step += 1

    def step_with_save(self, work: float, stall: float, save_step: int | None = None) -> None:
        """A step of `work` seconds, then save() blocking for `stall` seconds inside the same step."""
        s = self.step if save_step is None else save_step
        self.clock.begin_step(self.step, self.t)
        self.t += work
        self.clock.save_issued(s, self.t)
        self.t += stall
        self.clock.save_returned(s, self.t)
        self.clock.end_step(self.step, self.t)
        self.step += 1


def test_the_example_from_the_issue():
    # steps of 1.0 s; a save blocks its step for 0.2 s; the next two steps take 1.3 s while it
    # writes: slowdown = 2 * (1.3 - 1.0) = 0.6 s, cost = 0.2 + 0.6 = 0.8 s
    clock = StepClock()
    tl = Timeline(clock)
    tl.steps(1.0, 1.0, 1.0, 1.0, 1.0)
    tl.step_with_save(1.0, 0.2)  # step 5 (1.2 s, net 1.0)
    tl.steps(1.3, 1.3)
    clock.save_durable(5, tl.t)  # durable right as step 7 ends, between steps: final at once
    [cost] = clock.pop_results()
    assert cost.step == 5 and cost.ok
    assert cost.step_stall_s == pytest.approx(0.2)
    assert cost.slowdown_s == pytest.approx(0.6)
    assert cost.cost_s == pytest.approx(0.8)
    assert cost.steps_overlapped == 2
    assert cost.step_time_s == pytest.approx(1.0) and cost.baseline == "clean"
    assert cost.background_s == pytest.approx(2.6)
    assert cost.issued_s == pytest.approx(6.0)  # 5 steps + 1.0 s of work
    assert cost.interval_s == pytest.approx(6.0)  # first save: since the first step began
    assert cost.overhead_pct == pytest.approx(0.8 / 6.0 * 100)
    assert clock.pop_results() == []  # each result once
    tl.steps(1.0)
    s = clock.summary()
    # wall = 5 + 1.2 + 2.6 + 1.0 = 9.8 s; overhead = 0.8 / 9.8
    assert s.steps == 9 and s.saves == 1 and s.pending == 0
    assert s.wall_s == pytest.approx(9.8)
    assert s.cost_s == pytest.approx(0.8) and s.stall_s == pytest.approx(0.2) and s.slowdown_s == pytest.approx(0.6)
    assert s.overhead_pct == pytest.approx(0.8 / 9.8 * 100)
    assert s.time_to_first_durable_s == pytest.approx(8.8)
    assert s.step_time_s == pytest.approx(1.0) and s.baseline == "clean"
    assert cost.as_metrics() == {"step_stall_s": cost.step_stall_s, "slowdown_s": cost.slowdown_s, "cost_s": cost.cost_s,
                                 "overhead_pct": cost.overhead_pct, "step_time_s": cost.step_time_s}


def test_boundary_per_optimizer_step_gives_the_same_answer():
    clock = StepClock()
    t = 0.0
    clock.boundary(t)  # step 0 begins
    for _ in range(5):
        t += 1.0
        clock.boundary(t)
    t += 1.0
    clock.save_issued(5, t)
    t += 0.2
    clock.save_returned(5, t)
    for d in (0.0, 1.3, 1.3):  # the step holding the save ends right after it returns
        t += d
        clock.boundary(t)
    clock.save_durable(5, t)  # step 8 began at t: nothing later overlaps, final at once
    [cost] = clock.pop_results()
    assert (cost.step_stall_s, cost.slowdown_s) == (pytest.approx(0.2), pytest.approx(0.6))
    assert [s.step for s in clock.step_samples()] == list(range(8))


def test_guard_wait_in_the_next_step_is_stall_not_slowdown():
    # async snapshot: save() returns after 0.01 s; the next step's optimizer.step() waits 0.1 s for
    # the copy, so that step takes 1.1 s of which 1.0 s is work: stall 0.11, slowdown 0
    clock = StepClock()
    tl = Timeline(clock)
    tl.steps(1.0, 1.0, 1.0)
    tl.step_with_save(1.0, 0.01)
    clock.begin_step(tl.step, tl.t)
    tl.t += 0.5
    clock.add_stall(3, 0.1)
    tl.t += 0.6
    clock.save_durable(3, tl.t - 0.3)  # durable while the step is open: not final yet
    assert clock.pop_results() == []
    assert clock.summary().pending == 1
    clock.end_step(tl.step, tl.t)
    [cost] = clock.pop_results()
    assert cost.step_stall_s == pytest.approx(0.11)
    assert cost.slowdown_s == pytest.approx(0.0, abs=1e-12)
    assert cost.steps_overlapped == 1


def test_faster_steps_do_not_cancel_slower_ones():
    clock = StepClock()
    tl = Timeline(clock)
    tl.steps(1.0, 1.0, 1.0)
    tl.step_with_save(1.0, 0.0)
    tl.steps(1.5, 0.7)  # +0.5, -0.3 -> clipped at 0: slowdown 0.5
    clock.save_durable(3, tl.t)
    assert clock.pop_results()[0].slowdown_s == pytest.approx(0.5)


def test_saves_in_flight_together_share_a_step():
    clock = StepClock()
    tl = Timeline(clock)
    tl.steps(1.0, 1.0, 1.0)
    tl.step_with_save(1.0, 0.0, save_step=10)
    tl.step_with_save(1.0, 0.0, save_step=11)  # overlaps save 10 (net 1.0: nothing to share)
    tl.steps(1.4)  # both in flight: 0.4 excess, 0.2 each
    clock.save_durable(10, tl.t)
    clock.save_durable(11, tl.t)
    a, b = clock.pop_results()
    assert (a.step, b.step) == (10, 11)
    assert a.slowdown_s == pytest.approx(0.2) and b.slowdown_s == pytest.approx(0.2)
    assert b.interval_s == pytest.approx(1.0)  # from save 10's save() entry to save 11's


def test_without_clean_steps_the_baseline_is_all_steps():
    clock = StepClock()
    tl = Timeline(clock)
    tl.step_with_save(1.0, 0.5)  # the first step already saves: net 1.0
    tl.steps(1.2, 1.0)
    clock.save_durable(0, tl.t)
    [cost] = clock.pop_results()
    # median of the nets {1.0, 1.2, 1.0} = 1.0; excess 0.2 from the 1.2 s step
    assert cost.baseline == "all" and cost.step_time_s == pytest.approx(1.0)
    assert cost.slowdown_s == pytest.approx(0.2)


def test_before_any_step_there_is_no_baseline_and_no_slowdown():
    clock = StepClock()
    clock.save_issued(0, 10.0)
    clock.save_returned(0, 10.3)
    clock.save_durable(0, 12.0, ok=False)
    [cost] = clock.pop_results()
    assert cost.baseline == "none" and cost.step_time_s is None
    assert not cost.ok and cost.cost_s == pytest.approx(0.3) and cost.overhead_pct is None
    s = clock.summary()
    assert s.time_to_first_durable_s is None and s.overhead_pct is None and s.wall_s == 0.0


def test_a_failed_save_is_not_the_first_durable_one():
    clock = StepClock()
    tl = Timeline(clock)
    tl.step_with_save(1.0, 0.1)
    clock.save_durable(0, tl.t + 0.5, ok=False)
    tl.steps(1.0)
    tl.step_with_save(1.0, 0.1)
    clock.save_durable(2, tl.t + 0.5)
    tl.steps(1.0)
    # steps 0 (1.1 s) and 1 (1.0 s), then 1.0 s of work + 0.1 s save: 3.2 s, durable 0.5 s later
    assert clock.summary().time_to_first_durable_s == pytest.approx(3.7)


def test_memory_is_bounded_and_the_baseline_follows_recent_steps():
    clock = StepClock(window=10)
    tl = Timeline(clock)
    tl.steps(*([1.0] * 500 + [2.0] * 500))
    assert len(clock.step_samples()) == 10
    assert clock.summary().step_time_s == pytest.approx(2.0)
    assert clock.summary().steps == 1000


def test_a_save_spanning_more_steps_than_the_window_is_still_counted():
    clock = StepClock(window=5)
    tl = Timeline(clock)
    tl.steps(*[1.0] * 5)
    tl.step_with_save(1.0, 0.0)
    tl.steps(*[1.5] * 20)
    clock.save_durable(5, tl.t)
    [cost] = clock.pop_results()
    assert cost.steps_overlapped == 20
    assert cost.slowdown_s == pytest.approx(10.0)  # 20 * 0.5


def test_step_samples_carry_wall_clock_begin_and_net_time():
    clock = StepClock()
    tl = Timeline(clock)
    tl.steps(1.0)
    tl.step_with_save(1.0, 0.25)
    a, b = clock.step_samples()
    assert b.begin_wall - a.begin_wall == pytest.approx(1.0)
    assert (a.seconds, a.net_s, a.clean) == (pytest.approx(1.0), pytest.approx(1.0), True)
    assert (b.seconds, b.net_s, b.clean) == (pytest.approx(1.25), pytest.approx(1.0), False)


def test_misuse_is_reported():
    with pytest.raises(CheckpointConfigError):
        StepClock(window=0)
    clock = StepClock()
    with pytest.raises(CheckpointConfigError, match="save_issued"):
        clock.save_returned(3, 1.0)
    with pytest.raises(CheckpointConfigError, match="save_issued"):
        clock.save_durable(3, 1.0)
    with pytest.raises(CheckpointConfigError):
        clock.add_stall(3, -1.0)
    clock.add_stall(99, 0.5)  # a guard for a save already accounted: harmless
    clock.end_step(0, 1.0)  # no open step: nothing happens
    assert clock.summary().steps == 0


def test_default_timestamps_come_from_perf_counter():
    clock = StepClock()
    clock.begin_step(0)
    clock.save_issued(0)
    clock.save_returned(0)
    clock.end_step(0)
    clock.save_durable(0)
    clock.boundary()
    clock.boundary()
    [cost] = clock.pop_results()
    assert cost.step_stall_s >= 0 and clock.summary().steps == 2


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_steady_steps_mean_the_cost_is_exactly_the_stall(data):
    """Property: when every step's work takes the same time, slowdown is 0 and cost = stall."""
    work = data.draw(st.floats(min_value=0.01, max_value=10.0))
    n = data.draw(st.integers(min_value=1, max_value=60))
    clock = StepClock(window=data.draw(st.integers(min_value=1, max_value=50)), keep_results=n)
    t, in_flight, stalls = 0.0, [], {}  # in_flight: save steps not durable yet
    for step in range(n):
        clock.begin_step(step, t)
        t += work
        if data.draw(st.booleans()):
            stalls[step] = data.draw(st.floats(min_value=0.0, max_value=5.0))
            clock.save_issued(step, t)
            t += stalls[step]
            clock.save_returned(step, t)
            in_flight.append(step)
        clock.end_step(step, t)
        for s in list(in_flight):  # background work ends between steps, after any number of them
            if data.draw(st.booleans()):
                clock.save_durable(s, t)
                in_flight.remove(s)
    for s in in_flight:
        clock.save_durable(s, t)
    results = clock.pop_results()
    assert sorted(r.step for r in results) == sorted(stalls)
    for r in results:
        assert r.slowdown_s == pytest.approx(0.0, abs=1e-9)
        assert r.cost_s == pytest.approx(stalls[r.step])
    summary = clock.summary()
    assert summary.pending == 0
    assert summary.cost_s == pytest.approx(sum(stalls.values()))


def test_discard_open_finalizes_without_counting_the_teardown():
    # the run ends inside an open step (close() after the last optimizer.step): that time is not a step
    clock = StepClock()
    tl = Timeline(clock)
    tl.steps(1.0, 1.0)
    tl.step_with_save(1.0, 0.1)
    clock.begin_step(tl.step, tl.t)
    clock.save_durable(2, tl.t + 0.5)  # durable inside the open step: not final yet
    assert not clock.has_results() and clock.pop_results() == []
    clock.discard_open()
    assert clock.has_results()
    [cost] = clock.pop_results()
    assert cost.steps_overlapped == 0 and cost.cost_s == pytest.approx(0.1)
    assert clock.steps == 3 and clock.summary().steps == 3 and not clock.has_results()
