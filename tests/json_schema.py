"""The JSON contract of the commands as data, and a small checker (no jsonschema dependency).

A schema is a type (`int` means an int that is not a bool; `float` accepts ints; `str`, `bool`),
`None`, a tuple of alternatives, a dict of required keys (extra keys are allowed: the contract
names what must be there), or a one-element list (every element matches it).
"""

from __future__ import annotations

from typing import Any

from ckplan.model.spec import model_keys

_PYTHON_TYPES = {"int": int, "str": str, "bool": bool, "float": float}


def _model_schema() -> dict:
    """Every resolved key of the model with its type, from the ModelSpec fields."""
    schema = {}
    for key, field in model_keys().items():
        name = field.type.split(" | ")[0]  # "int | None": an int, or null where it stays unset
        kind = _PYTHON_TYPES.get(name, str)  # the profile: the name or file the user gave
        schema[key] = (kind, None) if "None" in field.type else kind
    return schema


MODEL = _model_schema()
MEMORY = {
    "per_layer_activation_bytes": int,
    "breakdown": {"attention": int, "mlp": int, "norm": int},
    "activation_bytes": int,
    "model_state_bytes": int,
    "total_bytes": int,
    "optimizer_step_bytes": int,  # 0 unless the step allocates a workspace (foreach AdamW)
    "reserved_bytes": int,
    "device_bytes": (int, None),  # with --gpu: the peak as nvidia-smi shows it
    "budgeted_bytes": int,
}
FLOPS = {"forward": int, "backward": int, "recompute": int, "total": int}
PLAN = {
    "strategy": str,
    "formula": str,
    "memory": MEMORY,
    "parameters": {"total": int, "per_gpu": int},
    "flops": FLOPS,
    "overhead": float,
}
SWEEP_PLAN = {**PLAN, "fits": bool}
# An offload plan's `offload` object (docs/offloading.md); `exposed_seconds` with a GPU.
OFFLOAD = {"host_bytes": int, "bytes_moved": int, "offloaded_stages": [str]}
ESTIMATE = {"ckplan_version": str, "model": MODEL, **PLAN}
# Under torchtitan, which `ckplan export` writes the chosen plan (the `Export:` line); null under
# the other frameworks and without a chosen plan.
EXPORT = ({"target": (str, None), "options": (str, None), "reason": str}, None)
SWEEP = {
    "budget_bytes": int,
    "plans": [SWEEP_PLAN],
    "pareto": [SWEEP_PLAN],
    "best": (SWEEP_PLAN, None),
    "export": EXPORT,
    # a plan no export writes that does better than `best` (docs/output.md), or null
    "reference": (SWEEP_PLAN, None),
}
CHECK = {
    "budget_bytes": int,
    "results": [
        {"model": str, "fits": bool, "plan": (SWEEP_PLAN, None), "reference": (SWEEP_PLAN, None)}
    ],
}
# --seq auto / --micro-batch auto (docs/strategies.md): the same objects with the largest value.
ESTIMATE_MAX_SEQ = {**ESTIMATE, "max_seq": int}
SWEEP_MAX_SEQ = {
    **SWEEP,
    "max_seq": {"none": int, "full": int, "optimal": int},
    "best_at_max_seq": {"seq": int, "best": (SWEEP_PLAN, None)},
}
CHECK_MAX_MICRO_BATCH = {
    "budget_bytes": int,
    "results": [
        {
            "model": str,
            "fits": bool,
            "plan": (SWEEP_PLAN, None),
            "reference": (SWEEP_PLAN, None),
            "max_micro_batch": int,
        }
    ],
}
COUNTS = {"peak_bytes": int, "layer_forwards": int, "flops": int}
VERIFY = {
    "runs": [
        {
            "strategy": str,
            "gradients_identical": bool,
            "max_abs_grad_diff": float,
            "predicted": COUNTS,
            "measured": {**COUNTS, "seconds": float},
            "ok": bool,
        }
    ]
}
SCHEDULE = {
    **PLAN,
    "activation_budget_bytes": (int, None),
    "stages": [str],
    "steps": [{"kind": str, "stage": int, "name": str}],
}
NO_FIT = {
    "strategy": str,
    "memory": None,
    "flops": None,
    "fits": bool,
    "activation_budget_bytes": int,
    "notes": [str],
}

TIME = {
    "step_seconds": float,
    "forward_seconds": float,
    "backward_seconds": float,
    "recompute_seconds": float,
    "communication_seconds": float,
    "bubble_seconds": float,
    "overhead": float,
    "mfu": float,
    "mfu_convention": str,
    "hfu": float,
    "tokens_per_second_per_gpu": float,
}
_LAYOUT_KEYS = {
    "tp": int,
    "pp": int,
    "cp": int,
    "dp": int,
    "ep": int,
    "zero": int,
    "sp": bool,
    "virtual_stages": int,
    "micro_batch": int,
    "microbatches": int,
    "first_stage_layers": (int, None),
    "last_stage_layers": (int, None),
    "account_for_embedding_in_pipeline_split": bool,
    "account_for_loss_in_pipeline_split": bool,
}
LAYOUT = {
    **_LAYOUT_KEYS,
    "etp": (int, None),
    "stage_layers": [int],
    "strategy": str,
    "fits": bool,
    "memory": {
        "total_bytes": int,
        "activation_bytes": int,
        "model_state_bytes": int,
        "headroom_bytes": int,
        "peak_stage": int,
    },
    "time": TIME,
    "set": [str],
    "offload": (
        {
            "strategy": str,
            "step_seconds": float,
            "exposed_seconds": float,
            "host_bytes": int,
            "bytes_moved": int,
            "recompute_strategy": (str, None),
            "recompute_step_seconds": (float, None),
        },
        None,
    ),
    # a plan no export writes that does better on the layout (docs/layouts.md), or null
    "reference": (SWEEP_PLAN, None),
}
REJECTED = {
    **_LAYOUT_KEYS,
    "reason": str,
    "why": str,
    "over_bytes": (int, None),
    "step_seconds": float,
    "evaluated": bool,
    "reference": (SWEEP_PLAN, None),
}
LAYOUTS = {
    "gpus": int,
    "gpu": str,
    "model": str,
    "global_batch": int,
    "seq": int,
    "budget_bytes": int,
    "reserve_bytes": int,
    "usable_bytes": int,
    "layouts": [LAYOUT],
    "rejected": {"counts": {"layouts": int}, "layouts": [REJECTED], "nearest": (REJECTED, None)},
    "advice": [str],
    "without_offload": (LAYOUT, None),
    "export": EXPORT,
}


def errors(value: Any, schema: Any, where: str = "$") -> list[str]:
    """Every place where `value` breaks `schema`, as 'path: problem'."""
    if isinstance(schema, tuple):
        found = [errors(value, option, where) for option in schema]
        return [] if any(not e for e in found) else found[0]
    if schema is None:
        return [] if value is None else [f"{where}: expected null, got {value!r}"]
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        out = []
        for key, sub in schema.items():
            if key not in value:
                out.append(f"{where}: missing key {key!r}")
            else:
                out += errors(value[key], sub, f"{where}.{key}")
        return out
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where}: expected an array, got {type(value).__name__}"]
        return [e for i, item in enumerate(value) for e in errors(item, schema[0], f"{where}[{i}]")]
    if schema is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif schema is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, schema)
    return [] if ok else [f"{where}: expected {schema.__name__}, got {value!r}"]
