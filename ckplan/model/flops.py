"""FLOPs: forward and backward of a layer, the output layer, and the model per iteration.

Matmuls only (2·m·n·k each), as in Korthikanti et al. 2022 App. A and Narayanan et al. 2021 §5.1.
Per-GPU figures follow the same t/cp splits as `ops.py` (ckplan.model.ops); a mixture of
experts counts the experts each token is routed to (`moe.routed_rows`), never all of them.
"""

from __future__ import annotations

import dataclasses

from ckplan.model import mtp
from ckplan.model.layers import LayerKind, kind_layer_indices
from ckplan.model.memory import parameter_count
from ckplan.model.modules import module_ops
from ckplan.model.op import ATTENTION_CORE, matmul_flops, split_share
from ckplan.model.op_policy import is_policy, parse_policy, recomputed_forward_flops
from ckplan.model.ops import layer_ops
from ckplan.model.parts import Parallelism, RunShape, cached_by_chain
from ckplan.model.spec import ChainSpec, ModelSpec


def layer_forward_flops(spec: ModelSpec, kind: LayerKind | None = None) -> int:
    """Forward FLOPs of one layer: QKV 2sbh(h + 2gd), QKᵀ 2bs²h, AV 2bs²h, out-proj 2sbh²,
    MLP 4sbhF (GELU) or 6sbhF (SwiGLU); 24sbh² + 4bs²h for MHA with F = 4h (Korthikanti App. A)."""
    return sum(op.forward_flops for op in layer_ops(spec, kind))


def layer_backward_flops(spec: ModelSpec, kind: LayerKind | None = None) -> int:
    """Backward FLOPs of one layer: 2x forward (one matmul for the input gradient and one for
    the weight gradient per forward matmul), plus flash attention's in-kernel QKᵀ recompute."""
    return sum(op.backward_flops for op in layer_ops(spec, kind))


def group_forward_flops(
    spec: ModelSpec, group: str | tuple[str, ...], kind: LayerKind | None = None
) -> int:
    """Forward FLOPs of a recompute group (or several) in one layer; the attention core is QKᵀ
    and AV, 4bs²h, a fraction s / (6h + s) of an MHA layer with F = 4h (derived from the
    above)."""
    groups = (group,) if isinstance(group, str) else tuple(group)
    return _group_forward_flops(spec, groups, kind)


@cached_by_chain(maxsize=512)
def _group_forward_flops(spec: ModelSpec, groups: tuple[str, ...], kind: LayerKind | None) -> int:
    if groups and is_policy(groups[0]):  # the ops a per-op policy re-runs
        return recomputed_forward_flops(spec, parse_policy(groups[0]), kind)
    return sum(op.forward_flops for op in module_ops(layer_ops(spec, kind), groups))


def attention_core_fraction(spec: ModelSpec) -> float:
    """Share of a layer's forward FLOPs in the attention core. The simple formula set's constant
    0.15 is this at s = h = 8192 with F = 4h: 8192 / (6·8192 + 8192) = 1/7 ≈ 0.143."""
    return group_forward_flops(spec, ATTENTION_CORE) / layer_forward_flops(spec)


def logits_forward_flops(spec: ModelSpec) -> int:
    """Output layer: (s·b, h) @ (h, V) = 2sbhV (Korthikanti App. A), vocab split over t."""
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    return matmul_flops(tokens, split_share(spec.vocab, spec.tp), spec.hidden)


def _whole_model(spec: ModelSpec) -> ChainSpec:
    """The model on one GPU with one sequence: no parallelism, no capacity padding, average
    routing, so that FLOPs count the model itself."""
    return ChainSpec(
        architecture=dataclasses.replace(spec.architecture, capacity_factor=0.0),
        shape=RunShape(seq=spec.seq, micro_batch=1, dtype_bytes=spec.dtype_bytes),
        parallel=Parallelism(),
        finetune=spec.finetune,
        profile=spec.profile,
    )


def frozen_weight_gradient_flops(spec: ModelSpec) -> int:
    """FLOPs of the weight-gradient GEMMs that frozen weights skip, per sequence (0 for
    training: full): one GEMM of its forward's size per frozen linear layer (ckplan.model.
    finetune), and the output layer's when it is frozen. The model FLOPs of a fine-tune are
    3 x forward less these: forward, the input gradients, and the adapters' weight gradients
    (derived). DoRA's adapters run forward work with no backward of its own (B·A for the
    weight norm) or with an input-gradient GEMM alone (the base GEMM again, with dropout):
    their backward is less than twice their forward by as much."""
    if spec.training == "full" or spec.kind != "transformer":
        return 0
    whole = _whole_model(spec)
    skipped = 0
    for kind, at in kind_layer_indices(whole).items():
        per_layer = sum(
            2 * op.forward_flops - op.backward_flops
            for op in layer_ops(whole, kind)
            if (op.matmul is not None or op.name.endswith("_lora"))
            and not op.fused_kernel
            and op.backward_flops < 2 * op.forward_flops
        )
        skipped += per_layer * len(at)
    return skipped + logits_forward_flops(whole)


def _per_sequence(spec: ModelSpec) -> tuple[int, int, int]:
    """Forward FLOPs of one sequence: (all layers, their attention cores, the logits); MTP
    depths add their block and eh_proj to the layers and their head to the logits."""
    whole = _whole_model(spec)
    indices = kind_layer_indices(whole)
    layers = sum(layer_forward_flops(whole, kind) * len(at) for kind, at in indices.items())
    core = sum(
        group_forward_flops(whole, ATTENTION_CORE, kind) * len(at) for kind, at in indices.items()
    )
    depths = whole.mtp_layers  # Megatron-LM counts them too (training.py at core_v0.14.0)
    if depths:
        kind = mtp.mtp_kind(whole)
        layers += depths * (layer_forward_flops(whole, kind) + mtp.projection_forward_flops(whole))
        core += depths * group_forward_flops(whole, ATTENTION_CORE, kind)
    return layers, core, (1 + depths) * logits_forward_flops(whole)


def model_flops_per_iteration(spec: ModelSpec, global_batch: int) -> int:
    """Model FLOPs of one iteration (forward + backward, no recompute) for `global_batch`
    sequences: 3 x (L layers + logits) forward. For GPT with F = 4h this is Korthikanti App. A's
    72·B·s·l·h²·(1 + s/6h + V/12hl) exactly. A mixture of experts counts the k routed experts
    of every token (average routing, no capacity padding)."""
    layers, _, logits = _per_sequence(spec)
    return (3 * (layers + logits) - frozen_weight_gradient_flops(spec)) * global_batch


# The FLOP counts publishers divide by time for TFLOP/s and MFU. A published figure is compared
# on its own publisher's count (ckplan validate); `--mfu-convention` picks ckplan's.
FLOP_CONVENTIONS: dict[str, str] = {
    "full": "3 x forward matmul FLOPs with the full s x s attention (Korthikanti et al. 2022 "
    "App. A; Megatron-LM's num_floating_point_operations; NeMo's flops_formulas)",
    "causal": "as full, the attention core (QK^T and AV) counted once for the causal half "
    "(Megatron-Bridge's flop_utils: 'only half of the attention matrix is computed')",
    "recompute": "as full, the layers' forward counted again for full activation recomputation: "
    "96·B·s·l·h²·(1 + s/6h + V/16lh) for GPT (Narayanan et al. 2021, Eq. 3)",
    "6n": "6 x non-embedding parameters x tokens + 12·l·a·d·s per token (Chowdhery et al. 2022 "
    "App. B; torchtitan's get_num_flop_per_token)",
    "6n-all": "6 x all parameters x tokens + 12·l·h·s per token (llm-foundry's MFU: "
    "3·(2·n_params·s + 2·2·l·h·s²) per sequence)",
}
MFU_CONVENTION = "full"  # ckplan's MFU: model FLOPs, no recompute, full attention


def iteration_flops(spec: ModelSpec, global_batch: int, convention: str = MFU_CONVENTION) -> int:
    """FLOPs of one iteration of `global_batch` sequences as `convention` counts them
    (FLOP_CONVENTIONS), exact. The parameter conventions count the parameters a token passes
    through (a mixture of experts: its k routed experts), `6n` without the input embedding, and
    the attention scores and values as 12·l·a·d·s per token (PaLM's 12·L·H·Q·T), `6n-all` with
    every parameter and 12·l·h·s (llm-foundry's d_model)."""
    if convention in ("6n", "6n-all"):
        count = parameter_count(_whole_model(spec))
        parameters = count.active - (count.embedding if convention == "6n" else 0)
        width = spec.heads * spec.head_dim if convention == "6n" else spec.hidden
        per_token = 6 * parameters + 12 * spec.layers * width * spec.seq
        return per_token * spec.seq * global_batch
    layers, core, logits = _per_sequence(spec)
    if convention == "full":
        per_sequence = 3 * (layers + logits)
    elif convention == "causal":
        per_sequence = 3 * (layers - core + core // 2 + logits)
    elif convention == "recompute":
        per_sequence = 4 * layers + 3 * logits
    else:
        raise ValueError(f"unknown FLOP convention {convention!r}")
    return (per_sequence - frozen_weight_gradient_flops(spec)) * global_batch
