"""DeepSpeed's pipeline schedule against ckplan's bubble: TrainSchedule as released in
deepspeed v0.5.4 (deepspeed/runtime/pipe/schedule.py, `TrainSchedule.steps`,
`_step_to_micro_batch`), its sends and receives blocking (deepspeed/runtime/pipe/p2p.py:
`dist.send`/`dist.recv`, or a broadcast over a 2-rank group before torch 1.8; both ends meet).

Each stage runs 2(m + p - 1) steps, alternating forward and backward slots with its neighbours
out of phase; a forward slot first receives the activation, then sends the previous backward's
gradient; a backward slot sends the previous forward's activation, then receives the gradient.
An event simulation of that instruction stream, with forward F and backward B (its re-forward
included) per micro-batch and X per transfer, ends after (m + p - 1)(F + B) plus X times
4m + 2p - 8: the 1F1B time ckplan charges (`bubble_steps`: p - 1 micro-batch times), and four
blocking transfers per micro-batch on the critical path where ckplan counts two.
"""

import pytest

from ckplan.hardware.step_time import bubble_steps


def _step_to_micro_batch(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """TrainSchedule._step_to_micro_batch, v0.5.4: (micro-batch, is_forward)."""
    if step % 2 == 0 and stage % 2 == 0:
        return step // 2 - stage // 2, True
    if step % 2 == 1 and stage % 2 == 1:
        return (step - 1) // 2 - stage // 2, True
    if step % 2 == 0 and stage % 2 == 1:
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def _instructions(stage: int, stages: int, micro_batches: int) -> list[tuple]:
    """TrainSchedule.steps, v0.5.4, for one stage: its transfers and passes in order."""
    valid = range(micro_batches)
    commands, previous = [], -1
    for step in range(2 * (micro_batches + stages - 1)):
        micro_batch, forward = _step_to_micro_batch(step, stage, stages)
        if forward and stage > 0:
            if micro_batch in valid:
                commands.append(("recv", stage - 1, "activation", micro_batch))
            if previous in valid:
                commands.append(("send", stage - 1, "gradient", previous))
        if not forward and stage < stages - 1:
            if previous in valid:
                commands.append(("send", stage + 1, "activation", previous))
            if micro_batch in valid:
                commands.append(("recv", stage + 1, "gradient", micro_batch))
        if micro_batch in valid:
            commands.append(("forward" if forward else "backward",))
        previous = micro_batch
    return commands


def _makespan(stages: int, micro_batches: int, forward: float, backward: float, transfer: float):
    """When the last stage finishes: passes take their time; a send and its receive start when
    both ends reach them and end `transfer` later on both."""
    programs = [_instructions(s, stages, micro_batches) for s in range(stages)]
    position, clock = [0] * stages, [0.0] * stages
    while any(position[s] < len(programs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while position[s] < len(programs[s]):
                command = programs[s][position[s]]
                if command[0] in ("forward", "backward"):
                    clock[s] += forward if command[0] == "forward" else backward
                    position[s] += 1
                    moved = True
                    continue
                kind, peer, what, micro_batch = command
                other = "recv" if kind == "send" else "send"
                if position[peer] < len(programs[peer]) and programs[peer][position[peer]] == (
                    other,
                    s,
                    what,
                    micro_batch,
                ):
                    clock[s] = clock[peer] = max(clock[s], clock[peer]) + transfer
                    position[s] += 1
                    position[peer] += 1
                    moved = True
                    continue
                break
        assert moved, "the schedule deadlocked"
    return max(clock)


@pytest.mark.parametrize(("stages", "micro_batches"), [(3, 5), (4, 8), (8, 16), (35, 160)])
@pytest.mark.parametrize(("forward", "backward"), [(1.0, 2.0), (1.0, 3.0), (2.0, 2.0)])
def test_train_schedule_takes_the_1f1b_time(spec_of, stages, micro_batches, forward, backward):
    spec = spec_of("gpt2", layers=stages, pp=stages, microbatches=micro_batches)
    expected = (micro_batches + bubble_steps(spec, 0)) * (forward + backward)
    assert expected == (micro_batches + stages - 1) * (forward + backward)
    assert _makespan(stages, micro_batches, forward, backward, 0.0) == pytest.approx(expected)


@pytest.mark.parametrize(("stages", "micro_batches"), [(3, 5), (4, 8), (8, 16), (35, 240)])
def test_four_blocking_transfers_per_micro_batch(stages, micro_batches):
    # transfers on the critical path: (makespan with X - makespan without) / X
    without = _makespan(stages, micro_batches, 1.0, 3.0, 0.0)
    with_transfers = _makespan(stages, micro_batches, 1.0, 3.0, 1e-3)
    transfers = (with_transfers - without) / 1e-3
    assert transfers == pytest.approx(4 * micro_batches + 2 * stages - 8)
