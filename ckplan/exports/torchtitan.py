"""torchtitan's `[activation_checkpoint]` job-config section for a plan, and read back.

torchtitan (torchtitan/config/job_config.py, torchtitan/distributed/activation_checkpoint.py):
`mode` is "none", "full" or "selective"; `full` wraps every transformer block in
`checkpoint_wrapper`; `selective` with `selective_ac_option = "N"` (a positive integer) wraps
every N-th block, counting from 1 (`_layer_sac_count % ac_freq == 0`), and stores the others;
`selective_ac_option = "op"` is op-level SAC that saves the outputs of matmuls (all but every
second one), attention (SDPA) and reduce-scatters and recomputes the rest of each block:
ckplan's `sac` (ckplan.model.op_policy), not its selective, which recomputes the attention core
and saves the rest. The section reads
the same in the TOML files of torchtitan releases and in the `ActivationCheckpoint` dataclass of
newer Python configs.
"""

from __future__ import annotations

import re

from ckplan.exports.segments import LayerSegments, module_reason
from ckplan.model.op_policy import TORCHTITAN_POLICY
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan

NAME = "torchtitan"


def reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    if layers.policy == TORCHTITAN_POLICY:
        if layers.stores_all:
            return None
        return (
            "its per-op policy beside fully recomputed layers: torchtitan applies one "
            "activation-checkpoint mode to every block"
        )
    if layers.policy:
        return (
            f'the per-op policy {layers.policy}: torchtitan\'s selective_ac_option = "op" '
            "is the policy sac only"
        )
    if why := module_reason(layers, "torchtitan"):
        return why
    if spec.kind != "transformer":
        return f"torchtitan trains transformers, not model kind {spec.kind!r}"
    if layers.selective:
        return (
            "selective recomputation of the attention core: torchtitan's op-level selective "
            "AC saves attention and recomputes the rest, the opposite"
        )
    if layers.stores_all or _option(layers) is not None:
        return None
    return (
        "these layer segments: torchtitan wraps every block (full) or every N-th block "
        "(selective_ac_option = N), one block per checkpoint"
    )


def _option(layers: LayerSegments) -> str | None:
    """'full', or the layer frequency N of selective layer AC, or None."""
    if layers.uniform_size() == 1:
        return "full"
    every = layers.every_nth()
    return None if every is None else str(every)


def section(layers: LayerSegments) -> dict[str, str]:
    if layers.policy == TORCHTITAN_POLICY:
        return {"mode": "selective", "selective_ac_option": "op"}
    if layers.stores_all:
        return {"mode": "none"}
    option = _option(layers)
    if option == "full":
        return {"mode": "full"}
    return {"mode": "selective", "selective_ac_option": option}


def render(plan: Plan, layers: LayerSegments) -> str:
    lines = [f"# ckplan: plan {plan.strategy} for {plan.spec.name}", "[activation_checkpoint]"]
    lines += [f'{key} = "{value}"' for key, value in section(layers).items()]
    return "\n".join(lines) + "\n"


def notes(plan: Plan, layers: LayerSegments) -> list[str]:
    spec = plan.spec
    return [
        "merge into the job's TOML (or ActivationCheckpoint(...) in a Python config); set "
        f"[parallelism] to tp={spec.tp} pp={spec.pp} cp={spec.cp} and the batch to "
        f"{spec.micro_batch} x seq {spec.seq}"
    ]


def strategy_from_toml(text: str) -> str:
    """The ckplan strategy that an `[activation_checkpoint]` section selects: none, full or
    sac (op-level selective AC). Every-N-th-layer selective AC (N > 1) has no ckplan strategy
    name: ValueError."""
    values = dict(re.findall(r'^\s*(\w+)\s*=\s*"([^"]*)"', text, flags=re.MULTILINE))
    mode = values.get("mode", "none")
    if mode == "none":
        return "none"
    if mode == "full" or values.get("selective_ac_option") == "1":
        return "full"
    if values.get("selective_ac_option") == "op":
        return "sac"
    option = values.get("selective_ac_option")
    raise ValueError(f"selective_ac_option {option!r} has no ckplan strategy name")
