"""The mixture-of-experts MLP: router, token dispatch, the expert MLPs, combine, shared experts.

Modelled on Megatron-Core's MoELayer with the all-to-all token dispatcher, grouped-GEMM experts
and the routing probabilities applied inside the experts' activation (weighted SwiGLU), as of
megatron/core/transformer/moe/{moe_layer,router,moe_utils,token_dispatcher,experts}.py:

    x (T tokens on this rank)   -> router: logits = x·W_r (T, E); top-k; softmax of the k
                                   scores in fp32; the aux-loss softmax over all E in fp32
                                -> permute: each token copied to its k experts (index_select),
                                   all-to-all over the ep ranks; all-gather over the etp ranks
    rows R on this rank         -> expert fc1, weighted activation, fc2 (F_e/etp wide)
                                -> unpermute: all-to-all back, scatter-add of the k copies
    (+ shared experts: a TP-split dense MLP of shared_ffn_hidden over all tokens, Megatron's
      SharedExpertMLP, optionally gated by sigmoid(x·w_g) as Qwen2-MoE)

T = s·b/(cp·t) (MoE with tp > 1 needs sequence parallelism). The rows R an expert rank
processes (`routed_rows`): T·k on average, dropless; with a capacity factor c, every expert's
buffer is padded to its capacity ceil(c·T·k/E) per source rank (GShard; Megatron's
--moe-pad-expert-input-to-capacity), E·ceil(c·T·k/E) rows; `moe_imbalance: worst` (dropless) is
every token of the ep group choosing this rank's experts, T·ep·min(k, E/ep); a factor f is
f·T·k rows, capped at that worst case. With expert tensor parallelism the etp ranks' rows are
gathered: R = rows·etp, each rank computing F_e/etp of every local expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ckplan.model.ops import FP32_BYTES, LayerShapes, Op, _matmul, _op, mlp_block_ops
from ckplan.model.spec import ModelSpec

MOE = "moe"  # recompute group: the whole MoE block (Megatron --moe-layer-recompute)
EXPERTS = "moe/experts"  # recompute group: the routed expert MLPs only
INDEX_BYTES = 8  # int64 token indices (torch.topk, index_select)
MASK_BYTES = 1  # the boolean routing map


def sent_rows(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Token copies this rank dispatches: T·k dropless; E·capacity with a capacity factor."""
    tokens = shapes.stream_tokens
    if spec.capacity_factor:
        return spec.experts * expert_capacity(spec, tokens)
    return tokens * spec.top_k


def expert_capacity(spec: ModelSpec, tokens: int) -> int:
    """Megatron's per-expert capacity from one source rank: ceil(T·k·c / E) (moe_utils
    get_capacity, "capacity = num_tokens_per_rank * topk * capacity_factor / num_experts")."""
    factor = Fraction(str(spec.capacity_factor))
    return math.ceil(tokens * spec.top_k * factor / spec.experts)


def routed_rows(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Rows the expert GEMMs of this rank process in one MoE layer (see the module docstring)."""
    tokens, k = shapes.stream_tokens, spec.top_k
    if spec.capacity_factor:
        rows = spec.experts * expert_capacity(spec, tokens)
    else:
        worst = tokens * spec.ep * min(k, spec.experts // spec.ep)
        if spec.moe_imbalance == "worst":
            rows = worst
        elif spec.moe_imbalance == "average":
            rows = tokens * k
        else:
            rows = min(math.ceil(Fraction(spec.moe_imbalance) * tokens * k), worst)
    return rows * spec.etp


def experts_input_bytes(spec: ModelSpec, shapes: LayerShapes) -> int:
    """What recomputing the expert MLPs keeps: their dispatched tokens and probabilities."""
    rows = routed_rows(spec, shapes)
    return shapes.B * rows * (spec.hidden + 1)


def moe_ops(spec: ModelSpec, shapes: LayerShapes, out_grad: int) -> list[Op]:
    """The ops of one MoE MLP on one GPU, in forward order (after norm2).

    Saved bytes per op (derived from each op's backward in the Megatron code named above):
    router: its input x (T·h; the shared experts read the same storage); router_probs: the
    top-k indices (int64), the fp32 softmax of the k selected scores, the fp32 aux-loss softmax
    over all E experts; permute: the sorted token indices (int64, one per dispatched copy), and
    the boolean routing map and the transposed (E, T) probabilities masked_select keeps (its
    backward needs its input's shape: autograd saves the input itself); expert_fc1: its input,
    the R dispatched rows; expert_act: its input (fc1's output, 2F_e/etp gated) and the R
    routing probabilities it weights by; expert_fc2: its input; unpermute: nothing new (its
    scatter-add reuses permute's indices). All-to-all and all-gather save nothing.
    `out_grad` is the gradient of the block's output the last op reads (0: the residual
    stream's, which the walk counts).
    """
    B, X = shapes.B, shapes.X
    tokens, h, E, k = shapes.stream_tokens, spec.hidden, spec.experts, spec.top_k
    rows = routed_rows(spec, shapes)
    sent = sent_rows(spec, shapes)
    gated = spec.mlp != "gelu"
    ffn_r = spec.moe_ffn_hidden // spec.etp  # each expert's width on this rank
    fc1_width = (2 if gated else 1) * ffn_r
    act_saved = (2 if spec.fused_swiglu else 3) * ffn_r if gated else ffn_r
    shared = spec.shared_ffn_hidden > 0
    logits = B * tokens * E
    # x's gradient: allocated by the first of its readers to be backpropagated (the shared
    # experts' fc1, else permute); the others' are added into it (workspace).
    ops = [
        _op("router", "mlp", X, _matmul(tokens, E, h), MOE, grads=(logits, 0), workspace=X),
        _op(
            "router_probs",
            "mlp",
            INDEX_BYTES * tokens * k + FP32_BYTES * tokens * k + FP32_BYTES * tokens * E,
            0,
            MOE,
            grads=(logits, logits),
            workspace=FP32_BYTES * tokens * E,
        ),
        _op(
            "permute",
            "mlp",
            INDEX_BYTES * sent + MASK_BYTES * tokens * E + B * tokens * E,
            0,
            MOE,
            grads=(B * rows * (h + 1), logits + (0 if shared else X)),
            workspace=B * sent * h + (X if shared else 0),
        ),
        _op(
            "expert_fc1",
            "mlp",
            B * rows * h,
            _matmul(rows, fc1_width, h),
            EXPERTS,
            grads=(B * rows * fc1_width, B * rows * h),
        ),
        _op(
            "expert_act",
            "mlp",
            B * rows * (act_saved + 1),
            0,
            EXPERTS,
            grads=(B * rows * ffn_r, B * rows * (fc1_width + 1)),
        ),
        _op(
            "expert_fc2",
            "mlp",
            B * rows * ffn_r,
            _matmul(rows, h, ffn_r),
            EXPERTS,
            grads=(B * rows * h, B * rows * ffn_r),
        ),
        _op(
            "unpermute",
            "mlp",
            0,
            0,
            MOE,
            grads=(out_grad, B * rows * h),
            workspace=B * sent * h,
        ),
    ]
    if shared:
        gate = spec.shared_expert_gate
        ops += mlp_block_ops(
            spec, shapes, spec.shared_ffn_hidden, X if gate else 0, "shared_", input_saved=False,
            group=MOE,
        )  # fmt: skip
        if gate:
            # sigmoid(x·w_g) · shared output: the product saves both (T·h and T values).
            ops.append(
                _op(
                    "shared_gate",
                    "mlp",
                    B * tokens * (h + 1),
                    _matmul(tokens, 1, h),
                    MOE,
                    grads=(0, X),
                    workspace=X,
                )
            )
    return ops


def moe_layer_parameters(spec: ModelSpec) -> tuple[int, int, int]:
    """(tensor-parallel, replicated, expert) parameters of one MoE MLP.

    Experts: E·(h·w1 + F_e·h) with w1 = 2F_e gated (gate and up) or F_e, plus biases, split
    over ep·etp ranks. Router E·h (+ E for DeepSeek-V3's expert bias), whole on every rank
    (Megatron's TopKRouter weight is not tensor-parallel). Shared experts: a TP-split MLP of
    shared_ffn_hidden; their sigmoid gate h, whole. Mixtral-8x7B: 1,409,318,912 per layer.
    """
    h, E, F = spec.hidden, spec.experts, spec.moe_ffn_hidden
    gated = spec.mlp != "gelu"
    w1 = (2 if gated else 1) * F
    expert = h * w1 + F * h + ((w1 + h) if spec.bias else 0)
    replicated = E * h + (E if spec.expert_bias else 0)
    split = 0
    if spec.shared_ffn_hidden:
        S = spec.shared_ffn_hidden
        sw1 = (2 if gated else 1) * S
        split = h * sw1 + S * h + ((sw1 + h) if spec.bias else 0)
        replicated += h if spec.shared_expert_gate else 0
    return split, replicated, E * expert


@dataclass(frozen=True)
class ExpertLayout:
    """How the experts of an MoE model sit on one GPU (the busiest pipeline stage's)."""

    experts: int
    top_k: int
    ep: int
    etp: int
    expert_data_parallel: int  # tp·cp·dp / (ep·etp), the ranks that share an expert's states
    experts_per_gpu: int  # E / ep local experts
    expert_ffn_per_gpu: int  # F_e / etp of every local expert
    moe_layers_per_gpu: int
    tokens_per_gpu: int  # T entering each MoE layer, one micro-batch
    routed_rows_per_gpu: int  # R its expert GEMMs process, one micro-batch (routed_rows)
    average_rows_per_gpu: int  # R with balanced routing
    expert_parameters_per_gpu: int
    moe_imbalance: str
    capacity_factor: float


def expert_layout(spec: ModelSpec) -> ExpertLayout | None:
    """The expert-parallel layout of `spec` on one GPU; None without experts."""
    if not spec.experts:
        return None
    from ckplan.model.layers import stage_kinds
    from ckplan.model.memory import busiest_stage, stage_parameters

    shapes = LayerShapes.of(spec)
    stage = busiest_stage(spec)
    average = routed_rows(spec.replace(moe_imbalance="average"), shapes)
    return ExpertLayout(
        experts=spec.experts,
        top_k=spec.top_k,
        ep=spec.ep,
        etp=spec.etp,
        expert_data_parallel=spec.expert_data_parallel,
        experts_per_gpu=spec.experts // spec.ep,
        expert_ffn_per_gpu=spec.moe_ffn_hidden // spec.etp,
        moe_layers_per_gpu=sum(kind.moe for kind in stage_kinds(spec, stage)),
        tokens_per_gpu=shapes.stream_tokens,
        routed_rows_per_gpu=routed_rows(spec, shapes),
        average_rows_per_gpu=average,
        expert_parameters_per_gpu=stage_parameters(spec, stage)[1],
        moe_imbalance=spec.moe_imbalance,
        capacity_factor=spec.capacity_factor,
    )
