"""Test chains written stage by stage: one tuple per stage instead of six parallel lists."""

from __future__ import annotations

from ckplan.schedules import Chain


def chain_of_stages(stages, last_input: int, *, tape_includes_input: bool = False) -> Chain:
    """`stages[p]` = (forward FLOPs, backward FLOPs, input bytes, tape bytes, forward workspace,
    backward workspace) of stage p; `last_input` is the bytes of the chain's output. With
    `tape_includes_input`, a stage's tape is its input plus the tuple's tape bytes (a layer
    that saves its input among its tensors)."""
    inputs = [s[2] for s in stages] + [last_input]
    tapes = [inputs[p] + s[3] if tape_includes_input else s[3] for p, s in enumerate(stages)]
    return Chain(
        [s[0] for s in stages],
        [s[1] for s in stages],
        inputs,
        tapes,
        [s[4] for s in stages],
        [s[5] for s in stages],
    )
