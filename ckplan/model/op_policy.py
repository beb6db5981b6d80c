"""Per-op recomputation policies: keep the outputs of these ops, recompute the rest.

PyTorch's selective activation checkpointing (`torch.utils.checkpoint.
create_selective_checkpoint_contexts`, PyTorch 2.4+) runs a checkpointed layer under a policy
that marks every op's output MUST_SAVE or PREFER_RECOMPUTE. Between the forward and the
backward the layer holds its input (the checkpoint's argument) and the outputs it must save;
the backward re-runs the layer's forward, taking the saved outputs from that cache instead of
running their ops again, and then backpropagates the rebuilt tape as full recomputation does.

torchtitan's `selective_ac_option = "op"` (torchtitan/models/llama3/infra/parallelize.py at
v0.1.0, `_save_list` and `_custom_policy`; the same rule in
torchtitan/distributed/activation_checkpoint.py from August 2025) saves the outputs of
`aten.mm` but every second one, of the flash and memory-efficient SDPA kernels, of
`reduce_scatter_tensor` and of `aten.max` (float8 scales); the mm counter restarts in every
layer. Its Llama block runs wq, wk, wv, wo, w1, w3, w2 in that order, so it keeps the outputs of
wq, wv, w1 and w2 and recomputes wk, wo and w3, the norms, RoPE and the SwiGLU product.

A policy is written `sac:ITEM,ITEM,...` (docs/strategies.md): an item names a unit op of the
layer (`UNIT_NAMES`), `matmuls` keeps every matmul output, `matmuls%K` every one but each K-th
(torchtitan: `matmuls%2`). `sac` alone is torchtitan's policy, `TORCHTITAN_POLICY`.

ckplan's op table fuses what eager code runs as several modules (one QKV projection, one fc1 for
gate and up); `unit_ops` splits them into the units a policy sees, each a table `Op` with its own
GEMM, so times and FLOPs of what is recomputed follow from the same roofline as the rest.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ckplan.errors import InputError
from ckplan.model.layers import LayerKind
from ckplan.model.op import FP32_BYTES, LayerShapes, Matmul, Op, kv_heads_per_rank
from ckplan.model.ops import layer_ops, representative_kind
from ckplan.model.parts import cached_by_chain
from ckplan.model.spec import ChainSpec
from ckplan.quoting import quote

POLICY_PREFIX = "sac:"
TORCHTITAN_ITEMS = ("matmuls%2", "attention", "reduce_scatter")
TORCHTITAN_POLICY = POLICY_PREFIX + ",".join(TORCHTITAN_ITEMS)
# Unit ops a policy may name, in the order a Llama-style layer runs them (gelu MLPs have fc1
# where gated ones have gate_proj and up_proj).
UNIT_NAMES = (
    "norm1",
    "q_proj",
    "k_proj",
    "v_proj",
    "qk_norm",
    "rope",
    "attention",
    "out_proj",
    "reduce_scatter",
    "norm2",
    "fc1",
    "gate_proj",
    "up_proj",
    "act",
    "fc2",
)
# Other spellings of the same units: torchtitan's Llama modules and Hugging Face's.
UNIT_ALIASES = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "out_proj",
    "o_proj": "out_proj",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "fc2",
    "down_proj": "fc2",
    "sdpa": "attention",
    "attention_core": "attention",
}
MAX_EVERY = 1000
# Frameworks whose layers are PyTorch modules a selective-checkpoint policy can wrap
# (Megatron-LM's are too, but it offers no hook for a policy: its recompute options are whole
# layers and --recompute-modules).
POLICY_FRAMEWORKS = ("torchtitan", "hf", "deepspeed")


class PolicyError(InputError):
    """A per-op policy that names no unit, or does not fit the model."""


@dataclass(frozen=True)
class Unit:
    """One op of a layer as eager code runs it: its output, whether it is a matmul (aten.mm),
    and the table op (`Op`, with only this unit's GEMM or memory traffic) it re-runs as."""

    name: str
    output_bytes: int
    op: Op
    matmul: bool = False


@dataclass(frozen=True)
class OpPolicy:
    """Which unit outputs a checkpointed layer keeps: `names`, every matmul (`every` 0: none,
    1: all) or all matmuls but each `every`-th (torchtitan's rule with `every` 2)."""

    names: frozenset[str] = frozenset()
    every: int = 0  # 0: no matmul rule; 1: every matmul; K: all but each K-th

    def keeps(self, unit: Unit, matmul_index: int) -> bool:
        """Whether the policy keeps `unit`, the `matmul_index`-th matmul (from 1) if one."""
        if unit.name in self.names:
            return True
        if not unit.matmul or self.every == 0:
            return False
        return self.every == 1 or matmul_index % self.every != 0


def parse_policy(text: str) -> OpPolicy:
    """`sac:ITEM,...` (`sac` alone: torchtitan's) into an `OpPolicy`; a one-line error
    otherwise."""
    body = TORCHTITAN_POLICY if text == "sac" else text
    items = body.removeprefix(POLICY_PREFIX).split(",")
    names: set[str] = set()
    every = 0
    for raw in items:
        item = raw.strip()
        match = re.fullmatch(r"matmuls(?:%([0-9]{1,6}))?", item)
        if match:
            size = int(match.group(1)) if match.group(1) else 1
            if not 1 <= size <= MAX_EVERY:
                raise PolicyError(
                    f"policy {quote(text)}: matmuls%K needs K in 1..{MAX_EVERY}, got {size}"
                )
            every = size
            continue
        name = UNIT_ALIASES.get(item, item)
        if name not in UNIT_NAMES:
            raise PolicyError(
                f"policy {quote(text)}: unknown op {quote(item)}; expected matmuls, matmuls%K "
                f"or one of {', '.join(UNIT_NAMES)}"
            )
        names.add(name)
    return OpPolicy(frozenset(names), every)


def policy_text(policy: OpPolicy) -> str:
    """The canonical `sac:...` spelling of `policy` (units in layer order)."""
    items = (
        [] if policy.every == 0 else ["matmuls" if policy.every == 1 else f"matmuls%{policy.every}"]
    )
    items += [name for name in UNIT_NAMES if name in policy.names]
    return POLICY_PREFIX + ",".join(items)


def is_policy(group: str) -> bool:
    """Whether a recompute group name is a per-op policy (`sac:...`)."""
    return group.startswith(POLICY_PREFIX)


def check_policy_model(spec: ChainSpec) -> str | None:
    """Why a per-op policy cannot be evaluated on `spec`'s layers, or None."""
    if spec.kind != "transformer":
        return "per-op policies apply to kind: transformer"
    if spec.experts or spec.mla:
        return "per-op policies are modelled for dense layers without latent attention"
    if spec.attention != "flash":
        return "per-op policies are modelled with attention: flash (the SDPA kernels)"
    if spec.dropout > 0:
        return "per-op policies are modelled without dropout"
    if spec.training != "full":
        # adapters add matmuls of their own, which an every-K-th rule would count
        return f"per-op policies are modelled for training: full, not {spec.training}"
    if spec.framework not in POLICY_FRAMEWORKS:
        return (
            f"per-op policies run where the layers are PyTorch modules (framework: "
            f"{', '.join(POLICY_FRAMEWORKS)}); {spec.framework} recomputes whole layers or its "
            "modules"
        )
    return None


def _split(op: Op, name: str, matmul: Matmul, forward_bytes: int = 0) -> Op:
    """The part of table op `op` that is one GEMM of `matmul`'s shape (derived: 2·m·n·k)."""
    flops = 2 * matmul.m * matmul.n * matmul.k * matmul.batch
    return dataclasses.replace(
        op,
        name=name,
        saved_bytes=0,
        forward_flops=flops,
        backward_flops=2 * flops,
        matmul=matmul,
        forward_bytes=forward_bytes,
        backward_bytes=0,
        tp_comm=None,
    )


def _elementwise(op: Op, name: str, forward_bytes: int) -> Op:
    """The memory-bound part of table op `op` (its norm, activation or residual add)."""
    return dataclasses.replace(
        op,
        name=name,
        saved_bytes=0,
        forward_flops=0,
        backward_flops=0,
        matmul=None,
        forward_bytes=forward_bytes,
        backward_bytes=0,
        tp_comm=None,
        fused_kernel=False,
    )


@cached_by_chain(maxsize=256)
def unit_ops(spec: ChainSpec, kind: LayerKind | None = None) -> tuple[Unit, ...]:
    """The units of one dense layer of `spec` in forward order (torchtitan's and Hugging Face's
    Llama blocks): norm1, q/k/v projections, QK-norm, RoPE, attention, out_proj, its
    reduce-scatter (tensor parallel with sequence parallelism) and residual add, norm2, fc1 (or
    gate_proj, up_proj), the activation, fc2, its reduce-scatter and residual add.

    Output bytes (derived from the shapes of `ops.transformer_layer_ops`): a norm's, a residual
    add's and a reduce-scatter's are the residual stream on this rank; a projection's is its
    (s·b/cp, width) result before any reduce-scatter (a row-parallel GEMM produces partial sums
    over all tokens); the attention kernel's its output O and the fp32 logsumexp (a·s·b
    values). RoPE has no table op: its re-run is not timed. Units carry no tensor-parallel
    collective (`policy_comm_ops` says which collectives a re-forward repeats).
    """
    kind = representative_kind(spec) if kind is None else kind
    table = {op.name: op for op in layer_ops(spec, kind)}
    shapes = LayerShapes.of(spec)
    B, tokens, X = shapes.B, shapes.tokens, shapes.X
    heads_r, kv_r, d = spec.heads // spec.tp, kv_heads_per_rank(spec), spec.head_dim
    d_q, d_kv = B * tokens * heads_r * d, B * tokens * kv_r * d  # (s, b, a/t, d), (s, b, g/t, d)
    hidden = B * tokens * shapes.sharded(spec.ffn_hidden)  # (s, b, F/t)
    row_output = B * tokens * spec.hidden  # (s, b, h) partial sums before the reduce-scatter
    scatter = spec.tp > 1 and spec.sp

    def norm(name: str) -> Unit:
        return Unit(name, X, _elementwise(table[name], name, table[name].forward_bytes))

    def projection(name: str, op: Op, width: int, size: int) -> Unit:
        return Unit(name, size, _split(op, name, dataclasses.replace(op.matmul, n=width)), True)

    def row_parallel(name: str) -> list[Unit]:
        op = table[name]
        units = [projection(name, op, op.matmul.n, row_output)]
        if scatter:
            units.append(Unit("reduce_scatter", X, _elementwise(op, "reduce_scatter", 0)))
        return [*units, Unit(f"{name}_add", X, _elementwise(op, f"{name}_add", op.forward_bytes))]

    qkv, core = table["qkv_proj"], table["attention_core"]
    units = [
        norm("norm1"),
        projection("q_proj", qkv, heads_r * d, d_q),
        projection("k_proj", qkv, kv_r * d, d_kv),
        projection("v_proj", qkv, kv_r * d, d_kv),
    ]
    if spec.qk_norm:
        qk = table["qk_norm"]
        units.append(Unit("qk_norm", d_q + d_kv, _elementwise(qk, "qk_norm", qk.forward_bytes)))
    logsumexp = FP32_BYTES * shapes.sharded(tokens * spec.heads)
    units += [
        Unit("rope", d_q + d_kv, _elementwise(qkv, "rope", 0)),
        Unit("attention", d_q + logsumexp, dataclasses.replace(core, saved_bytes=0)),
        *row_parallel("out_proj"),
        norm("norm2"),
    ]
    fc1, act = table["fc1"], table["act"]
    if spec.mlp == "gelu":
        units.append(projection("fc1", fc1, fc1.matmul.n, hidden))
    else:
        # torchtitan w2(silu(w1(x)) * w3(x)), Hugging Face down(act(gate(x)) * up(x)): the
        # gate GEMM runs before the up GEMM (the order an every-K-th rule counts).
        half = fc1.matmul.n // 2
        units += [
            projection("gate_proj", fc1, half, hidden),
            projection("up_proj", fc1, half, hidden),
        ]
    units.append(Unit("act", hidden, _elementwise(act, "act", act.forward_bytes)))
    return (*units, *row_parallel("fc2"))


def policy_comm_ops(
    spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None
) -> tuple[Op, ...]:
    """The table ops whose forward tensor-parallel collectives a re-forward under `policy`
    repeats: the input all-gathers of the column-parallel projections (never kept), and the
    row-parallel outputs' reduce-scatters unless the policy keeps them (an all-reduce, without
    sequence parallelism, always)."""
    scatter_kept = "reduce_scatter" in kept_units(spec, policy, kind)
    return tuple(
        op
        for op in layer_ops(spec, representative_kind(spec) if kind is None else kind)
        if op.tp_comm == "column" or (op.tp_comm == "row" and not (scatter_kept and spec.sp))
    )


@cached_by_chain(maxsize=256)
def kept_units(spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None) -> tuple[str, ...]:
    """The units whose outputs `policy` keeps in one layer. Under FP8 precision the linear
    layers run scaled FP8 GEMMs (`torch._scaled_mm`, Transformer Engine's kernels), which the
    matmul rule does not match: torchtitan's list names `aten.mm` only."""
    counting = spec.precision not in ("fp8", "float8")
    kept, index = [], 0
    for unit in unit_ops(spec, kind):
        if unit.matmul and counting:
            index += 1
            if policy.keeps(unit, index):
                kept.append(unit.name)
        elif unit.name in policy.names:
            kept.append(unit.name)
    return tuple(kept)


def policy_tape_bytes(spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None) -> int:
    """What a layer under `policy` holds from its forward to its backward: its input (the
    checkpoint's argument, the residual stream) and the kept outputs (derived: the
    selective-checkpoint cache holds one storage per kept output)."""
    kept = set(kept_units(spec, policy, kind))
    units = unit_ops(spec, kind)
    return LayerShapes.of(spec).X + sum(unit.output_bytes for unit in units if unit.name in kept)


def skips_rerun(unit: Unit) -> bool:
    """Whether keeping `unit`'s output spares its re-run: a matmul or the attention kernel,
    one op whose output is what the ops after it need. A norm, an activation or a residual add
    is several aten ops in eager code (an upcast, a mean, an rsqrt, a multiply; silu and a
    multiply) whose inner outputs its backward reads: keeping the last one spares their re-run
    nothing (derived from PyTorch's selective checkpointing, which caches op by op)."""
    return unit.matmul or unit.name == "attention"


def recomputed_ops(
    spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None
) -> tuple[Op, ...]:
    """The ops the backward re-runs under `policy`: every unit but the kept matmuls and
    attention kernel (`skips_rerun`)."""
    kept = set(kept_units(spec, policy, kind))
    return tuple(
        unit.op for unit in unit_ops(spec, kind) if unit.name not in kept or not skips_rerun(unit)
    )


def recomputed_forward_flops(
    spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None
) -> int:
    """Forward FLOPs of the re-run ops (matmuls and the attention core only, as everywhere)."""
    return sum(op.forward_flops for op in recomputed_ops(spec, policy, kind))
