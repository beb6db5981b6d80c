"""FLOPs: forward and backward of a layer, the output layer, and the model per iteration.

Matmuls only (2·m·n·k each), as in Korthikanti et al. 2022 App. A and Narayanan et al. 2021 §5.1.
Per-GPU figures follow the same t/cp splits as `ops.py` (ckplan.model.ops); a mixture of
experts counts the experts each token is routed to (`moe.routed_rows`), never all of them.
"""

from __future__ import annotations

from ckplan.model.layers import LayerKind, kind_layer_indices
from ckplan.model.op import ATTENTION_CORE, in_group, matmul_flops, split_share
from ckplan.model.ops import layer_ops
from ckplan.model.parts import cached_by_chain
from ckplan.model.spec import ModelSpec


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
    ops = layer_ops(spec, kind)
    return sum(op.forward_flops for op in ops if any(in_group(op, name) for name in groups))


def attention_core_fraction(spec: ModelSpec) -> float:
    """Share of a layer's forward FLOPs in the attention core. The seed's constant 0.15 is this
    at s = h = 8192 with F = 4h: 8192 / (6·8192 + 8192) = 1/7 ≈ 0.143."""
    return group_forward_flops(spec, ATTENTION_CORE) / layer_forward_flops(spec)


def logits_forward_flops(spec: ModelSpec) -> int:
    """Output layer: (s·b, h) @ (h, V) = 2sbhV (Korthikanti App. A), vocab split over t."""
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    return matmul_flops(tokens, split_share(spec.vocab, spec.tp), spec.hidden)


def model_flops_per_iteration(spec: ModelSpec, global_batch: int) -> int:
    """Model FLOPs of one iteration (forward + backward, no recompute) for `global_batch`
    sequences: 3 x (L layers + logits) forward. For GPT with F = 4h this is Korthikanti App. A's
    72·B·s·l·h²·(1 + s/6h + V/12hl) exactly. A mixture of experts counts the k routed experts
    of every token (average routing, no capacity padding)."""
    whole = spec.replace(
        tp=1, sp=False, cp=1, pp=1, micro_batch=1, virtual_stages=1, ep=1, etp=1, dp=1, zero=0,
        capacity_factor=0.0, moe_imbalance="average", first_stage_layers=None,
        last_stage_layers=None, account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
    )  # fmt: skip
    layers = sum(  # per kind of layer, times its count (ints: exact)
        layer_forward_flops(whole, kind) * len(indices)
        for kind, indices in kind_layer_indices(whole).items()
    )
    return 3 * (layers + logits_forward_flops(whole)) * global_batch
