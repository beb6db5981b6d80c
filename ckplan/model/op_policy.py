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
layer. Its Llama block runs wq, wk, wv, wo, w1, w3, w2 in that order, so it keeps the outputs
of wq, wv, w1 and w2 and recomputes wk, wo and w3, the norms, RoPE and the SwiGLU product.
torchao's float8 linears (`Float8Linear`, torchao/float8/float8_linear.py at eab345c and since)
call `torch.mm` on their float8 tensor subclass: the selective-checkpoint dispatch mode sees
that `aten.mm` before the subclass turns it into `aten._scaled_mm`, so the policy counts and
keeps those GEMMs' bf16 outputs as it keeps bf16 ones (`counts_matmuls`). Under torch.compile
a kept output that no backward reads is not saved (`compile_unread_bytes`). The list of
December 2024 (torchtitan/parallelisms/parallelize_llama.py at 9dec370) also named `aten.abs`,
whose full-size outputs (|x| of every float8 linear's input and weight) the eager cache holds;
compiled with tensorwise scaling they are not saved (`aten.max` is), with rowwise scaling
(`aten.amax`, not listed) they are, which torchtitan removed in 88247277c (February 2025).
ckplan's `sac` is the list without `aten.abs`.
Its DeepSeek-V3 and Llama 4 lists (torchtitan/models/{deepseek_v3,llama4}/infra/parallelize.py
at v0.2.2) add `all_to_all_single`, the expert-parallel dispatch and combine; the experts run as
`torch._grouped_mm`, which neither list names: torchtitan re-runs them, and the mm counter sees
only the router's gate and the shared experts' linears among the MoE block's GEMMs.

A policy is written `sac:ITEM,ITEM,...` (docs/strategies.md): an item names a unit op of the
layer (`UNIT_NAMES`), `matmuls` keeps every matmul output, `matmuls%K` every one but each K-th
(torchtitan: `matmuls%2`). `sac` alone is torchtitan 0.2's policy, `TORCHTITAN_POLICY`;
`sac-fused` 0.3.0's, `TORCHTITAN_03_POLICY`.

ckplan's op table fuses what eager code runs as several modules (one QKV projection, one fc1 for
gate and up); `unit_ops` splits them into the units a policy sees, each a table `Op` with its own
GEMM or memory traffic, so times and FLOPs of what is recomputed follow from the same roofline as
the rest. The element-wise units (norms, RoPE, the residual adds, the activation and, in eager
gated MLPs, the silu before the product) can be kept too: every Megatron-Core recompute module
set is then a policy (keep every unit a backward reads but the module's).

What a layer's backward re-runs (`rerun_mask`, `replays`) depends on how the framework runs it.
Eager PyTorch's checkpoint replays the layer's code up to the last tensor the backward reads
(torch/utils/checkpoint.py at v2.13.0, `early_stop`; torchtitan turns early stop off and replays
to the end of the layer): every op a policy does not keep runs again, also those whose outputs
feed only kept ones (q and k before a kept RoPE, out_proj before a kept residual add). Under
torch.compile (`kernels: compiled`) the partitioned backward re-runs only the units whose
outputs a backward reads (each table op saves its inputs: `Unit.saves`) or whose backward reads
tensors of their own (`Unit.internal`), not kept, and what those read that is not kept, back to
the layer input. The bytes a policy keeps are exact against PyTorch's selective checkpoint
(tests/test_op_policy.py).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from itertools import pairwise

from ckplan.errors import InputError
from ckplan.model.layers import LayerKind, distinct_kinds
from ckplan.model.moe import (
    INDEX_BYTES,
    combine_weighting_saved,
    received_rows,
    routed_rows,
    sent_rows,
    weighting_inputs_moved,
)
from ckplan.model.op import FP32_BYTES, LayerShapes, Matmul, Op, kv_heads_per_rank
from ckplan.model.ops import layer_ops, representative_kind
from ckplan.model.parts import cached_by_chain, cached_hash
from ckplan.model.spec import ChainSpec
from ckplan.quoting import quote

POLICY_PREFIX = "sac:"
TORCHTITAN_ITEMS = ("matmuls%2", "attention", "reduce_scatter", "all_to_all")
TORCHTITAN_POLICY = POLICY_PREFIX + ",".join(TORCHTITAN_ITEMS)
# The policy word of torchtitan 0.3.0's SelectiveAC on its Llama 3 block (`FUSED_QKV`,
# `FLEX_ATTENTION`): one fused wqkv GEMM counted by the every-second-mm rule, and FlexAttention's
# compiled region kept whole.
FUSED_QKV = "fused_qkv"
FLEX_ATTENTION = "flex_attention"
TORCHTITAN_03_WORD = "sac-fused"
TORCHTITAN_03_ITEMS = (FUSED_QKV, "matmuls%2", FLEX_ATTENTION, "reduce_scatter", "all_to_all")
TORCHTITAN_03_POLICY = POLICY_PREFIX + ",".join(TORCHTITAN_03_ITEMS)
# Policy words that stand for a whole policy.
POLICY_WORDS = {"sac": TORCHTITAN_POLICY, TORCHTITAN_03_WORD: TORCHTITAN_03_POLICY}
# The units FlexAttention's compiled region returns in an eager layer (`flex_region_copy_bytes`
# adds V's copy); in a compiled one (`kernels: compiled`) the block's graph holds the
# flex_attention operator, whose outputs are the attention's alone (`flex_units`).
FLEX_UNITS = ("rope", "attention")
FLEX_COMPILED_UNITS = ("attention",)
# Unit ops a policy may name, in the order a layer runs them: Llama-style attention or MLA's
# projections, then a dense MLP (gelu MLPs have fc1 where gated ones have gate_proj and up_proj)
# or an MoE block (router, routing, permutation, all-to-alls, experts, shared experts).
UNIT_NAMES = (
    "norm1",
    "q_down",
    "q_norm",
    "q_up",
    "q_proj",
    "k_proj",
    "v_proj",
    "kv_down",
    "kv_norm",
    "kv_up",
    "qk_norm",
    "rope",
    "attention",
    "out_proj",
    "reduce_scatter",
    "out_proj_add",
    "norm2",
    "fc1",
    "gate_proj",
    "up_proj",
    "gate_act",
    "act",
    "fc2",
    "fc2_add",
    "router",
    "router_probs",
    "permute",
    "dispatch",
    "expert_fc1",
    "expert_gate",
    "expert_up",
    "expert_act",
    "expert_fc2",
    "combine",
    "weighting_inputs",
    "shared_fc1",
    "shared_gate_proj",
    "shared_up_proj",
    "shared_gate_act",
    "shared_act",
    "shared_fc2",
    "unpermute",
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
    # MLA: torchtitan's DeepSeek-V3 (wq_a, wq_b, wkv_a, wkv_b) and Hugging Face's
    "wq_a": "q_down",
    "wq_b": "q_up",
    "wkv_a": "kv_down",
    "wkv_b": "kv_up",
    "q_a_proj": "q_down",
    "q_a_layernorm": "q_norm",
    "q_b_proj": "q_up",
    "kv_a_proj_with_mqa": "kv_down",
    "kv_a_layernorm": "kv_norm",
    "kv_b_proj": "kv_up",
    # MoE: torchtitan's router gate and grouped experts (w1, w3, w2)
    "gate": "router",
    "experts.w1": "expert_gate",
    "experts.w3": "expert_up",
    "experts.w2": "expert_fc2",
    "shared_experts.w1": "shared_gate_proj",
    "shared_experts.w3": "shared_up_proj",
    "shared_experts.w2": "shared_fc2",
}
# Items that name several units: torchtitan's save list names `all_to_all_single`, the
# expert-parallel dispatch and combine both.
GROUP_ITEMS = {"all_to_all": ("dispatch", "combine")}
MAX_EVERY = 1000
# Linears torchtitan's op policy re-runs without counting them among the matmuls:
# `per_op_sac_force_recompute_mm_shapes_by_fqns`, default ["moe.router.gate"]
# (torchtitan/config/job_config.py at v0.2.2, applied in distributed/activation_checkpoint.py).
FORCE_RECOMPUTED = ("router",)
# Frameworks whose layers are PyTorch modules a selective-checkpoint policy can wrap
# (Megatron-LM's are too, but it offers no hook for a policy: its recompute options are whole
# layers and --recompute-modules).
POLICY_FRAMEWORKS = ("torchtitan", "hf", "deepspeed")
# A scoped policy: `sac@` then checkpointed regions separated by `/`, each `REGION` (keeping
# nothing) or `REGION=ITEM,ITEM` (keeping those units' outputs).
SCOPED_PREFIX = "sac@"
# The regions a scoped policy may checkpoint, each a run of a layer's units that starts and ends
# at a module boundary of torchtitan's and Hugging Face's blocks (`region_spans`), in layer
# order: the first norm, the attention module (its projections to out_proj and the
# reduce-scatter), the attention kernel, the two together; the second norm; the dense MLP, its
# activation, the norm with the MLP; the MoE block (the router to the un-permutation), the norm
# with it, the router, the routed experts, their activation, the shared experts.
REGION_NAMES = (
    "norm1",
    "attention",
    "core_attn",
    "norm1_attention",
    "norm2",
    "mlp",
    "mlp_act",
    "norm2_mlp",
    "moe",
    "norm2_moe",
    "router",
    "experts",
    "moe_act",
    "shared_experts",
)


class PolicyError(InputError):
    """A per-op policy that names no unit, or does not fit the model."""


@dataclass(frozen=True)
class Unit:
    """One op of a layer as eager code runs it: its output, whether it is a matmul (aten.mm) or
    a grouped GEMM, and the table op (`Op`, with only this unit's GEMM or memory traffic) it
    re-runs as.

    `reads` and `saves` are the units (indices into the layer's unit list) whose outputs it
    reads and whose outputs its backward reads (none: only the layer input); `internal` the
    bytes its backward reads that only its own forward produces (a norm's statistics and
    normalised input in eager code, the routing's scores), kept with its output."""

    __hash__ = cached_hash  # a cache key, hashed on every lookup

    name: str
    output_bytes: int
    op: Op
    matmul: bool = False
    grouped: bool = False  # a grouped GEMM (aten._grouped_mm: torchtitan's experts), not aten.mm
    reads: tuple[int, ...] = ()
    saves: tuple[int, ...] = ()
    internal: int = 0
    # bytes of its output that only its own backward reads (the attention kernel's logsumexp):
    # held where the unit is kept or runs un-checkpointed, not where a reader holds its output
    private: int = 0
    # an expert GEMM's input as the op table saves it, the R routed rows (`moe.routed_rows`):
    # the received rows all-gathered over etp, or the permuted copies on the worst-case rows
    expert_input: int = 0
    # under torchtitan's sequence parallelism, what the all-gathered norm output this
    # projection saves adds to that output (`op.column_parallel_saved_input_bytes` less X): held
    # once per norm where the projections run un-checkpointed; a checkpointed region re-runs
    # the all-gather, so neither a kept unit nor a region's input holds it
    gathered: int = 0

    @property
    def kept_bytes(self) -> int:
        """What keeping the unit adds to the tape: its output and its internal tensors."""
        return self.output_bytes + self.internal


@dataclass(frozen=True)
class OpPolicy:
    """Which unit outputs a checkpointed layer keeps: `names`, every matmul (`every` 0: none,
    1: all) or all matmuls but each `every`-th (torchtitan's rule with `every` 2).

    `fused_qkv`: the layer runs q, k and v as one GEMM (torchtitan 0.3.0's `FusedQKVLinear`),
    which the matmul rule counts once and keeps or re-runs whole. `flex`: the attention kernel is
    FlexAttention, kept as torchtitan 0.3.0's SelectiveAC keeps it (`flex_units`): in an eager
    layer its compiled region whole, the rotated Q and K, the output with its logsumexp and a
    contiguous copy of V (`flex_region_copy_bytes`); in a compiled layer the output and its
    logsumexp. `names` holds `attention` with it."""

    names: frozenset[str] = frozenset()
    every: int = 0  # 0: no matmul rule; 1: every matmul; K: all but each K-th
    fused_qkv: bool = False
    flex: bool = False
    # A scoped policy (`sac@REGION=ITEM,.../REGION`): the checkpointed regions (`REGION_NAMES`)
    # and the units each keeps; the layer's other units run un-checkpointed. Empty: the whole
    # layer is one region keeping `names` (and the matmul rule).
    scopes: tuple[tuple[str, frozenset[str]], ...] = ()

    def keeps(self, unit: Unit, matmul_index: int) -> bool:
        """Whether the policy keeps `unit`, the `matmul_index`-th matmul (from 1) if one."""
        if unit.name in self.names:
            return True
        if not unit.matmul or self.every == 0:
            return False
        return self.every == 1 or matmul_index % self.every != 0


def parse_policy(text: str) -> OpPolicy:
    """`sac:ITEM,...` (`sac` alone: torchtitan 0.2's, `sac-fused`: torchtitan 0.3.0's) or a
    scoped `sac@REGION=ITEM,.../REGION` into an `OpPolicy`; a one-line error otherwise."""
    if text.startswith(SCOPED_PREFIX):
        return _parse_scoped(text)
    body = POLICY_WORDS.get(text, text)
    items = body.removeprefix(POLICY_PREFIX).split(",")
    names: set[str] = set()
    every = 0
    fused = flex = False
    for raw in items:
        item = raw.strip()
        if item == FUSED_QKV:
            fused = True
            continue
        if item == FLEX_ATTENTION:
            flex = True
            names.update(FLEX_COMPILED_UNITS)  # the rest by the layer's kernels (`flex_units`)
            continue
        match = re.fullmatch(r"matmuls(?:%([0-9]{1,6}))?", item)
        if match:
            size = int(match.group(1)) if match.group(1) else 1
            if not 1 <= size <= MAX_EVERY:
                raise PolicyError(
                    f"policy {quote(text)}: matmuls%K needs K in 1..{MAX_EVERY}, got {size}"
                )
            every = size
            continue
        if item in GROUP_ITEMS:
            names.update(GROUP_ITEMS[item])
            continue
        name = UNIT_ALIASES.get(item, item)
        if name not in UNIT_NAMES:
            raise PolicyError(
                f"policy {quote(text)}: unknown op {quote(item)}; expected matmuls, matmuls%K, "
                f"{FUSED_QKV}, {FLEX_ATTENTION} or one of {', '.join((*UNIT_NAMES, *GROUP_ITEMS))}"
            )
        names.add(name)
    return OpPolicy(frozenset(names), every, fused_qkv=fused, flex=flex)


def _unit_name(text: str, item: str) -> str:
    """The unit `item` names (an alias resolved), or a one-line error."""
    name = UNIT_ALIASES.get(item, item)
    if name not in UNIT_NAMES:
        raise PolicyError(
            f"policy {quote(text)}: unknown op {quote(item)}; expected one of "
            f"{', '.join((*UNIT_NAMES, *GROUP_ITEMS))}"
        )
    return name


def _parse_scoped(text: str) -> OpPolicy:
    """`sac@REGION=ITEM,.../REGION` into an `OpPolicy` with `scopes`: region names from
    `REGION_NAMES`, each once; items unit names (or `all_to_all`)."""
    body = text.removeprefix(SCOPED_PREFIX)
    if not body.strip():
        raise PolicyError(
            f"policy {quote(text)}: name at least one region ({', '.join(REGION_NAMES)})"
        )
    scopes: dict[str, frozenset[str]] = {}
    for part in body.split("/"):
        region, sep, items = part.strip().partition("=")
        region = region.strip()
        if region not in REGION_NAMES:
            raise PolicyError(
                f"policy {quote(text)}: unknown region {quote(region)}; expected one of "
                f"{', '.join(REGION_NAMES)}"
            )
        if region in scopes:
            raise PolicyError(f"policy {quote(text)}: region {quote(region)} named twice")
        if sep and not items.strip():
            raise PolicyError(
                f"policy {quote(text)}: region {quote(region)} has '=' and no op after it; "
                f"expected {region}=OP,... or {region} alone (keeping nothing)"
            )
        names: set[str] = set()
        for raw in items.split(",") if items.strip() else ():
            item = raw.strip()
            # a group (all_to_all) names its units; looked up first, as no unit bears its name
            names.update(GROUP_ITEMS[item] if item in GROUP_ITEMS else (_unit_name(text, item),))
        scopes[region] = frozenset(names)
    order = {name: i for i, name in enumerate(REGION_NAMES)}
    return OpPolicy(scopes=tuple(sorted(scopes.items(), key=lambda kv: order[kv[0]])))


def policy_text(policy: OpPolicy) -> str:
    """The canonical `sac:...` (or `sac@...`) spelling of `policy` (units in layer order)."""
    if policy.scopes:
        order = {name: i for i, name in enumerate(UNIT_NAMES)}
        parts = []
        for region, names in policy.scopes:
            items = ",".join(sorted(names, key=order.__getitem__))
            parts.append(f"{region}={items}" if items else region)
        return SCOPED_PREFIX + "/".join(parts)
    items = [FUSED_QKV] if policy.fused_qkv else []
    items += (
        [] if policy.every == 0 else ["matmuls" if policy.every == 1 else f"matmuls%{policy.every}"]
    )
    names = set(policy.names)
    groups = dict(GROUP_ITEMS)
    if policy.flex:
        groups[FLEX_ATTENTION] = FLEX_COMPILED_UNITS
    for item, members in groups.items():
        if names.issuperset(members):
            names -= set(members)
            names.add(item)
    order = {name: i for i, name in enumerate(UNIT_NAMES)}
    order |= {item: order[members[0]] for item, members in groups.items()}
    items += sorted(names, key=order.__getitem__)
    return POLICY_PREFIX + ",".join(items)


def flex_units(spec: ChainSpec) -> tuple[str, ...]:
    """The units the `flex_attention` item keeps on `spec`'s layers.

    Eager layers (`FLEX_UNITS`): torchtitan 0.3.0 runs FlexAttention compiled as a region of
    its own, which the selective checkpoint sees as one `inductor_compiled_code` op and caches
    whole, the rotated Q and K among its outputs (tests/test_torchtitan_sac.py).
    Compiled layers (`FLEX_COMPILED_UNITS`): torchtitan compiles each block after wrapping it
    (torchtitan/models/llama3/parallelize.py, `apply_compile` after `ac_config.build().apply`,
    in the wheel torchtitan-0.3.0-py3-none-any.whl), so the block's graph holds the
    `flex_attention` operator, which SelectiveAC's save list names
    (`torch._higher_order_ops.flex_attention`); the policy tags it MUST_SAVE and RoPE's ops
    PREFER_RECOMPUTE, and the min-cut partitioner saves the operator's output and logsumexp
    and rebuilds the rotated Q and K from wqkv's kept output; V is a view of it. Measured on the
    CPU with torch 2.13 (tests/test_torchtitan_sac.py: the partitioned forward graph saves
    45,568 bytes in fp32, 23,040 in bf16)."""
    return FLEX_COMPILED_UNITS if spec.kernels == "compiled" else FLEX_UNITS


def effective_policy(spec: ChainSpec, policy: OpPolicy) -> OpPolicy:
    """`policy` with the units its `flex_attention` item keeps on `spec` (`flex_units`)."""
    if not policy.flex:
        return policy
    return dataclasses.replace(policy, names=policy.names | set(flex_units(spec)))


def is_policy(group: str) -> bool:
    """Whether a recompute group name is a per-op policy (`sac:...` or scoped `sac@...`)."""
    return group.startswith((POLICY_PREFIX, SCOPED_PREFIX))


def check_policy_model(spec: ChainSpec) -> str | None:
    """Why a per-op policy cannot be evaluated on `spec`'s layers, or None."""
    if spec.kind != "transformer":
        return "per-op policies apply to kind: transformer"
    if spec.shared_expert_gate:
        return "per-op policies are modelled without a shared-expert gate"
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
    """The units of one layer of `spec` in forward order (torchtitan's and Hugging Face's
    blocks): norm1, the attention projections (q/k/v, or MLA's, `_mla_units`), QK-norm, RoPE,
    attention, out_proj, its reduce-scatter (tensor parallel with sequence parallelism) and
    residual add, norm2, then the dense MLP (fc1, or gate_proj, up_proj; the activation; fc2,
    its reduce-scatter and residual add) or the MoE block (`_moe_units`).

    Output bytes (derived from the shapes of `ops.transformer_layer_ops`): a norm's, a residual
    add's and a reduce-scatter's are the residual stream on this rank; a projection's is its
    (s·b/cp, width) result before any reduce-scatter (a row-parallel GEMM produces partial sums
    over all tokens); the attention kernel's its output O and the fp32 logsumexp (a·s·b
    values). RoPE has no table op: its unit is timed by the bytes it moves
    (`rope_moved_bytes`). Units carry no tensor-parallel collective (`policy_comm_ops` says
    which collectives a re-forward repeats).
    """
    kind = representative_kind(spec) if kind is None else kind
    table = {op.name: op for op in layer_ops(spec, kind)}
    shapes = LayerShapes.of(spec)
    B, tokens, X = shapes.B, shapes.tokens, shapes.X
    heads_r = spec.heads // spec.tp
    row_output = B * tokens * spec.hidden  # (s, b, h) partial sums before the reduce-scatter
    scatter = spec.tp > 1 and spec.sp

    def norm(name: str) -> Unit:
        return Unit(name, X, _elementwise(table[name], name, table[name].forward_bytes))

    def row_parallel(name: str, add: bool = True) -> list[Unit]:
        op = table[name]
        units = [_projection(name, op, op.matmul.n, row_output)]
        if scatter:
            units.append(Unit("reduce_scatter", X, _elementwise(op, "reduce_scatter", 0)))
        if add:
            units.append(Unit(f"{name}_add", X, _elementwise(op, f"{name}_add", op.forward_bytes)))
        return units

    units = [norm("norm1")]
    if spec.mla:
        units += _mla_units(spec, table, shapes)
        context = B * tokens * heads_r * spec.v_head_dim
        rope_output = B * tokens * heads_r * 2 * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        rope_op = _elementwise(table["kv_up"], MLA_ROPE, rope_moved_bytes(spec, shapes))
    else:
        kv_r, d = kv_heads_per_rank(spec), spec.head_dim
        d_q, d_kv = B * tokens * heads_r * d, B * tokens * kv_r * d  # (s, b, a/t, d), g heads
        qkv = table["qkv_proj"]
        units += [
            _projection("q_proj", qkv, heads_r * d, d_q),
            _projection("k_proj", qkv, kv_r * d, d_kv),
            _projection("v_proj", qkv, kv_r * d, d_kv),
        ]
        if spec.qk_norm:
            qk = table["qk_norm"]
            units.append(Unit("qk_norm", d_q + d_kv, _elementwise(qk, "qk_norm", qk.forward_bytes)))
        context, rope_output = d_q, d_q + d_kv
        rope_op = _elementwise(qkv, "rope", rope_moved_bytes(spec, shapes))
    logsumexp = FP32_BYTES * shapes.sharded(tokens * spec.heads)
    units += [
        Unit("rope", rope_output, rope_op),
        Unit(
            "attention",
            context + logsumexp,
            dataclasses.replace(table["attention_core"], saved_bytes=0),
            private=logsumexp,
        ),
        *row_parallel("out_proj"),
        norm("norm2"),
    ]
    if kind.moe:
        units += _moe_units(spec, table, shapes)
        if spec.shared_ffn_hidden:
            units += _mlp_units(spec, table, shapes, "shared_")
            units += row_parallel("shared_fc2", add=False)
        # the un-permutation's scatter-add, the shared experts' add and the residual add
        back = table["unpermute"]
        rest = back.forward_bytes - weighting_inputs_moved(spec, shapes)
        units.append(Unit("unpermute", X, _elementwise(back, "unpermute", rest)))
        return _wired(spec, table, tuple(units))
    units += _mlp_units(spec, table, shapes, "")
    return _wired(spec, table, (*units, *row_parallel("fc2")))


# The table op name of MLA's RoPE unit: the rotation and the assembly of Q and K
# (`rope_moved_bytes`), which eager code does not run as Llama's RoPE kernels.
MLA_ROPE = "mla_rope"


def rope_moved_bytes(spec: ChainSpec, shapes: LayerShapes) -> int:
    """Bytes the forward of the `rope` unit reads and writes on this rank, memory-bound as the
    other element-wise units (the roofline times them by these bytes).

    Q and K heads (derived): RoPE reads Q and K and writes them rotated, 2·(Q + K) bytes, one
    fused kernel's traffic (4 bytes per bf16 element; eager code moves
    `hardware.code_path.eager_rope_bytes` per element instead). The cos/sin table (s·d/2
    values, shared by every head and sequence) is left out, as there.

    MLA (derived from torchtitan's DeepSeek-V3 Attention at v0.2.2,
    models/deepseek_v3/model/model.py, the assembly as `model.mla` counts it): RoPE reads and
    writes q_pe (a/t heads) and the shared k_pe, 2·(a/t + 1)·d_rope per token; `cat([q_nope,
    q_pe])` reads and writes Q (2·Q); `cat([k_nope, k_pe expanded])` reads K's no-RoPE part and
    the shared key and writes K."""
    B, tokens = shapes.B, shapes.tokens
    heads_r = spec.heads // spec.tp
    if spec.mla:
        nope, rope = spec.qk_nope_head_dim, spec.qk_rope_head_dim
        qk = B * tokens * heads_r * (nope + rope)  # Q, and K at a/t heads
        rotated = 2 * B * tokens * (heads_r + 1) * rope
        return rotated + 2 * qk + B * tokens * heads_r * nope + B * tokens * rope + qk
    d = spec.head_dim
    return 2 * B * tokens * (heads_r + kv_heads_per_rank(spec)) * d


_NORMS = ("norm1", "norm2")
_FIRST_AFTER_NORM1 = ("q_proj", "k_proj", "v_proj", "q_down", "kv_down")
_AFTER_NORM2 = ("fc1", "gate_proj", "up_proj", "router", "shared_fc1", "shared_gate_proj",
                "shared_up_proj")  # fmt: skip


def _wired(spec: ChainSpec, table: dict[str, Op], units: tuple[Unit, ...]) -> tuple[Unit, ...]:
    """`units` with what each reads, what its backward reads and its internal bytes (derived:
    each op of `ops.transformer_layer_ops` saves its inputs, as the op table's saved bytes
    count them; a projection saves its input, the attention kernel Q, K, V and its output, an
    activation its inputs, a norm its input and, in eager code, its statistics and normalised
    input (the table norm's saved bytes beyond its input), the routing its scores and indices,
    the permutation its sorted indices). Reading the layer input is reading no unit."""
    X = LayerShapes.of(spec).X
    last: dict[str, int] = {}
    wired: list[Unit] = []

    def at(*names: str) -> tuple[int, ...]:
        return tuple(last[name] for name in names if name in last)

    def out(indices: tuple[int, ...]) -> int:
        return sum(units[i].output_bytes for i in indices)

    for i, unit in enumerate(units):
        name, reads, saves, internal, gathered = unit.name, (), (), 0, 0
        bare = name.removeprefix("shared_")
        if name in _NORMS:
            reads = saves = at("out_proj_add") if name == "norm2" else ()
            internal = max(0, table[name].saved_bytes - X)
        elif name in _FIRST_AFTER_NORM1 and "norm2" not in last:
            reads = saves = at("norm1")
            gathered = _gathered_beyond(spec, table, name, "qkv_proj", X)
        elif name in ("q_norm", "kv_norm"):
            reads = saves = at(name.replace("norm", "down"))
            internal = max(0, table[name].saved_bytes - out(saves))
        elif name in ("q_up", "kv_up"):
            reads = saves = at(name.replace("up", "norm"))
        elif name == "qk_norm":
            reads = saves = at("q_proj", "k_proj")
            internal = max(0, table[name].saved_bytes - out(saves))
        elif name == "rope":
            if spec.mla:
                reads = at("q_up", "kv_down") if "q_up" in last else at("q_proj", "kv_down")
            else:
                reads = at("qk_norm") or at("q_proj", "k_proj")
        elif name == "attention":
            reads = at("rope", "kv_up" if spec.mla else "v_proj")
            saves = (*reads, i)  # Q, K, V and its own output O and logsumexp
        elif name == "out_proj":
            reads = saves = at("attention")
        elif name in ("reduce_scatter", "dispatch", "combine", "out_proj_add"):
            reads = (i - 1,)
        elif name == "weighting_inputs":
            reads = (i - 1, *at("router_probs"))
        elif name in _AFTER_NORM2:
            reads = saves = at("norm2")
            gathered = _gathered_beyond(spec, table, name, "fc1", X)
        elif bare == "gate_act" or name == "expert_gate_act":
            reads = saves = (i - 1 - (not name.startswith("expert")),)  # the gate projection
        elif bare == "act":
            gated = at(f"{name[:-3]}gate_act") or at(f"{name[:-3]}gate_proj")
            reads = saves = (
                at(f"{name[:-3]}fc1")
                if spec.mlp == "gelu"
                else (*gated, *at(f"{name[:-3]}up_proj"))
            )
            # the table's activation also saves what its silu read (the gate)
            inner = at(f"{name[:-3]}gate_proj") if at(f"{name[:-3]}gate_act") else ()
            internal = max(0, table[name].saved_bytes - out(saves) - out(inner))
        elif name in ("fc2", "shared_fc2", "expert_fc2"):
            reads = saves = (i - 1,)
        elif name == "fc2_add":
            reads = (i - 1, *at("out_proj_add"))
        elif name == "router_probs":
            # its output (top-k scores and indices) is part of what the table's routing saves
            reads = at("router")
            internal = max(0, table[name].saved_bytes - unit.output_bytes)
        elif name == "permute":
            reads, internal = at("norm2", "router_probs"), table[name].saved_bytes
        elif name in ("expert_fc1", "expert_gate", "expert_up"):
            reads = saves = at("dispatch") if spec.ep > 1 else at("permute")
        elif name == "expert_act":
            reads = saves = (
                at("expert_fc1") if spec.mlp == "gelu" else at("expert_gate", "expert_up")
            )
            internal = max(0, table[name].saved_bytes - out(saves))
        elif name == "unpermute" and "weighting_inputs" in last:
            # torchtitan's product of the experts' outputs and their scores in fp32 saves its
            # two inputs, the `weighting_inputs` unit's output (`moe.combine_weighting_saved`)
            saves = at("weighting_inputs")
            reads = tuple(dict.fromkeys((i - 1, *saves, *at("router_probs", "out_proj_add"))))
        elif name == "unpermute":
            reads = (i - 1, *at("router_probs", "out_proj_add"))
            # weighting the outputs by their scores (`moe.combine_weighting_saved`): Hugging
            # Face's product saves expert_fc2's output itself
            saves = (i - 1,) if spec.framework == "hf" else ()
            internal = max(0, table[name].saved_bytes - out(saves))
        last[name] = i
        wired.append(
            dataclasses.replace(
                unit, reads=reads, saves=saves, internal=internal, gathered=gathered
            )
        )
    return tuple(wired)


def _gathered_beyond(spec: ChainSpec, table: dict[str, Op], name: str, op: str, X: int) -> int:
    """What the table's `op` (qkv_proj or fc1) saves of its input beyond the norm's output X
    when `name` is one of its projections: torchtitan's all-gathered sequence under sequence
    parallelism (`op.column_parallel_saved_input_bytes`), else 0."""
    if name not in ("q_proj", "k_proj", "v_proj", "fc1", "gate_proj", "up_proj") or op not in table:
        return 0
    return max(0, table[op].saved_bytes - X)


def _projection(name: str, op: Op, width: int, size: int) -> Unit:
    """One linear layer's GEMM (an aten.mm) of table op `op`, `width` columns of its output."""
    return Unit(name, size, _split(op, name, dataclasses.replace(op.matmul, n=width)), True)


def _mlp_units(spec: ChainSpec, table: dict[str, Op], shapes: LayerShapes, prefix: str):
    """fc1 (or gate_proj, up_proj) and the activation of the dense MLP (`prefix` ""), or of the
    shared experts (`prefix` "shared_", over every token of the layer, F_s/t wide)."""
    ffn = spec.shared_ffn_hidden if prefix else spec.ffn_hidden
    hidden = shapes.B * shapes.sharded(shapes.tokens * ffn)  # (s, b, F/t)
    fc1, act = table[f"{prefix}fc1"], table[f"{prefix}act"]
    if spec.mlp == "gelu":
        units = [_projection(f"{prefix}fc1", fc1, fc1.matmul.n, hidden)]
    else:
        # torchtitan w2(silu(w1(x)) * w3(x)), Hugging Face down(act(gate(x)) * up(x)): the
        # gate GEMM runs before the up GEMM (the order an every-K-th rule counts).
        half = fc1.matmul.n // 2
        units = [
            _projection(f"{prefix}gate_proj", fc1, half, hidden),
            _projection(f"{prefix}up_proj", fc1, half, hidden),
        ]
    name = f"{prefix}act"
    if spec.mlp != "gelu" and act.saved_bytes >= 3 * hidden:
        # eager silu(gate) * up (torch's SiLU, then aten.mul): the product's backward reads
        # silu(gate), a tensor of its own; the silu reads the gate and writes it (2F bytes)
        gate = f"{prefix}gate_act"
        units.append(Unit(gate, hidden, _elementwise(act, gate, 2 * hidden)))
        return [*units, Unit(name, hidden, _elementwise(act, name, act.forward_bytes - 2 * hidden))]
    return [*units, Unit(name, hidden, _elementwise(act, name, act.forward_bytes))]


def _mla_units(spec: ChainSpec, table: dict[str, Op], shapes: LayerShapes) -> list[Unit]:
    """MLA's projections (`model.mla`; torchtitan's DeepSeek-V3 Attention at v0.2.2 runs wq_a,
    q_norm, wq_b, then wkv_a, kv_norm, wkv_b, each linear one aten.mm): q_down (the query
    latent, s·b/t x q_lora_rank under sequence parallelism), q_norm, q_up (Q, a/t heads of
    qk_nope + qk_rope), or q_proj without a query latent; kv_down (the KV latent and the shared
    RoPE key, kv_lora_rank + qk_rope wide), kv_norm (the latent), kv_up (K's no-RoPE part and
    V, a/t heads of qk_nope + v_head_dim). Output bytes from the op table's shapes (derived)."""
    B, local, tokens = shapes.B, shapes.stream_tokens, shapes.tokens
    heads_r = spec.heads // spec.tp
    nope, rope = spec.qk_nope_head_dim, spec.qk_rope_head_dim
    d_q = B * tokens * heads_r * (nope + rope)
    units = []
    if spec.q_lora_rank:
        latent = B * local * spec.q_lora_rank
        q_norm = table["q_norm"]
        units += [
            _projection("q_down", table["q_down"], spec.q_lora_rank, latent),
            Unit("q_norm", latent, _elementwise(q_norm, "q_norm", q_norm.forward_bytes)),
            _projection("q_up", table["q_up"], table["q_up"].matmul.n, d_q),
        ]
    else:
        units.append(_projection("q_proj", table["q_proj"], table["q_proj"].matmul.n, d_q))
    kv_latent = B * local * spec.kv_lora_rank
    kv_norm, kv_up = table["kv_norm"], table["kv_up"]
    return [
        *units,
        _projection(
            "kv_down", table["kv_down"], spec.kv_lora_rank + rope, kv_latent + B * local * rope
        ),
        Unit("kv_norm", kv_latent, _elementwise(kv_norm, "kv_norm", kv_norm.forward_bytes)),
        _projection(
            "kv_up", kv_up, kv_up.matmul.n, B * tokens * heads_r * (nope + spec.v_head_dim)
        ),
    ]


def _moe_units(spec: ChainSpec, table: dict[str, Op], shapes: LayerShapes) -> list[Unit]:
    """The routed part of an MoE block (`model.moe`), as torchtitan's MoE runs it
        (torchtitan/models/moe/moe.py at v0.2.2): the router's gate, an nn.Linear (one aten.mm) to
        the (T, E) logits; the routing (scores, top-k: the fp32 scores and int64 indices of T·k
        choices); the permutation of the S token copies (T·k dropless, h wide); with expert
        parallelism the dispatch all-to-all (`all_to_all_single`, R/etp rows received); the experts
        as `torch._grouped_mm` calls (w1 and w3, then w2 on silu(w1 x) · w3 x: R rows, F_e/etp and
        h wide), not aten.mm, so a matmul rule does not count them; the combine all-to-all (S rows
        back). The two all-to-alls are units `dispatch` and `combine`; the item `all_to_all` names
    both, as torchtitan's save list names the op.
        Output bytes from the op table's shapes (derived)."""
    B, T, h = shapes.B, shapes.stream_tokens, spec.hidden
    rows, sent = routed_rows(spec, shapes), sent_rows(spec, shapes)
    F = spec.moe_ffn_hidden // spec.etp
    router, probs, permute = table["router"], table["router_probs"], table["permute"]
    fc1, act, fc2 = table["expert_fc1"], table["expert_act"], table["expert_fc2"]

    def grouped(name: str, op: Op, width: int, size: int) -> Unit:
        matmul = dataclasses.replace(op.matmul, n=width)
        first = name != "expert_fc2"
        return Unit(
            name, size, _split(op, name, matmul), grouped=True, expert_input=first * B * rows * h
        )

    def all_to_all(name: str, op: Op, size: int) -> list[Unit]:
        if spec.ep == 1:
            return []
        return [Unit(name, size, _elementwise(op, name, 0))]

    units = [
        Unit("router", B * T * spec.experts, _split(router, "router", router.matmul), True),
        Unit(
            "router_probs",
            (FP32_BYTES + INDEX_BYTES) * T * spec.top_k,
            _elementwise(probs, "router_probs", probs.forward_bytes),
        ),
        Unit("permute", B * sent * h, _elementwise(permute, "permute", permute.forward_bytes)),
        *all_to_all("dispatch", permute, B * received_rows(spec, shapes) * h),
    ]
    if spec.mlp == "gelu":
        units.append(grouped("expert_fc1", fc1, F, B * rows * F))
    else:
        units += [
            grouped("expert_gate", fc1, F, B * rows * F),
            grouped("expert_up", fc1, F, B * rows * F),
        ]
    units += [
        Unit("expert_act", B * rows * F, _elementwise(act, "expert_act", act.forward_bytes)),
        grouped("expert_fc2", fc2, h, B * rows * h),
        *all_to_all("combine", table["unpermute"], B * sent * h),
    ]
    if spec.framework == "torchtitan":
        # the two tensors the combine's fp32 product saves, a unit of their own so that a
        # policy can keep them without the combine's output (`weighting_inputs_moved`)
        moved = weighting_inputs_moved(spec, shapes)
        weights = Unit(
            "weighting_inputs",
            combine_weighting_saved(spec, shapes),
            _elementwise(table["unpermute"], "weighting_inputs", moved),
        )
        units.append(weights)
    return units


# The projections a fused wqkv computes with q_proj, right after it in `unit_ops`.
FUSED_LATER = ("k_proj", "v_proj")


@cached_by_chain(maxsize=256)
def kept_mask(spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None) -> tuple[bool, ...]:
    """Whether `policy` keeps each unit of `unit_ops` (by name, or a matmul by the every-K-th
    rule). The matmul rule counts the GEMMs that reach the policy as `aten.mm`
    (`counts_matmuls`): Transformer Engine's FP8 kernels do not, torchao's float8 ones do. The
    router's gate is outside the matmul rule (`FORCE_RECOMPUTED`),
    kept only when named. With `policy.fused_qkv` the rule counts q, k and v as the one GEMM
    they are (torchtitan 0.3.0's `FusedQKVLinear`: `wqkv`), kept or re-run together."""
    if policy.scopes:
        units = unit_ops(spec, kind)
        spans = region_spans(spec, kind)
        mask = [False] * len(units)
        for region, names in policy.scopes:
            start, end = spans.get(region, (0, 0))
            for i in range(start, end):
                mask[i] = units[i].name in names
        return tuple(mask)
    counting = counts_matmuls(spec.precision)
    policy = effective_policy(spec, policy)
    mask, index = [], 0
    for unit in unit_ops(spec, kind):
        if policy.fused_qkv and unit.name in FUSED_LATER and mask:
            mask.append(mask[-1])  # wqkv's decision, taken at q_proj
        elif unit.matmul and counting and unit.name not in FORCE_RECOMPUTED:
            index += 1
            mask.append(policy.keeps(unit, index))
        else:
            mask.append(unit.name in policy.names)
    return tuple(mask)


def kept_units(spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None) -> tuple[str, ...]:
    """The units whose outputs `policy` keeps in one layer, in forward order."""
    units = unit_ops(spec, kind)
    return tuple(
        u.name for u, kept in zip(units, kept_mask(spec, policy, kind), strict=True) if kept
    )


def rerun_mask(
    units: tuple[Unit, ...],
    kept: tuple[bool, ...],
    replay: str = "graph",
    spans: tuple[tuple[int, int], ...] | None = None,
) -> tuple[bool, ...]:
    """Which units a layer's backward re-runs when it keeps the outputs `kept`.

    Compiled (`replay` "graph"): those whose output a backward reads (`Unit.saves`) or whose
    backward reads their internal tensors, not kept, and, from the last unit back, the units a
    re-run unit reads that are not kept (derived: AOTAutograd's partitioner rebuilds the tensors
    the backward reads from the layer input and the kept outputs, nothing else;
    torch/_functorch/partitioners.py at v2.13.0, `solve_min_cut`).

    Eager (`replay` "early_stop"): every unit not kept up to the last one the backward needs.
    PyTorch's non-reentrant checkpoint re-runs the layer's code op by op; a selective checkpoint
    answers a kept op from its cache and runs every other op, whether or not a backward reads
    its output, and stops after the last tensor the backward reads (torch/utils/checkpoint.py at
    v2.13.0, `_CachingTorchDispatchMode`, `early_stop`, on by default). Eager without early stop
    (`replay` "whole"): every unit not kept, to the end of the layer.

    `spans`: the checkpointed regions of a scoped policy (`policy_spans`, [start, end) unit
    indices); each replays on its own by the same rule, to the end of the region or to the last
    tensor its own units' backwards read, and the tensors it reads from outside are its
    checkpoint's inputs, held (derived: each region is its own `torch.utils.checkpoint` call).
    Units outside every region never re-run. None: the whole layer is one region."""
    rerun = [False] * len(units)
    for start, end in ((0, len(units)),) if spans is None else spans:
        demand = {i: units[i].internal > 0 for i in range(start, end)}
        for i in range(start, end):
            for j in units[i].saves:
                if start <= j < end:
                    demand[j] = True
        if replay == "whole":
            for i in range(start, end):
                rerun[i] = not kept[i]
            continue
        if replay == "early_stop":
            last = max((i for i, wanted in demand.items() if wanted), default=-1)
            for i in range(start, end):
                rerun[i] = not kept[i] and i <= last
            continue
        for i in range(end - 1, start - 1, -1):
            if demand[i] and not kept[i]:
                rerun[i] = True
                for j in units[i].reads:
                    if start <= j < end:
                        demand[j] = True
    return tuple(rerun)


@cached_by_chain(maxsize=256)
def region_spans(spec: ChainSpec, kind: LayerKind | None = None) -> dict[str, tuple[int, int]]:
    """The regions (`REGION_NAMES`) a layer of `kind` has, each its [start, end) in `unit_ops`
    (derived from the module boundaries of torchtitan's blocks, torchtitan/models/llama3/model/
    model.py and models/moe/moe.py at v0.2.2, and Hugging Face's LlamaDecoderLayer: the norms,
    `attention` (HF `self_attn`: the projections to out_proj, its reduce-scatter under sequence
    parallelism), the SDPA call, `feed_forward`/`mlp` (to fc2 and its reduce-scatter), the
    activation (silu and the product), `moe` (the router to the un-permutation, whose unit holds
    the residual add), `router`, `experts`, their activation, `shared_experts`)."""
    units = unit_ops(spec, kind)
    at = {}
    for i, unit in enumerate(units):
        at.setdefault(unit.name, i)
    add, norm2 = at["out_proj_add"], at["norm2"]
    spans = {
        "norm1": (0, 1),
        "attention": (1, add),
        "core_attn": (at["attention"], at["attention"] + 1),
        "norm1_attention": (0, add),
        "norm2": (norm2, norm2 + 1),
    }
    if "fc2_add" in at:
        last = at["fc2_add"]
        first_act = at.get("gate_act", at["act"])
        spans |= {
            "mlp": (norm2 + 1, last),
            "mlp_act": (first_act, at["act"] + 1),
            "norm2_mlp": (norm2, last),
        }
        return spans
    end = at["unpermute"] + 1
    first_expert = at.get("expert_fc1", at.get("expert_gate"))
    spans |= {
        "moe": (norm2 + 1, end),
        "norm2_moe": (norm2, end),
        "router": (at["router"], at["router_probs"] + 1),
        "experts": (first_expert, at["expert_fc2"] + 1),
        "moe_act": (at["expert_act"], at["expert_act"] + 1),
    }
    shared = [i for i, unit in enumerate(units) if unit.name.startswith("shared_")]
    if shared:
        spans["shared_experts"] = (shared[0], end - 1)
    return spans


def policy_spans(
    spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None
) -> tuple[tuple[int, int], ...]:
    """The checkpointed regions of `policy` in a layer of `kind`, in layer order: the whole layer
    for a layer-level policy; a scoped policy's regions the layer has."""
    if not policy.scopes:
        return ((0, len(unit_ops(spec, kind))),)
    spans = region_spans(spec, kind)
    return tuple(sorted(spans[name] for name, _ in policy.scopes if name in spans))


# Units that read the layer input (the residual stream entering the layer): the first norm and
# the first residual add.
_READ_INPUT = ("norm1", "out_proj_add")
LAYER_INPUT = -1  # the layer input among the tensors a tape holds (`stored_tensors`)
# The experts' input (`Unit.expert_input`) where it is not the output of the unit before them.
EXPERT_INPUT = -2


def _gathered(units: tuple[Unit, ...], unit: Unit) -> bool:
    """Whether expert GEMM `unit` reads a tensor of its own (`EXPERT_INPUT`): the routed rows
    differ from what the unit before them writes."""
    return bool(unit.expert_input) and all(
        units[j].output_bytes != unit.expert_input for j in unit.reads
    )


def unit_inputs(units: tuple[Unit, ...]) -> tuple[tuple[int, ...], ...]:
    """The tensors each unit reads: `Unit.reads`, with `LAYER_INPUT` for the layer input,
    `EXPERT_INPUT` for the experts' gathered input (`_gathered`), and for the un-permutation
    also the routed experts' output (its unit lists the shared experts' output, the one before
    it)."""
    found = []
    expert_out = max(
        (i for i, u in enumerate(units) if u.name in ("expert_fc2", "combine", "weighting_inputs")),
        default=None,
    )
    for unit in units:
        reads = unit.reads
        if unit.name in _READ_INPUT:
            reads = (*reads, LAYER_INPUT)
        if _gathered(units, unit):
            reads = (EXPERT_INPUT,)
        if unit.name == "unpermute" and expert_out is not None and expert_out not in reads:
            reads = (expert_out, *reads)
        found.append(reads)
    return tuple(found)


def stored_tensors(
    units: tuple[Unit, ...], spans: tuple[tuple[int, int], ...], kept: tuple[bool, ...]
) -> tuple[dict[int, bool], int]:
    """What a layer whose checkpointed regions are `spans` holds from its forward to its
    backward: the unit outputs (indices, `LAYER_INPUT` for the layer input), each storage once,
    each marked True where the unit's private tensors are held too (`Unit.private`: the unit
    kept, or un-checkpointed and saving its own output), and the internal bytes. A region holds
    the tensors its units read from outside it (its checkpoint's inputs) and its kept units'
    outputs and internal tensors (the selective checkpoint's cache); a unit outside every region
    what its backward reads (`Unit.saves`; the first norm its input) and its internal tensors,
    as autograd saves them (derived: torch/utils/checkpoint.py at v2.13.0,
    `_checkpoint_without_reentrant_generator` holds the function's inputs,
    `_CachingTorchDispatchMode` the MUST_SAVE outputs; a tensor several of them hold is one
    storage)."""
    region_of: list[int | None] = [None] * len(units)
    for r, (start, end) in enumerate(spans):
        for i in range(start, end):
            region_of[i] = r
    inputs = unit_inputs(units)
    held: dict[int, bool] = {}

    def hold(j: int, whole: bool) -> None:
        held[j] = held.get(j, False) or whole

    internal = 0
    gathered_from: set[tuple[int, ...]] = set()  # the norm outputs whose gathered copy is held
    gather_region = next(
        (region_of[j] for i, u in enumerate(units) if _gathered(units, u) for j in u.reads), None
    )  # the all-gather runs where the unit before the experts does
    for i, unit in enumerate(units):
        r = region_of[i]
        if r is None:
            if unit.name == "norm1":
                saved = (LAYER_INPUT,)
            elif unit.name == "unpermute":
                weights = tuple(j for j in unit.saves if units[j].name == "weighting_inputs")
                routing = tuple(j for j in unit.reads if units[j].name == "router_probs")
                saved = (*weights, *routing)
            elif _gathered(units, unit):
                saved = (EXPERT_INPUT,)
            else:
                saved = unit.saves
            for j in saved:
                hold(j, j == i)
            internal += unit.internal
            if unit.gathered and unit.reads not in gathered_from:
                gathered_from.add(unit.reads)
                internal += unit.gathered
            continue
        for j in inputs[i]:
            outside = region_of[j] != r if j >= 0 else j == LAYER_INPUT or gather_region != r
            if outside:
                hold(j, False)
        if kept[i]:
            hold(i, True)
            internal += unit.internal
    return held, internal


def replays(spec: ChainSpec, scoped: bool = False) -> str:
    """How a policy's re-forward runs (`rerun_mask`): "graph", the partitioned backward graph
    torch.compile builds; "whole", eager replay without early stop, as torchtitan wraps its
    blocks (`ptd_checkpoint_wrapper(..., early_stop=False)`, torchtitan/distributed/
    activation_checkpoint.py at 0.3.0, `FullAC` and `SelectiveAC`; 0.2.2's `early_stop` option
    defaults to false); "early_stop", eager replay with PyTorch's default (Hugging Face's
    gradient checkpointing). A `scoped` policy's regions are the torch export's checkpoints
    (`scope_layer`: `torch.utils.checkpoint.checkpoint` with PyTorch's default early stop,
    torch/utils/checkpoint.py at v2.13.0, `_checkpoint_early_stop` None, `early_stop` True),
    whatever the framework: torchtitan's configuration has no place for a region, so its
    blocks run a scoped policy only through that snippet, with torchtitan's own checkpointing
    off."""
    if spec.kernels == "compiled":
        return "graph"
    if scoped:
        return "early_stop"
    return "whole" if spec.framework == "torchtitan" else "early_stop"


@cached_by_chain(maxsize=256)
def rerun_units(spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None):
    """The units the backward of a layer under `policy` re-runs (`rerun_mask`)."""
    units = unit_ops(spec, kind)
    spans = policy_spans(spec, policy, kind) if policy.scopes else None
    mode = replays(spec, scoped=bool(policy.scopes))
    mask = rerun_mask(units, kept_mask(spec, policy, kind), mode, spans)
    return tuple(unit for unit, again in zip(units, mask, strict=True) if again)


def policy_comm_ops(
    spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None
) -> tuple[Op, ...]:
    """The table ops whose forward tensor-parallel collectives a re-forward under `policy`
    repeats: the input all-gather of a column-parallel projection one of whose units re-runs,
    the output reduce-scatter of a row-parallel one when that reduce-scatter re-runs (its
    all-reduce, without sequence parallelism, when the projection re-runs)."""
    return rerun_comm_ops(spec, rerun_units(spec, policy, kind), kind)


def rerun_comm_ops(
    spec: ChainSpec, again: tuple[Unit, ...], kind: LayerKind | None = None
) -> tuple[Op, ...]:
    """The table ops whose forward collectives a re-forward of the units `again` repeats
    (`policy_comm_ops`)."""
    names = {unit.name for unit in again}
    ops = layer_ops(spec, representative_kind(spec) if kind is None else kind)
    found = []
    scattered = spec.tp > 1 and spec.sp
    for op in ops:
        if op.tp_comm == "column":
            again_here = any(part_of(unit, op) for unit in again)
        elif op.tp_comm == "row" and scattered:
            again_here = "reduce_scatter" in names and op.name == "out_proj"
        else:
            again_here = op.tp_comm == "row" and op.name in names
        if again_here:
            found.append(op)
    return tuple(found)


def counts_matmuls(precision: str) -> bool:
    """Whether a policy's matmul rule sees the linear layers' GEMMs as `aten.mm` under
    `precision`. bf16, fp16 and torchao's `float8`: yes. `Float8Linear.forward` calls
    `torch.mm` on `Float8Tensor` arguments (torchao/float8/float8_linear.py at eab345c,
    `manual_float8_matmul_with_args_in_float8`; `matmul_with_hp_or_float8_args` since), and
    PyTorch calls an active dispatch mode, here the selective checkpoint's
    `_CachingTorchDispatchMode` (torch/utils/checkpoint.py), before a tensor subclass's
    `__torch_dispatch__`, which runs `aten._scaled_mm`; under torch.compile the nodes that
    subclass call traces are tagged with the policy given to `aten.mm`. torchao's `MXLinear`
    (torchao/prototype/mx_formats/mx_linear.py at e4e681be6, `mx_mm`) calls `torch.mm` on its
    `MXTensor` arguments the same way. Checked on the CPU with
    torchao 0.18 and torch 2.13 (validation/torch_float8_sac.py): the cache holds each kept
    GEMM's bf16 output. Transformer Engine's `fp8`: no, its linear layers call their own GEMM
    (`tex.generic_gemm`), which no `aten.mm` rule matches."""
    return precision != "fp8"


def part_of(unit: Unit, op: Op) -> bool:
    """Whether `unit` is one of the GEMMs split from table op `op` (`unit_ops`)."""
    parts = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "fc1": ("fc1", "gate_proj", "up_proj"),
        "shared_fc1": ("shared_fc1", "shared_gate_proj", "shared_up_proj"),
    }
    return unit.name in parts.get(op.name, (op.name,))


def policy_tape_bytes(spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None) -> int:
    """What a layer under `policy` holds from its forward to its backward: its input (the
    checkpoint's argument, the residual stream) and the kept units' outputs and internal
    tensors (derived: the selective-checkpoint cache holds one storage per kept output), less
    under torch.compile the kept outputs no backward reads (`compile_unread_bytes`). A scoped
    policy: what its regions and the un-checkpointed units hold (`scoped_tape_bytes`)."""
    units = unit_ops(spec, kind)
    kept = kept_mask(spec, policy, kind)
    if policy.scopes:
        return scoped_tape_bytes(spec, units, policy_spans(spec, policy, kind), kept)
    stored = sum(u.kept_bytes for u, k in zip(units, kept, strict=True) if k)
    stored += flex_region_copy_bytes(spec, policy, kind)
    return LayerShapes.of(spec).X + stored - compile_unread_bytes(spec, policy, kind)


def scoped_tape_bytes(
    spec: ChainSpec,
    units: tuple[Unit, ...],
    spans: tuple[tuple[int, int], ...],
    kept: tuple[bool, ...],
) -> int:
    """The bytes `stored_tensors` holds: each held output once, the layer input, the internal
    tensors."""
    held, internal = stored_tensors(units, spans, kept)
    sizes = {
        LAYER_INPUT: LayerShapes.of(spec).X,
        EXPERT_INPUT: max((u.expert_input for u in units), default=0),
    }
    return internal + sum(
        sizes[j] if j < 0 else units[j].output_bytes - (0 if whole else units[j].private)
        for j, whole in held.items()
    )


def flex_region_copy_bytes(spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None) -> int:
    """V's contiguous copy that a kept FlexAttention region holds besides its output, its
    logsumexp and the rotated Q and K (`policy.flex`): the size of v_proj's output.

    torchtitan 0.3.0 (torchtitan/models/common/attention.py in the wheel
    torchtitan-0.3.0-py3-none-any.whl) splits V out of the fused wqkv output as a strided
    view; FlexAttention runs compiled with `wrap_inductor_compiled_regions`
    (`FlexAttention.inductor_configs`), so the selective checkpoint sees one
    `inductor_compiled_code` op, which SelectiveAC saves
    (torchtitan/distributed/activation_checkpoint.py, `_get_default_save_ops`), and caches all
    its outputs: those its backward reads, among them V made contiguous. Measured on the CPU
    (tests/test_torchtitan_sac.py: 4,096 bytes of 70,144 in fp32, 2,048 of 35,328 in bf16).
    None in a compiled layer, whose graph reads V as a view of wqkv's output (`flex_units`)."""
    if not policy.flex or spec.kernels == "compiled":
        return 0
    return sum(unit.output_bytes for unit in unit_ops(spec, kind) if unit.name == "v_proj")


def torchtitan_03(spec: ChainSpec) -> bool:
    """Whether `spec`'s layers run under torchtitan 0.3.0, whose Llama-family attention runs q, k
    and v as one wqkv GEMM (`FusedQKVLinear`, torchtitan/models/common/attention.py; every
    Llama 3 flavour is built with fuse_qkv=True, models/llama3/__init__.py) and attends with
    FlexAttention compiled as a region of its own or varlen attention, never SDPA
    (models/common/config_utils.py, `get_attention_config`)."""
    from ckplan.model.frameworks import framework_version

    return spec.framework == "torchtitan" and framework_version(spec) == "0.3"


# How the attention runs where `fused_qkv` and `flex_attention` do not apply (`torchtitan_03`
# false): torchtitan's release of December 2024 (pytorch/torchtitan 9dec370,
# torchtitan/models/llama/model.py: wq, wk, wv, then F.scaled_dot_product_attention); Hugging
# Face transformers 5.25.0 (models/llama/modeling_llama.py, `LlamaAttention`: q_proj, k_proj,
# v_proj, then the configured attention function, SDPA by default); DeepSpeed 0.19.8, whose
# `deepspeed.checkpointing.checkpoint` runs `CheckpointFunction.apply(function, ...)` with no
# policy (runtime/activation_checkpointing/checkpointing.py), so a per-op policy runs through
# the torch snippet, whose layer runs three linears and SDPA (`exports.torch_snippet.reason`).
UNFUSED_ATTENTION = {
    "torchtitan": "torchtitan's release of December 2024 runs wq, wk and wv as three linears "
    "and attends through SDPA",
    "hf": "transformers 5.25's LlamaAttention runs q_proj, k_proj and v_proj as three linears "
    "and attends through SDPA",
    "deepspeed": "DeepSpeed's checkpoint takes no per-op policy, and the torch snippet that runs "
    "one runs q, k and v as three linears and SDPA",
}


def fused_framework_reason(spec: ChainSpec) -> str | None:
    """Why `fused_qkv` and `flex_attention` (`sac-fused`) do not apply under `spec`'s framework,
    one line naming the key, or None under torchtitan 0.3.0 (`torchtitan_03`), whose block they
    model: elsewhere the attention runs separate q, k and v GEMMs and SDPA (`UNFUSED_ATTENTION`),
    so the every-second rule would count other GEMMs and no region is kept whole."""
    if torchtitan_03(spec):
        return None
    if spec.framework == "torchtitan":
        key = f"key 'framework_version' ({spec.framework_version})"
    else:
        key = f"key 'framework' ({spec.framework})"
    runs = UNFUSED_ATTENTION.get(spec.framework, f"{spec.framework} runs no such block")
    return (
        f"{FUSED_QKV} and {FLEX_ATTENTION} model torchtitan 0.3.0's block (one wqkv GEMM, "
        f"FlexAttention kept whole), not {key}: {runs}; expected framework: torchtitan at "
        "framework_version 0.3, or sac or sac:OP,... without them"
    )


def policy_fit_reason(spec: ChainSpec, policy: OpPolicy) -> str | None:
    """Why `policy`'s fused-QKV or FlexAttention items do not fit `spec`, or None: both are
    torchtitan 0.3.0's Llama 3 block (separate q, k and v heads), measured on one rank's
    block, eager and compiled (tests/test_torchtitan_sac.py). Under tensor parallelism
    0.3.0's default `parallelism.spmd_backend = "spmd_types"` (torchtitan/config/configs.py)
    reduce-scatters through spmd_types' `_ReduceScatterShard` (spmd_types/_collectives.py:
    `x.new_empty`, then `torch.distributed.reduce_scatter_tensor`), which SelectiveAC's save
    list (`torch.ops._c10d_functional.reduce_scatter_tensor`) does not name, and its
    DTensor backends reduce-scatter through the functional op, which it does: what a rank
    keeps depends on the backend and is not measured, so tp > 1 is refused."""
    if policy.scopes:
        return scope_fit_reason(spec, policy)
    if not (policy.fused_qkv or policy.flex):
        return None
    if why := fused_framework_reason(spec):
        return why
    if spec.mla:
        return f"{FUSED_QKV} and {FLEX_ATTENTION} are modelled for q, k and v heads, not MLA"
    if spec.tp > 1:
        return (
            f"{FUSED_QKV} and {FLEX_ATTENTION} are measured on one rank's block (tp: 1): "
            "torchtitan 0.3.0's default spmd_types backend reduce-scatters with "
            "torch.distributed.reduce_scatter_tensor, not the functional op its save list names"
        )
    return None


# The words every note of a plan that no export writes carries (`ckplan check` lists them)
NO_EXPORT = "no export writes"


def layerwise_export_reason(policy: OpPolicy, beside: str) -> str | None:
    """Why no export writes `policy` in some layers beside layers of another kind (`beside`:
    `mixed`, some storing the full tape; `block:N` or `optimal`, some fully recomputed), or
    None.
    torchtitan's `activation_checkpoint` section applies one mode to every block
    (torchtitan/config/job_config.py at v0.2.2, `ActivationCheckpoint`; the same at 0.3.0), so
    only the torch snippet wraps each layer on its own, and its layer runs q, k and v as three
    linears and attention as SDPA, not torchtitan 0.3.0's fused wqkv and compiled FlexAttention
    that `fused_qkv` and `flex_attention` name (`exports.torch_snippet.reason`). Such a plan is
    never needed: where it stores the policy's tape in every layer it is the policy's own plan."""
    if not (policy.fused_qkv or policy.flex):
        return None
    text = policy_text(policy)
    word = next((word for word, body in POLICY_WORDS.items() if body == text), text)
    return (
        f"{NO_EXPORT} {word}+{beside}: torchtitan's activation_checkpoint section applies "
        "one mode to every layer, and the torch snippet that wraps each layer runs q, k and v "
        "as three linears and attention as SDPA, not torchtitan 0.3.0's fused wqkv and "
        f"FlexAttention ({word} alone is written by --to torchtitan)"
    )


def scope_model_reason(spec: ChainSpec) -> str | None:
    """Why scoped policies are not modelled on `spec`'s layers, or None: they are for eager,
    pre-norm, sequential layers a per-op policy fits (`check_policy_model`)."""
    if why := check_policy_model(spec):
        return why
    if spec.kernels == "compiled":
        return (
            "scoped policies (sac@...) are modelled for eager layers (kernels: eager); compiled, "
            "a layer-level policy re-runs only what the backward reads"
        )
    if spec.post_norms or spec.parallel_residual:
        return "scoped policies are modelled for pre-norm layers without a parallel residual"
    return None


def scope_fit_reason(spec: ChainSpec, policy: OpPolicy) -> str | None:
    """Why scoped `policy` does not fit `spec`, or None: scoped policies are modelled for eager
    layers (under torch.compile the partitioner re-runs only what a backward reads whatever the
    scope), pre-norm and sequential; in every kind of layer its regions must not overlap, and
    each kept unit must lie in its region where the layer has that region."""
    if why := scope_model_reason(spec):
        return why
    kinds = distinct_kinds(spec)
    for name, _ in policy.scopes:
        if not any(name in region_spans(spec, kind) for kind in kinds):
            return f"the model's layers have no region {name}"
    for kind in kinds:
        units, spans = unit_ops(spec, kind), region_spans(spec, kind)
        present = sorted((spans[name], name) for name, _ in policy.scopes if name in spans)
        for ((_, end), first), ((start, _), second) in pairwise(present):
            if start < end:
                return f"regions {first} and {second} overlap"
        for name, kept in policy.scopes:
            if name not in spans:
                continue
            inside = {units[i].name for i in range(*spans[name])}
            outside = sorted(kept - inside)
            if outside:
                return f"region {name} does not hold {', '.join(outside)}"
    return None


# The units that close a dense layer's MLP branch, last first: what feeds only the residual add.
CLOSING_UNITS = ("reduce_scatter", "fc2")


def compile_unread_bytes(spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None) -> int:
    """Bytes of kept outputs that a compiled layer does not save: the ones its backward never
    reads. Eager selective checkpointing caches every MUST_SAVE output
    (`_CachingTorchDispatchMode`, torch/utils/checkpoint.py); under torch.compile the policy
    only tags the graph's nodes, and AOTAutograd's min-cut partitioner
    (torch/_functorch/partitioners.py, `solve_min_cut`) bans a MUST_SAVE node from
    recomputation but saves it only when the backward needs it, directly or to re-run a
    recomputed op. In a pre-norm dense layer the MLP's down projection (w2) and, under sequence
    parallelism, its reduce-scatter feed only the closing residual add, whose backward reads
    neither: torchtitan's `sac` keeps w2's output eagerly but not compiled. Checked on the CPU
    with torch 2.13 (validation/torch_float8_sac.py: the compiled block saves 5.53X where the
    eager cache holds 6.53X, X the block input, the difference w2's output). Not applied to MoE
    layers (the experts' outputs are read by the routing weights' gradient), post-norms or a
    parallel residual."""
    kind = representative_kind(spec) if kind is None else kind
    if spec.kernels != "compiled" or kind.moe or spec.post_norms or spec.parallel_residual:
        return 0
    kept = set(kept_units(spec, policy, kind))
    units = [unit for unit in unit_ops(spec, kind) if not unit.name.endswith("_add")]
    unread = 0
    for unit in reversed(units):
        if unit.name not in CLOSING_UNITS:
            break
        if unit.name in kept:
            unread += unit.output_bytes
        if unit.name == "fc2":
            break
    return unread


def recomputed_ops(
    spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None
) -> tuple[Op, ...]:
    """The ops the backward re-runs under `policy` (`rerun_units`), as the time model times
    them."""
    return tuple(unit.op for unit in rerun_units(spec, policy, kind))


def recomputed_forward_flops(
    spec: ChainSpec, policy: OpPolicy, kind: LayerKind | None = None
) -> int:
    """Forward FLOPs of the re-run ops (matmuls and the attention core only, as everywhere)."""
    return sum(op.forward_flops for op in recomputed_ops(spec, policy, kind))


# The regions that are submodules of a layer, in torchtitan's blocks (torchtitan/models/llama3/
# model/model.py, models/moe/moe.py at v0.2.2) and Hugging Face's (modeling_llama.py,
# modeling_mixtral.py, modeling_deepseek_v3.py, transformers 5.x): a checkpoint can wrap them as
# they are. The others (core_attn, mlp_act, moe_act, a norm with its block) are code inside a
# module's forward.
SUBMODULE_REGIONS = (
    "norm1",
    "attention",
    "norm2",
    "mlp",
    "moe",
    "router",
    "experts",
    "shared_experts",
)
# The units a selective-checkpoint policy_fn recognises by their aten op besides matmuls and
# grouped GEMMs: the attention kernels, the reduce-scatter, the all-to-alls.
OP_RECOGNISED = ("attention", "reduce_scatter", "dispatch", "combine")


def op_recognised(spec: ChainSpec, name: str) -> bool:
    """Whether a policy_fn can tell unit `name`'s op by its aten op alone: a matmul, a grouped
    GEMM or one of `OP_RECOGNISED`."""
    if name in OP_RECOGNISED:
        return True
    return any(unit.name == name and (unit.matmul or unit.grouped) for unit in unit_ops(spec))


# The attention GEMMs of torchtitan 0.3.0's Llama-family blocks: one fused wqkv GEMM and wo
# (`FusedQKVLinear`, torchtitan/models/common/attention.py; every Llama 3 flavour is built with
# fuse_qkv=True, models/llama3/__init__.py), where ckplan's units count q, k, v and out_proj.
FUSED_ATTENTION_GEMMS = ("q_proj", "k_proj", "v_proj", "out_proj")


def region_keepable(spec: ChainSpec, name: str) -> bool:
    """Whether a region's policy_fn can keep unit `name` by counting its aten op within the
    region (`op_recognised`): not the attention's GEMMs of torchtitan 0.3's blocks without MLA,
    which run q, k and v as one GEMM, so that the count within the region names other GEMMs."""
    fused = torchtitan_03(spec) and not spec.mla
    return op_recognised(spec, name) and not (fused and name in FUSED_ATTENTION_GEMMS)


def scope_wrap_reason(spec: ChainSpec, policy: OpPolicy) -> str | None:
    """Why scoped `policy` cannot run as a checkpoint around each region's submodule with a
    policy_fn per region, or None: every region must be one of `SUBMODULE_REGIONS` and every
    kept unit one `op_recognised` names. What `sweep` and `plan` offer and the torch export
    accepts."""
    other = [name for name, _ in policy.scopes if name not in SUBMODULE_REGIONS]
    if other:
        return (
            f"the snippet checkpoints submodules ({', '.join(SUBMODULE_REGIONS)}), and "
            f"{', '.join(other)} is code inside one"
        )
    fused = sorted(
        name
        for _, kept in policy.scopes
        for name in kept
        if op_recognised(spec, name) and not region_keepable(spec, name)
    )
    if fused:
        return (
            "torchtitan 0.3.0's attention runs q, k and v as one fused wqkv GEMM, which a "
            f"region's policy_fn cannot count as {', '.join(fused)}"
        )
    named = sorted(
        name for _, kept in policy.scopes for name in kept if not op_recognised(spec, name)
    )
    if named:
        return (
            "a region's policy_fn recognises matmuls, grouped GEMMs, attention kernels and "
            f"collectives by their aten op, not {', '.join(named)}"
        )
    return None
