"""The tables of docs/strategies.md, "Per-op policies beside Megatron-Core's modules": for
Llama-3-8B, Mixtral-8x7B and DeepSeek-V3 at their usual layouts on H100s, run as torchtitan runs
them (eager: layer-level policies without early stop, scoped ones by the torch export's
checkpoints with it; or compiled with --compiled) or, with --early-stop, as DeepSpeed runs PyTorch's
checkpoint (eager, early stop on; ZeRO 1 beside pipeline parallelism), the peak activations and
step-time overhead of full and per-op recomputation, of each Megatron-Core module set, and of the
fastest policy on the frontiers (`policy_search.policy_frontier`, and eagerly
`policy_search.scoped_frontier`'s scoped policies) whose plan peaks no higher than the set's.

    python validation/policy_table.py [--compiled | --early-stop]
"""

from __future__ import annotations

import argparse

from ckplan.hardware.step_time import step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.layers import distinct_kinds
from ckplan.plan.evaluate import evaluate
from ckplan.plan.policy_search import policy_frontier, scoped_frontier
from ckplan.plan.strategies import parse_strategy
from ckplan.render.common import gib

# The usual layouts (torchtitan's FSDP is ZeRO 3); tests/test_op_policy_moe_mla.py checks the
# best policy against every module set at them.
LAYOUTS = {
    "llama3-8b": {"dp": 8, "zero": 3},
    "mixtral-8x7b": {"tp": 2, "sp": True, "pp": 4, "microbatches": 16, "ep": 8, "dp": 8,
                     "zero": 3},
    "deepseek-v3": {"tp": 2, "sp": True, "pp": 16, "first_stage_layers": 1, "microbatches": 32,
                    "ep": 64, "dp": 64, "zero": 3},
}  # fmt: skip
MODULE_SETS = {
    "llama3-8b": ("layernorm", "mlp", "layernorm+mlp"),
    "mixtral-8x7b": ("layernorm", "moe_act", "layernorm+moe_act", "experts", "moe"),
    "deepseek-v3": (
        "layernorm", "moe_act", "mla_up_proj", "shared_experts",
        "layernorm+moe_act+mla_up_proj+shared_experts", "moe",
    ),
}  # fmt: skip
MODEL_NAMES = {
    "llama3-8b": "Llama-3-8B",
    "mixtral-8x7b": "Mixtral-8x7B",
    "deepseek-v3": "DeepSeek-V3",
}


def _row(spec, gpu, text):
    plan = evaluate(spec, parse_strategy(text, spec), gpu=gpu)
    return plan, step_time(plan, gpu)


def _policies(spec, gpu):
    """Every policy on each layer kind's frontier, as strategy texts (one kind: its frontier;
    several: the frontier of each kind, applied to every layer)."""
    seen = {}
    for kind in distinct_kinds(spec):
        for point in (*policy_frontier(spec, gpu, kind), *scoped_frontier(spec, gpu, kind)):
            if point.kept or point.scopes:
                seen.setdefault(point.strategy, None)
    return list(seen)


def table(kernels: str, framework: str = "torchtitan") -> list[str]:
    gpu = load_gpu("h100-sxm")
    lines = ["| model | strategy | activations | time ovh |", "|---|---|---:|---:|"]
    for model, layout in LAYOUTS.items():
        if framework == "deepspeed" and layout.get("pp", 1) > 1:
            layout = {**layout, "zero": 1}  # DeepSpeed's pipeline engine shards up to ZeRO 1
        spec = load_spec(model, {"framework": framework, "kernels": kernels, **layout})
        policies = []
        for text in _policies(spec, gpu):
            try:
                policies.append((text, *_row(spec, gpu, text)))
            except Exception:  # a policy this layout cannot run (the export's refusals)
                continue
        name = MODEL_NAMES[model]
        for text in ("none", "full", "sac", "selective", *MODULE_SETS[model]):
            plan, time = _row(spec, gpu, text)
            cells = (f" {name} " if name else " ", f" `{text}` ", f" {gib(plan.activation_bytes)} ")
            lines.append("|" + "|".join(cells) + f"| {time.overhead:+.1%} |")
            name = ""
            if text in ("none", "full", "sac", "selective"):
                continue
            within = [p for p in policies if p[1].activation_bytes <= plan.activation_bytes]
            if within:
                best, best_plan, best_time = min(within, key=lambda p: p[2].step_seconds)
                lines.append(
                    f"| | best policy within: `{best}` | {gib(best_plan.activation_bytes)} | "
                    f"{best_time.overhead:+.1%} |"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compiled", action="store_true", help="kernels: compiled")
    mode.add_argument(
        "--early-stop", action="store_true", help="eager, as DeepSpeed runs the checkpoint"
    )
    arguments = parser.parse_args()
    kernels = "compiled" if arguments.compiled else "eager"
    framework = "deepspeed" if arguments.early_stop else "torchtitan"
    print("\n".join(table(kernels, framework)))


if __name__ == "__main__":
    main()
