"""Pipeline schedules and their simulator: pure functions, no processes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from graphforge.cli import app
from graphforge.distributed.schedules import (
    BACKWARD,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    gpipe,
    make_schedule,
    one_f_one_b,
)
from graphforge.distributed.simulate import Costs, ScheduleError, simulate, timeline
from graphforge.errors import GraphforgeError


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 4, 16])
@pytest.mark.parametrize(("forward", "backward"), [(1.0, 1.0), (1.0, 2.0), (0.3, 0.7)])
def test_uniform_costs_give_the_textbook_bubble(name, stages, microbatches, forward, backward):
    sim = simulate(make_schedule(name, stages, microbatches), Costs.uniform(stages, forward, backward))
    assert sim.bubble == pytest.approx((stages - 1) / (microbatches + stages - 1), abs=1e-12)
    assert sim.makespan == pytest.approx((microbatches + stages - 1) * (forward + backward), abs=1e-9)
    assert sim.busy == pytest.approx([microbatches * (forward + backward)] * stages)


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 4, 16])
def test_1f1b_stashes_at_most_the_stage_count_and_gpipe_every_microbatch(stages, microbatches):
    costs = Costs.uniform(stages)
    one = simulate(one_f_one_b(stages, microbatches), costs)
    assert one.peak_stash == [min(stages - s, microbatches) for s in range(stages)]
    assert max(one.peak_stash) <= stages
    assert simulate(gpipe(stages, microbatches), costs).peak_stash == [microbatches] * stages


def test_every_stage_runs_each_microbatch_forward_then_backward_once():
    for schedule in (gpipe(3, 5), one_f_one_b(3, 5)):
        for actions in schedule:
            computes = [(a.kind, a.microbatch) for a in actions if a.kind in (FORWARD, BACKWARD)]
            assert sorted(computes) == sorted([(k, m) for k in (FORWARD, BACKWARD) for m in range(5)])
            for m in range(5):
                assert computes.index((FORWARD, m)) < computes.index((BACKWARD, m))


def test_an_unbalanced_pipeline_is_as_slow_as_its_slowest_stage():
    # stage 1 takes twice as long: the makespan is set by it, the others wait
    sim = simulate(gpipe(2, 8), Costs([1, 2], [2, 4]))
    assert sim.makespan == pytest.approx(8 * 6 + 3)
    assert sim.idle[1] < sim.idle[0]


def test_communication_time_widens_the_bubble():
    costs = Costs.uniform(4, 1, 2)
    assert (
        simulate(one_f_one_b(4, 8), Costs(costs.forward, costs.backward, comm=0.5)).bubble
        > simulate(one_f_one_b(4, 8), costs).bubble
    )


def test_a_receive_nobody_sends_is_reported_not_hung_on():
    schedule = gpipe(2, 2)
    schedule[0] = [a for a in schedule[0] if not (a.kind == SEND_F and a.microbatch == 1)]
    with pytest.raises(ScheduleError, match=r"stage 1 action \d+ \(RECV_F1←0\) waits for a send stage 0 never makes"):
        simulate(schedule, Costs.uniform(2))


def test_repeated_and_missing_actions_are_reported():
    schedule = gpipe(2, 2)
    schedule[0].append(Action(SEND_F, 1, 1))
    with pytest.raises(ScheduleError, match="repeats"):
        simulate(schedule, Costs.uniform(2))
    schedule = gpipe(2, 1)
    schedule[1] = [a for a in schedule[1] if a.kind != RECV_F]
    with pytest.raises(ScheduleError, match=r"\(F0\) comes before RECV_F0"):
        simulate(schedule, Costs.uniform(2))


def test_a_backward_before_its_forward_is_reported():
    schedule = one_f_one_b(2, 2)
    last = schedule[1]
    i, j = last.index(Action(FORWARD, 1)), last.index(Action(BACKWARD, 1))
    last[i], last[j] = last[j], last[i]
    with pytest.raises(ScheduleError, match="a backward before its forward"):
        simulate(schedule, Costs.uniform(2))


def test_a_deadlock_names_the_waiting_stages():
    # stage 0 waits for micro-batch 1's gradient before sending the activations stage 1 waits for
    stage0 = [Action(FORWARD, 0), Action(FORWARD, 1), Action(RECV_B, 1, 1), Action(SEND_F, 0, 1)]
    stage0 += [Action(SEND_F, 1, 1), Action(BACKWARD, 1), Action(RECV_B, 0, 1), Action(BACKWARD, 0)]
    stage1 = [Action(RECV_F, 0, 0), Action(FORWARD, 0), Action(RECV_F, 1, 0), Action(FORWARD, 1)]
    stage1 += [Action(BACKWARD, 1), Action(SEND_B, 1, 0), Action(BACKWARD, 0), Action(SEND_B, 0, 0)]
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 at RECV_B1←1 .*stage 1 at RECV_F0←0"):
        simulate([stage0, stage1], Costs.uniform(2))


def test_receives_out_of_the_send_order_are_reported():
    schedule = gpipe(2, 2)
    # stage 1 takes micro-batch 1 first, stage 0 sends micro-batch 0 first
    schedule[1][:4] = [Action(RECV_F, 1, 0), Action(FORWARD, 1), Action(RECV_F, 0, 0), Action(FORWARD, 0)]
    with pytest.raises(ScheduleError, match="finds micro-batch 0 first in its channel from stage 0"):
        simulate(schedule, Costs.uniform(2))


def test_bad_arguments():
    with pytest.raises(GraphforgeError, match="unknown pipeline schedule 'zb'"):
        make_schedule("zb", 2, 2)
    with pytest.raises(GraphforgeError, match="stages ≥ 1"):
        gpipe(0, 2)
    with pytest.raises(ScheduleError, match="1 forward costs for 2 stages"):
        simulate(gpipe(2, 2), Costs([1], [1, 1]))


def test_timeline_draws_each_stage():
    text = timeline(simulate(gpipe(2, 2), Costs.uniform(2, 1, 1)))
    assert text.splitlines() == ["stage 0 F0 |F1 |········B0 |B1 |", "stage 1 ····F0 |F1 |B0 |B1 |····"]


def test_schedule_command():
    runner = CliRunner()
    result = runner.invoke(app, ["schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    assert figures["bubble"] == pytest.approx(3 / 11)
    assert figures["peak_stash"] == [4, 3, 2, 1]
    result = runner.invoke(app, ["schedule", "gpipe", "--stages", "2", "--microbatches", "4", "--costs", "1:2,2:4"])
    assert result.exit_code == 0, result.output
    assert "stage 1" in result.output and "bubble" in result.output
