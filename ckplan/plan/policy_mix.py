"""`POLICY+mixed` plans (`sac+mixed`): one pipeline stage's chain where the optimal DP chooses,
layer by layer, the full tape, a per-op policy's tape (its backward re-runs what the policy
does not keep) or recomputing the layer whole (ckplan.schedules.policy_mix).

With a GPU the DP weighs each stage's forward and backward time (the policy's re-run
included), in whole nanoseconds, as `offload+optimal` does; without one, FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.hardware.gpus import GPU
from ckplan.model.spec import ModelSpec
from ckplan.plan.layer_chain import layer_chain
from ckplan.plan.strategies import Strategy, StrategyError
from ckplan.schedules import Chain, Replay, Schedule, simulate
from ckplan.schedules.policy_mix import MIX_MAX_STAGES, mixed_chain, optimal_mixed_schedule

NANOSECOND = 1e-9  # the DP's integer time unit with a GPU


@dataclass(frozen=True)
class MixedStage:
    """One pipeline stage's `POLICY+mixed` schedule: its steps, which chain stages store the
    policy's tape, the byte chain they make and its exact replay."""

    steps: Schedule
    policy_stages: tuple[bool, ...]
    chain: Chain
    replay: Replay
    # FLOPs of the policy's re-runs in the backward of the stages that store its tape
    rerun_flops: int


def timed_variants(
    spec: ModelSpec, gpu: GPU, stage: int, full: Chain, policy: Chain, groups: tuple[str, ...]
) -> tuple[Chain, Chain]:
    """The two chains with FLOPs replaced by whole nanoseconds of forward and backward on
    `gpu` (the policy's backward with its re-run), the forward shared.

    derived: `hardware.step_time.chain_compute_seconds`, rounded to the nearest nanosecond."""
    from ckplan.hardware.step_time import chain_compute_seconds

    forward, backward = chain_compute_seconds(spec, gpu, stage, ())
    _, rerun = chain_compute_seconds(spec, gpu, stage, groups)
    ns = tuple(round(t / NANOSECOND) for t in forward)

    def timed(chain: Chain, seconds) -> Chain:
        return Chain(
            forward_flops=ns,
            backward_flops=tuple(round(t / NANOSECOND) for t in seconds),
            input_bytes=chain.input_bytes,
            tape_bytes=chain.tape_bytes,
            forward_workspace_bytes=chain.forward_workspace_bytes,
            backward_workspace_bytes=chain.backward_workspace_bytes,
        )

    return timed(full, backward), timed(policy, rerun)


def mixed_stage(
    spec: ModelSpec,
    strategy: Strategy,
    stage: int,
    budget: int,
    slots: int,
    gpu: GPU | None = None,
) -> MixedStage | None:
    """The cheapest `POLICY+mixed` schedule of pipeline stage `stage` within `budget`
    activation bytes (step time on `gpu`, else FLOPs); None if none fits."""
    full = layer_chain(spec, (), stage=stage)
    if full.length > MIX_MAX_STAGES:
        raise StrategyError(
            f"strategy {strategy.name!r} plans chains of at most {MIX_MAX_STAGES} stages, this "
            f"one has {full.length}: use sac+optimal, or fewer layers per pipeline stage"
        )
    policy = layer_chain(spec, strategy.groups, stage=stage)
    variants = (
        timed_variants(spec, gpu, stage, full, policy, strategy.groups)
        if gpu is not None
        else (full, policy)
    )
    if budget < 0:
        return None
    found = optimal_mixed_schedule(variants, budget, slots)
    if found is None:
        return None
    chain = mixed_chain((full, policy), found.choice)
    replay = simulate(chain, found.steps)
    mask = tuple(
        v == 1
        and (full.tape_bytes[i], full.backward_flops[i])
        != (policy.tape_bytes[i], policy.backward_flops[i])
        for i, v in enumerate(found.choice)
    )
    rerun = sum(
        policy.backward_flops[i] - full.backward_flops[i] for i, on in enumerate(mask) if on
    )
    return MixedStage(found.steps, mask, chain, replay, rerun)
