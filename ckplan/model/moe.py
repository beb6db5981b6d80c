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

What the time model reads (`ckplan.hardware`): the router's GEMM (T x h) @ (h x E), whole on
every rank; the expert MLPs as grouped GEMMs over the R rows of this rank, one group per local
expert (TEGroupedMLP: Transformer Engine's GroupedLinear, `gg.ops.gmm` in the older
GroupedMLP), no tensor-parallel collective of their own (the dispatcher's all-gather and
reduce-scatter over etp are expert-parallel communication, `hardware.expert_parallel`); the
bytes the router, permutation and weighted-activation kernels move (`*_moved` below): unfused
by default (Megatron's defaults), or Transformer Engine's fused kernels with the keys
`moe_router_fusion` (--moe-router-fusion) and `moe_permute_fusion` (--moe-permute-fusion);
with a capacity factor the router's token dropping (`token_dropping_moved`); and under FP8 the
copies that align the grouped GEMMs' rows to 16 (`fp8_padding_moved`).
"""

from __future__ import annotations

import math
from fractions import Fraction

from ckplan.model.mlp_block import mlp_block_ops
from ckplan.model.op import FP32_BYTES, LayerShapes, Matmul, Op, make_op, matmul_flops
from ckplan.model.spec import ModelSpec

MOE = "moe"  # recompute group: the whole MoE block (Megatron --moe-layer-recompute)
EXPERTS = "moe/experts"  # recompute group: the routed expert MLPs only
# recompute group: the shared experts (Megatron-Core --recompute-modules shared_experts,
# moe/moe_layer.py core_v0.15.0: `tensor_parallel.checkpoint(self.shared_experts, ...)`)
SHARED_EXPERTS = "moe/shared_experts"
INDEX_BYTES = 8  # int64 token indices (torch.topk, index_select)
MASK_BYTES = 1  # the boolean routing map
ROW_ID_BYTES = 4  # int32 row maps of Transformer Engine's fused permutation


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


def received_rows(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Rows the dispatch all-to-all delivers to this rank (before the etp all-gather):
    R / etp (token_dispatcher.py: output_splits, the tokens every EP rank sends this rank's
    local experts)."""
    return routed_rows(spec, shapes) // spec.etp


FP8_DISPATCH_TILE = 128  # values per FP8 scale in the dispatch (1x128 activation tiles)


def dispatch_row_bytes(spec: ModelSpec, dtype_bytes: int) -> int:
    """Bytes of one token row the dispatch sends, its routing probability aside: h values at
    the activation's B bytes; with `moe_dispatch_fp8`, h FP8 values and one FP32 scale per
    1x128 tile, h + 4·ceil(h/128). DeepSeek-V3 Technical Report (arXiv 2412.19437) §3.3.3,
    "Low-Precision Communication": "we quantize the activation before MoE up-projections into
    FP8 and then apply dispatch components"; "A similar strategy is applied to the activation
    gradient before MoE down-projections. For both the forward and backward combine components,
    we retain them in BF16" (`combine_bytes` stays B bytes a value). The backward's two
    all-to-alls are then one FP8 (the combine's transpose, carrying that gradient) and one BF16
    (the dispatch's): the forward's bytes, as `ExpertParallelComm.backward` counts them;
    §3.3.2, "Fine-Grained Quantization": activations scaled per 1x128 tile. The scale's width:
    deepseek-ai/DeepEP v1.2.1 (9af0e0d), deep_ep/buffer.py `Buffer.dispatch`, an FP8 `x` is
    "[num_tokens, hidden]" float8_e4m3fn with scales "[num_tokens, hidden // 128]" torch.float;
    its README benchmarks "the DeepSeek-V3/R1 pretraining setting (... FP8 dispatching and BF16
    combining)"."""
    if spec.moe_dispatch_fp8:
        return spec.hidden + FP32_BYTES * math.ceil(spec.hidden / FP8_DISPATCH_TILE)
    return dtype_bytes * spec.hidden


def node_reach_probability(
    experts: int, top_k: int, nodes: int, groups: int = 0, group_topk: int = 0
) -> Fraction:
    """Probability that one token has at least one of its top_k experts on a given node, its
    E experts spread evenly over `nodes` nodes in order (Megatron's expert placement: rank r
    holds experts r·E/ep onwards, the ep group's ranks fill its nodes in order).

    Derived, assuming uniform routing: without groups the k experts are k of E drawn without
    replacement, so the node (E/N experts) is missed with probability C(E - E/N, k) / C(E, k).
    With group-limited routing (Megatron-Core moe_utils.group_limited_topk core_v0.19.0: G
    equal groups in expert order, each token keeps its best M = group_topk of them, then its
    top_k experts among those M·E/G), each group inside one node when N divides G (c = G/N
    groups a node): the M groups are M of G drawn without replacement, j of them on the node
    with hypergeometric probability C(c, j)·C(G - c, M - j) / C(G, M), and the k experts k of
    the M·E/G, missing the node with probability C((M - j)·E/G, k) / C(M·E/G, k). The node
    limit is DeepSeek-V3's (report §2.1.2, "each token will be sent to at most M nodes"; its
    HF config n_group 8 = the 8 nodes of its EP 64, topk_group 4). When N does not divide G a
    group spans nodes and the limit is not counted (the unlimited figure: more nodes). Real
    routing picks groups by their best scores, not uniformly; the uniform figure is the
    expectation under balanced routing, the regime the auxiliary-loss-free balancing aims at
    (§2.1.2). It is below what the group selection gives: Megatron's group_limited_topk run in
    PyTorch on independent uniform scores (DeepSeek-V3's shape, 20,000 tokens) reaches 3.95
    nodes of 4 against this 3.63, groups chosen for their best scores each keeping some of the
    k."""
    if nodes <= 1:
        return Fraction(1)
    per_node = experts // nodes
    if not groups or groups % nodes:
        return 1 - Fraction(math.comb(experts - per_node, top_k), math.comb(experts, top_k))
    per_group, per_node_groups = experts // groups, groups // nodes
    pool = group_topk * per_group
    missed = Fraction(0)
    for j in range(min(per_node_groups, group_topk) + 1):
        chosen = Fraction(
            math.comb(per_node_groups, j) * math.comb(groups - per_node_groups, group_topk - j),
            math.comb(groups, group_topk),
        )
        missed += chosen * Fraction(math.comb(pool - j * per_group, top_k), math.comb(pool, top_k))
    return 1 - missed


def expected_nodes_reached(
    experts: int, top_k: int, nodes: int, groups: int = 0, group_topk: int = 0
) -> Fraction:
    """Expected number of distinct nodes a token's top_k experts sit on (derived: by linearity
    of expectation, N times `node_reach_probability`). At most group_topk when the groups lie
    inside nodes; DeepSeek-V3 (E 256, k 8, 8 nodes, 8 groups, 4 chosen): 4·(1 - C(96,8)/C(128,8))
    ≈ 3.62."""
    return nodes * node_reach_probability(experts, top_k, nodes, groups, group_topk)


def local_experts(spec: ModelSpec) -> int:
    """Experts held by one rank: E / ep (Megatron's num_local_experts)."""
    return spec.experts // spec.ep


def expert_matmul(spec: ModelSpec, shapes: LayerShapes, n: int, k: int) -> Matmul:
    """A grouped GEMM over this rank's R routed rows: one (R/E_l x k) @ (k x n) product per local
    expert, E_l = E/ep (TEGroupedMLP's GroupedLinear, one group per local expert). When R does
    not split evenly over the E_l experts (an imbalance factor), the groups are the gcd of R and
    E_l, so that 2·m·n·k·groups is the op's FLOPs exactly."""
    rows = routed_rows(spec, shapes)
    groups = math.gcd(rows, local_experts(spec))
    return Matmul(rows // groups, n, k, groups, shapes.B)


def router_probs_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes the routing kernels move, (forward, backward), per rank: the fused or unfused
    top-k and aux loss (`moe_router_fusion`), and with a capacity factor the token dropping."""
    if spec.moe_router_fusion:
        forward, backward = fused_router_moved(spec, shapes)
    else:
        forward, backward = unfused_router_moved(spec, shapes)
    dropping = token_dropping_moved(spec, shapes)
    return forward + dropping[0], backward + dropping[1]


def router_probs_saved(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the routing keeps for backward, per rank. Unfused (moe_utils.py): the top-k indices
    (int64, T·k), the fp32 softmax of the k selected scores (T·k) and the fp32 aux-loss softmax
    over all E (T·E). Fused (Transformer Engine v2.9 transformer_engine/pytorch/router.py):
    FusedTopkScoreFunction saves the routing map (T·E bool) and its intermediate output (B·T·E),
    FusedComputeScoresForMoEAuxLoss its intermediate output (B·T·E), FusedAuxLoss a scalar and
    the E counts (not counted). With a capacity factor the dropping's product keeps its mask
    (T·E bool, `token_dropping_moved`)."""
    tokens, E, k, B = shapes.stream_tokens, spec.experts, spec.top_k, shapes.B
    if spec.moe_router_fusion:
        saved = (MASK_BYTES + 2 * B) * tokens * E
    else:
        saved = (INDEX_BYTES + FP32_BYTES) * tokens * k + FP32_BYTES * tokens * E
    if spec.capacity_factor:
        saved += MASK_BYTES * tokens * E
    return saved


def fused_router_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes Megatron's fused routing moves, (forward, backward), per rank, T tokens, E experts,
    B-byte logits (--moe-router-fusion: Megatron-Core core_v0.14.0 .. 0d8e0714 router.py
    TopKRouter.routing and moe_utils.py, `fused=self.config.moe_router_fusion`, calling
    Transformer Engine's transformer_engine/pytorch/router.py, the same at v2.7 and v2.9, whose
    CUDA kernels are transformer_engine/common/fused_router/*.cu; each kernel reads and writes
    whole (T, E) rows of the logits' dtype):

    forward: fused_topk_with_score_function reads the logits (B·T·E) and writes the dense
    probabilities (B·T·E), the routing map (T·E) and its intermediate output (B·T·E);
    fused_score_for_moe_aux_loss the same for the aux loss's scores; the per-expert token
    counts, routing_map.sum(0) (T·E read); fused_moe_aux_loss reads the scores (B·T·E):
    (7B + 3)·T·E. backward: fused_moe_aux_loss_bwd writes the scores' gradient (B·T·E);
    fused_score_for_moe_aux_loss_bwd reads it and its intermediate and writes a logits
    gradient (3B·T·E); fused_topk_with_score_function_bwd reads the probabilities' gradient,
    the intermediate and the map and writes the other (3B + 1); autograd adds the two (3B):
    (10B + 1)·T·E."""
    te, B = shapes.stream_tokens * spec.experts, shapes.B
    forward = (3 * B + MASK_BYTES) * 2 + MASK_BYTES + B
    backward = B + 3 * B + (3 * B + MASK_BYTES) + 3 * B
    return forward * te, backward * te


def token_dropping_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes the router's token dropping moves with a capacity factor, (forward, backward), per
    rank; 0 dropless (Megatron-Core core_v0.14.0 moe_utils.py apply_router_token_dropping, the
    same at 0d8e0714, drop policy "probs" and pad_to_capacity, C = capacity per expert,
    `expert_capacity`; derived, each aten op reading its inputs and writing its output once):

    forward: torch.topk(probs, C, dim=0) reads B·T·E and writes E·C values and int64 indices;
    zeros_like(probs) writes B·T·E; .scatter(0, indices, 1), out of place, copies them (B·T·E
    each way) and writes E·C ones from E·C indices; .bool() reads B·T·E and writes T·E;
    probs * mask reads B·T·E and T·E and writes B·T·E. backward: the product's gradient for the
    probabilities, the output's gradient times the mask (B·T·E and T·E read, B·T·E written)."""
    if not spec.capacity_factor:
        return 0, 0
    tokens, E, B = shapes.stream_tokens, spec.experts, shapes.B
    te, slots = tokens * E, E * expert_capacity(spec, tokens)
    forward = (B + B + 2 * B + (B + MASK_BYTES) + (2 * B + MASK_BYTES)) * te
    forward += (B + INDEX_BYTES) * slots + (INDEX_BYTES + B) * slots
    backward = (2 * B + MASK_BYTES) * te
    return forward, backward


def unfused_router_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes the unfused top-k routing and aux-loss kernels move, (forward, backward), per rank
    (moe_utils.py: topk_routing_with_score_function with the default softmax after top-k,
    compute_routing_scores_for_aux_loss; T tokens, E experts, k, B-byte logits, int64 indices):

    forward: topk(logits) reads B·T·E, writes (B + 8)·T·k; the k-way softmax in fp32 and back
    (B -> 4 -> B over T·k); the dense probabilities zeros_like(logits).scatter (writes B·T·E,
    reads (8 + B)·T·k, writes B·T·k); the routing map zeros(int32).scatter.bool() (4·T·E,
    8·T·k read, 4·T·k, then 4·T·E read, T·E written); the aux loss: softmax(logits, fp32)
    (B·T·E read, 4·T·E written), its top-k (4·T·E read, 12·T·k written), its map as above
    (4 + 5 per T·E, 12 per T·k), the per-expert sums of the scores (4·T·E) and of the map (T·E).
    backward: the scatter's gather (B·T·k each way), the k-way softmax's backward in fp32
    (B + 4, 3·4 and 4 + B per T·k), top-k's backward into zeros (B·T·E, (8 + 2B)·T·k), the
    aux-loss softmax backward (reads its 4·T·E output, writes 4·T·E), cast to B (4 + B) and
    added into the logits' gradient (3B per T·E)."""
    tokens, E, k, B = shapes.stream_tokens, spec.experts, spec.top_k, shapes.B
    te, tk = tokens * E, tokens * k
    i, f = INDEX_BYTES, FP32_BYTES
    forward_te = B + B + (4 + 4 + 1) + (B + f) + f + (4 + 4 + 1) + f + MASK_BYTES
    forward_tk = (B + i) + (B + f) + (f + B) + (i + 2 * B) + (i + 4) + (f + i) + (i + 4)
    backward_te = B + f + f + (f + B) + 3 * B
    backward_tk = 2 * B + (B + f) + 3 * f + (f + B) + (i + 2 * B)
    return forward_te * te + forward_tk * tk, backward_te * te + backward_tk * tk


def sorts_by_local_expert(spec: ModelSpec) -> bool:
    """Whether the dispatcher re-sorts the received rows by local expert with
    `sort_chunks_by_idxs` (the fused kernel under --moe-permute-fusion): more than one local
    expert, dropless. Padded to capacity it reorders them with a transpose and a contiguous copy
    instead, fused or not (token_dispatcher.py at 0d8e0714, dispatch_postprocess and
    combine_preprocess, `if self.drop_and_pad`), the same bytes as the unfused split and cat."""
    return local_experts(spec) > 1 and not spec.capacity_factor


def permute_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes the token permutation moves, (forward, backward), per rank: Transformer Engine's
    fused kernels with `moe_permute_fusion` (`fused_permute_moved`), else the unfused ops."""
    if spec.moe_permute_fusion:
        return fused_permute_moved(spec, shapes)
    return unfused_permute_moved(spec, shapes)


def row_id_map_moved(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes Transformer Engine's make_row_id_map moves (v2.9 transformer_engine/pytorch/triton/
    permutation.py; the same three passes at v2.7): pass 1 reads the (T, E) boolean routing map
    and writes a per-block cumulative sum into the int32 (T, 2E + 1) map (1 + 4 per T·E); pass 2
    reads and rewrites it with the blocks' offsets (8); pass 3 reads each token's E entries (4)
    and writes its k destination rows and k expert indices (int32, 8 per row sent) and its count
    (4 per token)."""
    tokens, E = shapes.stream_tokens, spec.experts
    te = tokens * E
    written = 2 * ROW_ID_BYTES * sent_rows(spec, shapes) + ROW_ID_BYTES * tokens
    return (MASK_BYTES + ROW_ID_BYTES) * te + 2 * ROW_ID_BYTES * te + ROW_ID_BYTES * te + written


def fused_permute_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes Megatron's fused token permutation moves, (forward, backward), per rank
    (--moe-permute-fusion: Megatron-Core 0d8e0714 moe_utils.py `permute(..., fused=True)` calls
    Transformer Engine's moe_permute_with_probs, mask map; TE v2.9 transformer_engine/pytorch/
    permutation.py _moe_permute_mask_map and triton/permutation.py). S the rows sent (T·k, or
    E·capacity padded: the padded slots hold probability 0 and are written as zero rows), R the
    rows received, B-byte values and probabilities, int32 maps:

    forward: the row map (`row_id_map_moved`); _permute_kernel reads each token's row once
    (B·T·h) and its count (4·T), and per row sent its destination and expert (8), the
    probability (B read, B written) and the row (B·h written); dropless with more than one local
    expert, the received rows sorted by expert (make_chunk_sort_map writes an int32 map of R,
    _sort_chunks_by_map_kernel reads it and copies the R rows and probabilities: 2B·R·(h + 1)
    + 8R; `sorts_by_local_expert`, else the transposed copy, 2B·R·(h + 1)). backward:
    unpermute_with_mask_map zeroes the (T, E) probability gradient (B·T·E written), reads the
    counts (4·T), per row its source and expert (8), the row's gradient (B·h) and the
    probability's (B read, B written), and writes B·T·h; the sort's inverse, 2B·R·(h + 1) + 4R
    (the map read)."""
    tokens, E, h, B = shapes.stream_tokens, spec.experts, spec.hidden, shapes.B
    sent, rows = sent_rows(spec, shapes), routed_rows(spec, shapes)
    per_row = 2 * ROW_ID_BYTES + 2 * B + B * h
    forward = row_id_map_moved(spec, shapes) + B * tokens * h + ROW_ID_BYTES * tokens
    forward += per_row * sent
    backward = B * tokens * E + ROW_ID_BYTES * tokens + per_row * sent + B * tokens * h
    if local_experts(spec) > 1:
        forward += 2 * B * rows * (h + 1)
        backward += 2 * B * rows * (h + 1)
    if sorts_by_local_expert(spec):
        forward += 2 * ROW_ID_BYTES * rows
        backward += ROW_ID_BYTES * rows
    return forward, backward


def padded_permute_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes the unfused permutation moves padded to capacity, (forward, backward), per rank
    (Megatron-Core core_v0.14.0 moe_utils.py `permute(..., drop_and_pad=True)`, the same at
    0d8e0714: every expert's column of the routing map holds its capacity C, S = E·C; derived,
    each aten op reading its inputs and writing its outputs once, views free):

    forward: the map cast to int8 (T·E each way) and transposed into a copy (T·E each way);
    argsort of each expert's row, a sort that writes the int8 values and the int64 indices
    (T·E read, 9·T·E written); the first C of each row copied (8S each way); the probabilities
    transposed into a copy (B·T·E each way); the flat indices arange(E)·T + index (8E written,
    8E each way, 8E and 8S read, 8S written); the probabilities' index_select (8S indices, B·S
    values read, B·S written) and the tokens' (8S indices, B·S·h read and written). With more
    than one local expert, the received rows are reordered by a transposed copy, B·R·(h + 1)
    each way. backward: each index_select's, an index_add into zeros: B·T·h written, then 8S
    indices and B·S·h read and B·S·h written; B·T·E written, then 8S, B·S and B·S (the
    transposed copy's backward is a view); the reorder's inverse, B·R·(h + 1) each way."""
    tokens, E, h, B = shapes.stream_tokens, spec.experts, spec.hidden, shapes.B
    sent, rows = sent_rows(spec, shapes), routed_rows(spec, shapes)
    te, i = tokens * E, INDEX_BYTES
    forward = 2 * te + 2 * te + (te + te + i * te) + 2 * i * sent + 2 * B * te
    forward += i * E + 2 * i * E + (i * E + 2 * i * sent)
    forward += (i + 2 * B) * sent + (i * sent + 2 * B * sent * h)
    backward = B * tokens * h + i * sent + 2 * B * sent * h
    backward += B * te + i * sent + 2 * B * sent
    if local_experts(spec) > 1:
        forward += 2 * B * rows * (h + 1)
        backward += 2 * B * rows * (h + 1)
    return forward, backward


def permute_saved(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the permutation keeps for backward, per rank. Unfused: the sorted token indices
    (int64, one per row sent), and the boolean routing map and the transposed (E, T)
    probabilities masked_select keeps; padded to capacity, the int64 indices of the tokens' and
    of the probabilities' index_select. Fused (TE v2.9 permutation.py): _moe_permute_mask_map
    saves its int32 (T, 2E + 1) row map, which the dispatcher keeps for the unpermutation too;
    dropless with more than one local expert, _moe_chunk_sort its int32 map of the R rows."""
    tokens, E, B = shapes.stream_tokens, spec.experts, shapes.B
    if not spec.moe_permute_fusion and spec.capacity_factor:
        # padded (`padded_permute_moved`): the two index_selects keep their int64 indices
        return 2 * INDEX_BYTES * sent_rows(spec, shapes)
    if not spec.moe_permute_fusion:
        return INDEX_BYTES * sent_rows(spec, shapes) + MASK_BYTES * tokens * E + B * tokens * E
    saved = ROW_ID_BYTES * tokens * (2 * E + 1)
    if sorts_by_local_expert(spec):
        saved += ROW_ID_BYTES * routed_rows(spec, shapes)
    return saved


def unfused_permute_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes the unfused token permutation moves, (forward, backward), per rank (moe_utils.py
    `permute`; token_dispatcher.py MoEAlltoAllTokenDispatcher `sort_chunks_by_idxs`):

    forward: the routing map transposed (T·E bytes read and written); the token indices
    masked_select'ed (reads the map and T int64 indices, writes S int64); the probabilities
    transposed (B·T·E each way) and masked_select'ed (reads (B + 1)·T·E, writes B·S);
    tokens.index_select (reads S indices and S rows of h, writes S rows): S = the rows sent,
    T·k or E·capacity. With more than one local expert, the received R rows (and their
    probabilities) are sorted by expert after the all-to-all: split + cat, B·R·(h + 1) each way.
    backward: index_select's backward, an index_add of the S row gradients into zeros (B·T·h
    written, S indices and B·S·h read, B·S·h accumulated); masked_select's backward into zeros
    (B·T·E, the T·E map, B·S read and B·S written) and the transposed copy back (B·T·E each
    way); the sort's inverse, B·R·(h + 1) each way. Padded to capacity the indices come another
    way (`padded_permute_moved`)."""
    if spec.capacity_factor:
        return padded_permute_moved(spec, shapes)
    tokens, E, h, B = shapes.stream_tokens, spec.experts, spec.hidden, shapes.B
    sent, rows = sent_rows(spec, shapes), routed_rows(spec, shapes)
    te = tokens * E
    forward = 2 * MASK_BYTES * te + INDEX_BYTES * (tokens + sent)
    forward += 2 * B * te + (B + MASK_BYTES) * te + B * sent
    forward += INDEX_BYTES * sent + 2 * B * sent * h
    backward = B * tokens * h + INDEX_BYTES * sent + 2 * B * sent * h
    backward += B * te + MASK_BYTES * te + 2 * B * sent + 2 * B * te
    if local_experts(spec) > 1:
        forward += 2 * B * rows * (h + 1)
        backward += 2 * B * rows * (h + 1)
    return forward, backward


def unpermute_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes the unfused un-permutation and the MoE block's adds move, (forward, backward), per
    rank (token_dispatcher.py combine_preprocess / combine_postprocess, moe_utils.py
    `unpermute` without probabilities, which the weighted activation applied):

    forward: with more than one local expert the R output rows un-sorted (B·R·h each way); the
    scatter_add of the S returned rows into zeros (B·T·h written, S indices and B·S·h read,
    B·S·h accumulated); the shared experts' output added (3X) and the residual add (3X, unless
    the block's bias-dropout-add does it, `mlp_dropout`). backward: scatter_add's backward, a
    gather of the S rows' gradients (S indices, B·S·h each way), and the un-sort's inverse.
    torchtitan weights the outputs here instead: its weighting's traffic is added
    (`combine_weighting_moved`).

    With `moe_permute_fusion` (moe_utils.py `unpermute(..., fused=True)`, TE v2.9
    _moe_unpermute_mask_map without merging probabilities and _moe_chunk_sort): the un-sort as
    in `fused_permute_moved` without probabilities (2B·R·h, + 8R forward and 4R backward for its
    map when `sorts_by_local_expert`); _unpermute_kernel reads each token's count (4·T), per row
    returned its source (4) and the row (B·h), and writes the sum, B·T·h; its backward is
    permute_with_mask_map without probabilities: B·T·h and 4·T read, per row 4 read and B·h
    written."""
    tokens, h, B = shapes.stream_tokens, spec.hidden, shapes.B
    sent, rows = sent_rows(spec, shapes), routed_rows(spec, shapes)
    if spec.moe_permute_fusion:
        per_row = ROW_ID_BYTES + B * h
        forward = ROW_ID_BYTES * tokens + per_row * sent + B * tokens * h
        backward = B * tokens * h + ROW_ID_BYTES * tokens + per_row * sent
        if sorts_by_local_expert(spec):
            forward += 2 * ROW_ID_BYTES * rows
            backward += ROW_ID_BYTES * rows
    else:
        forward = B * tokens * h + INDEX_BYTES * sent + 2 * B * sent * h
        backward = INDEX_BYTES * sent + 2 * B * sent * h
    if local_experts(spec) > 1:
        forward += 2 * B * rows * h
        backward += 2 * B * rows * h
    if spec.shared_ffn_hidden:
        forward += shapes.residual_add
    if spec.dropout == 0:
        forward += shapes.residual_add
    weighting = combine_weighting_moved(spec, shapes)
    return forward + weighting[0], backward + weighting[1]


def weighting_inputs_moved(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the forward moves to make the two tensors torchtitan's combine weights with, per
    rank, over the S rows sent back (torchtitan 0.3.0, models/common/token_dispatcher.py:
    `_local_reorder` gathers `topk_scores_TK.view(-1)[token_indices_experts_sorted_N]`, S int64
    indices and S fp32 scores read, S fp32 written; `combine` casts the experts' outputs with
    `routed_output_RD.to(torch.float32)`, B·S·h read and 4·S·h written). 0 where the combine
    does not weight in fp32 (`combine_weighting_saved`)."""
    if spec.framework != "torchtitan":
        return 0
    sent, h, B = sent_rows(spec, shapes), spec.hidden, shapes.B
    return (INDEX_BYTES + 2 * FP32_BYTES) * sent + (B + FP32_BYTES) * sent * h


def combine_weighting_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes torchtitan's weighting of the experts' outputs moves, (forward, backward), per rank
    over the S rows sent back (torchtitan 0.3.0, models/common/token_dispatcher.py `combine`:
    `(routed_output_RD.to(torch.float32) * topk_scores_experts_sorted_N.reshape(-1, 1)).to(
    routed_output_RD.dtype)`; derived, each aten op reading its inputs and writing its output
    once).

    forward: the scores' gather and the fp32 cast (`weighting_inputs_moved`); the product, 4·S·h
    and 4·S read, 4·S·h written; the cast back, 4·S·h read, B·S·h written. backward: the cast
    back's, B·S·h read, 4·S·h written; the product's two gradients, the copy's (4·S·h and 4·S
    read, 4·S·h written) and the scores' (a row sum of the gradient times the copy, 2·4·S·h
    read, 4·S written); the cast's, 4·S·h read, B·S·h written; the gather's, a scatter of S
    scores (S indices and 4·S read, 4·S written). 0 outside torchtitan."""
    if spec.framework != "torchtitan":
        return 0, 0
    sent, h, B = sent_rows(spec, shapes), spec.hidden, shapes.B
    rows_fp32 = FP32_BYTES * sent * h
    forward = weighting_inputs_moved(spec, shapes)
    forward += 2 * rows_fp32 + FP32_BYTES * sent + rows_fp32 + B * sent * h
    backward = B * sent * h + rows_fp32
    backward += 2 * rows_fp32 + FP32_BYTES * sent
    backward += 2 * rows_fp32 + FP32_BYTES * sent
    backward += rows_fp32 + B * sent * h
    backward += (INDEX_BYTES + 2 * FP32_BYTES) * sent
    return forward, backward


def expert_act_moved(spec: ModelSpec, shapes: LayerShapes) -> tuple[int, int]:
    """Bytes the weighted activation moves over the R rows, (forward, backward), F = F_e/etp
    (experts.py TEGroupedMLP bias_act_func): fused (weighted_bias_swiglu_impl) it reads the
    gate and up halves and the probability, writes F: B·R·(3F + 1); backward reads dY, the
    input and the probability, writes the input's and the probability's gradients: B·R·(5F + 2).
    Eager, the dense SwiGLU's 5F / 8F (`ops.mlp_block_ops`) plus the product with the
    probability, F + 1 read and F written, and its backward, 4F + 2 (dY·p, and Σ dY ⊙ y);
    GELU 2F / 3F plus the same product."""
    rows, B = routed_rows(spec, shapes), shapes.B
    F = spec.moe_ffn_hidden // spec.etp
    weighted = (2 * F + 1, 4 * F + 2)
    if spec.mlp == "gelu":
        act = (2 * F, 3 * F)
    elif spec.fused_swiglu:
        return B * rows * (3 * F + 1), B * rows * (5 * F + 2)
    else:
        act = (5 * F, 8 * F)
    return B * rows * (act[0] + weighted[0]), B * rows * (act[1] + weighted[1])


FP8_ROW_ALIGN = 16  # Transformer Engine v2.9 Fp8Padding: 16 rows
MXFP8_ROW_ALIGN = 32  # ... and 32 under MXFP8 (`32 if ...get_fp8_recipe().mxfp8() else 16`)


def fp8_row_align(spec: ModelSpec) -> int:
    """The rows Fp8Padding aligns each expert's input to: 32 under the MXFP8 recipe, else 16
    (Transformer Engine v2.9 transformer_engine/pytorch/module/fp8_padding.py, `align_size`)."""
    return MXFP8_ROW_ALIGN if spec.fp8_recipe == "mxfp8" else FP8_ROW_ALIGN


def fp8_pads_expert_rows(spec: ModelSpec, shapes: LayerShapes) -> bool:
    """Whether the grouped GEMMs' input rows are copied into an FP8-aligned buffer.

    Megatron-Core's TEGroupedMLP under FP8 (core_v0.15.0 line, commit 0d8e0714 that
    Megatron-Bridge v0.2.0 pins: megatron/core/transformer/moe/experts.py, `forward`) passes
    its input and probabilities through `Fp8Padding(num_local_experts)` and its output through
    `Fp8Unpadding`; Transformer Engine v2.9 (transformer_engine/pytorch/module/fp8_padding.py)
    returns the input untouched only when every local expert's row count is already a multiple
    of its alignment (`fp8_row_align`: 16, 32 under MXFP8; `if m_splits == padded_m_splits:
    return inp, m_splits`), else copies every row (`tex.fused_multi_row_padding`). Dropless,
    the counts are the routing's: a copy (derived: all E/ep counts multiples of 16 is the
    exception, about 16^-(E/ep) for random routing); with a capacity factor every local expert
    holds R/(E/ep) rows, a copy when that is not a multiple of the alignment. Megatron's FP8
    ("fp8", Transformer Engine) only: torchtitan, Hugging Face and DeepSpeed run no
    TEGroupedMLP. core_v0.14.0 pads the same way (its `fp8_padding`). Megatron's
    --moe-router-padding-for-fp8, off by default, would pad the routing map instead and skip
    the copy; ckplan has no key for it."""
    if not spec.experts or spec.precision != "fp8" or spec.framework != "megatron":
        return False
    if not spec.capacity_factor:
        return True
    return (routed_rows(spec, shapes) // local_experts(spec)) % fp8_row_align(spec) != 0


def fp8_padded_rows(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Rows of the padded buffer: each local expert's R/(E/ep) rows rounded up to its alignment
    (`fp8_row_align`; TE v2.9 Fp8Padding, `(m + align_size - 1) // align_size * align_size`).
    Exact with a capacity factor; dropless, the counts vary around that mean and the up to 15
    (31 under MXFP8) zero rows per expert they add are not counted."""
    rows, experts = routed_rows(spec, shapes), local_experts(spec)
    align = fp8_row_align(spec)
    return experts * -(-(rows // experts) // align) * align


def fp8_padding_moved(
    spec: ModelSpec, shapes: LayerShapes
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Bytes the FP8 row padding of the expert GEMMs moves, ((fc1 forward, fc1 backward), (fc2
    forward, fc2 backward)) over the R routed rows, R' padded (`fp8_padded_rows`), B-byte values
    (the probabilities have the logits' dtype); zeros where nothing is padded
    (`fp8_pads_expert_rows`). TE v2.9 fp8_padding.py / fp8_unpadding.py, each a row copy that
    reads its rows and writes the others:

    fc1 side: the input padded, B·(R + R')·h, and the probabilities, B·(R + R'); backward,
    `_Fp8Padding.backward` un-pads the input's gradient and the probabilities', the same bytes.
    fc2 side: the output un-padded, B·(R' + R)·h; backward, `_Fp8Unpadding.backward` pads the
    output's gradient, the same."""
    if not fp8_pads_expert_rows(spec, shapes):
        return (0, 0), (0, 0)
    rows = routed_rows(spec, shapes) + fp8_padded_rows(spec, shapes)
    fc1 = shapes.B * rows * (spec.hidden + 1)
    fc2 = shapes.B * rows * spec.hidden
    return (fc1, fc1), (fc2, fc2)


def shared_gate_moved(shapes: LayerShapes) -> tuple[int, int]:
    """Qwen2-MoE's sigmoid(x·w_g) · shared output over T tokens, (forward, backward): the
    sigmoid (B·T each way) and the product (X + B·T read, X written); backward the shared
    output's gradient dY·g (X + B·T read, X written), the gate's Σ dY ⊙ y (2X read, B·T
    written) and the sigmoid's backward (2B·T read, B·T written)."""
    BT = shapes.B * shapes.stream_tokens
    X = shapes.X
    return 2 * BT + 2 * X + BT, (2 * X + BT) + (2 * X + BT) + 3 * BT


def expert_act_saved_bytes(
    spec: ModelSpec, B: int, rows: int, act_saved: int, fc1_width: int, weighted: int
) -> int:
    """What the experts' activation saves for its backward over `rows` routed rows: its saved
    tensors, `act_saved` values wide, and the routing probabilities where it weights by them
    (`weighted`), B bytes each. With `moe_act_input_fp8` (DeepSeek-V3 Technical Report, arXiv
    2412.19437, §3.3.3 "Low-Precision Activation" (2): "we cache the inputs of the SwiGLU
    operator and recompute its output in the backward pass. These activations are also stored
    in FP8"): its input only, the fc1 output `fc1_width` wide, at 1 byte a value; the
    probabilities stay B bytes (the report does not say otherwise). The 1x128 tiles' scaling
    factors are not counted, as for every FP8 cache (`ops.fp8_saved`)."""
    if spec.moe_act_input_fp8:
        return rows * fc1_width + B * rows * weighted
    return B * rows * (act_saved + weighted)


def probabilities_in_activation(spec: ModelSpec) -> bool:
    """Whether the routing probabilities weight the experts' activation (saved there) rather
    than their outputs after fc2. Megatron-Core core_v0.19.0: the all-to-all dispatcher's
    combine calls `unpermute` without probs (token_dispatcher.py combine_postprocess) and
    TEGroupedMLP applies them in bias_act_func (experts.py, weighted_bias_swiglu_impl);
    DeepSpeed, whose model code is the user's, keeps this Megatron default. torchtitan 0.3.0
    and Hugging Face transformers 5.25.0 weight the outputs (`combine_weighting_saved`)."""
    return spec.framework not in ("torchtitan", "hf")


def combine_weighting_saved(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the product of the experts' outputs and their routing scores saves, over the S
    rows sent back (T·k dropless): the outputs for the scores' gradient, the scores for the
    outputs'.

    torchtitan 0.3.0 (torchtitan/models/common/token_dispatcher.py, LocalTokenDispatcher and
    the all-to-all dispatcher's combine: `routed_output_RD.to(torch.float32) *
    topk_scores_experts_sorted_N.reshape(-1, 1)`, the router's scores in fp32,
    models/common/moe.py): an fp32 copy of the outputs and the fp32 scores, 4·S·(h + 1).
    Hugging Face transformers 5.25.0 (models/mixtral/modeling_mixtral.py MixtralExperts.forward,
    `current_hidden_states * top_k_weights[token_idx, top_k_pos, None]`, the weights the fp32
    softmax of MixtralTopKRouter): the B-byte outputs and the fp32 weights, (B·h + 4)·S.
    Megatron-Core weights the activation instead (`probabilities_in_activation`): 0."""
    sent = sent_rows(spec, shapes)
    if spec.framework == "torchtitan":
        return FP32_BYTES * sent * (spec.hidden + 1)
    if spec.framework == "hf":
        return (shapes.B * spec.hidden + FP32_BYTES) * sent
    return 0


def unsort_map_saved(spec: ModelSpec, shapes: LayerShapes) -> int:
    """The int32 map of the R rows the fused un-sort by local expert keeps for backward (TE v2.9
    permutation.py _moe_chunk_sort, `ctx.save_for_backward(row_id_map)`): with
    `moe_permute_fusion` when `sorts_by_local_expert`, else 0."""
    if spec.moe_permute_fusion and sorts_by_local_expert(spec):
        return ROW_ID_BYTES * routed_rows(spec, shapes)
    return 0


def experts_input_bytes(spec: ModelSpec, shapes: LayerShapes) -> int:
    """What recomputing the expert MLPs keeps: their dispatched tokens and probabilities."""
    rows = routed_rows(spec, shapes)
    return shapes.B * rows * (spec.hidden + 1)


def moe_ops(spec: ModelSpec, shapes: LayerShapes, out_grad: int) -> list[Op]:
    """The ops of one MoE MLP on one GPU, in forward order (after norm2).

    Saved bytes per op (derived from each op's backward in the Megatron code named above):
    router: its input x (T·h; the shared experts read the same storage); router_probs: the
    top-k indices (int64), the fp32 softmax of the k selected scores, the fp32 aux-loss softmax
    over all E experts, or the fused kernels' maps (`router_probs_saved`); permute: the sorted
    token indices (int64, one per dispatched copy), and the boolean routing map and the
    transposed (E, T) probabilities masked_select keeps (its backward needs its input's shape:
    autograd saves the input itself), or the fused kernels' int32 row maps (`permute_saved`);
    expert_fc1: its input,
    the R dispatched rows; expert_act: its input (fc1's output, 2F_e/etp gated) and the R
    routing probabilities it weights by (Megatron; torchtitan and Hugging Face weight the outputs
    instead: no probabilities there); expert_fc2: its input; unpermute: what weighting the
    outputs by their scores saves (`combine_weighting_saved`; nothing in Megatron, whose
    scatter-add reuses permute's indices, but the fused un-sort's map, `unsort_map_saved`).
    All-to-all and all-gather save nothing.
    `out_grad` is the gradient of the block's output the last op reads (0: the residual
    stream's, which the walk counts).
    """
    B, X = shapes.B, shapes.X
    tokens, h, E = shapes.stream_tokens, spec.hidden, spec.experts
    rows = routed_rows(spec, shapes)
    sent = sent_rows(spec, shapes)
    gated = spec.mlp != "gelu"
    ffn_r = spec.moe_ffn_hidden // spec.etp  # each expert's width on this rank
    fc1_width = (2 if gated else 1) * ffn_r
    act_saved = (2 if spec.fused_swiglu else 3) * ffn_r if gated else ffn_r
    weighted = probabilities_in_activation(spec)  # else the combine weights the outputs
    padding = fp8_padding_moved(spec, shapes)  # FP8: the rows copied to 16-row alignment
    shared = spec.shared_ffn_hidden > 0
    logits = B * tokens * E
    # x's gradient: allocated by the first of its readers to be backpropagated (the shared
    # experts' fc1, else permute); the others' are added into it (workspace).
    # The gradients of x from its readers (router, permutation, shared experts, their gate) are
    # summed by autograd: one add (2 read, 1 written) per reader after the first.
    readers = 2 + shared + (shared and spec.shared_expert_gate)
    ops = [
        make_op(
            "router",
            "mlp",
            X,
            matmul_flops(tokens, E, h),
            MOE,
            grads=(logits, 0),
            workspace=X,
            matmul=Matmul(tokens, E, h, 1, B),  # whole on every rank, over its T tokens
            moved=(0, (readers - 1) * shapes.residual_add),
        ),
        make_op(
            "router_probs",
            "mlp",
            router_probs_saved(spec, shapes),
            0,
            MOE,
            grads=(logits, logits),
            workspace=FP32_BYTES * tokens * E,
            moved=router_probs_moved(spec, shapes),
        ),
        make_op(
            "permute",
            "mlp",
            permute_saved(spec, shapes),
            0,
            MOE,
            grads=(B * rows * (h + 1), logits + (0 if shared else X)),
            workspace=B * sent * h + (X if shared else 0),
            moved=permute_moved(spec, shapes),
        ),
        make_op(
            "expert_fc1",
            "mlp",
            B * rows * h,
            matmul_flops(rows, fc1_width, h),
            EXPERTS,
            grads=(B * rows * fc1_width, B * rows * h),
            matmul=expert_matmul(spec, shapes, fc1_width, h),
            moved=padding[0],
        ),
        make_op(
            "expert_act",
            "mlp",
            expert_act_saved_bytes(spec, B, rows, act_saved, fc1_width, weighted),
            0,
            EXPERTS,
            grads=(B * rows * ffn_r, B * rows * (fc1_width + 1)),
            moved=expert_act_moved(spec, shapes),
        ),
        make_op(
            "expert_fc2",
            "mlp",
            B * rows * ffn_r,
            matmul_flops(rows, h, ffn_r),
            EXPERTS,
            grads=(B * rows * h, B * rows * ffn_r),
            matmul=expert_matmul(spec, shapes, h, ffn_r),
            moved=padding[1],
        ),
        make_op(
            "unpermute",
            "mlp",
            combine_weighting_saved(spec, shapes) + unsort_map_saved(spec, shapes),
            0,
            MOE,
            grads=(out_grad, B * rows * h),
            workspace=B * sent * h,
            moved=unpermute_moved(spec, shapes),
        ),
    ]
    if shared:
        gate = spec.shared_expert_gate
        ops += mlp_block_ops(
            spec, shapes, spec.shared_ffn_hidden, X if gate else 0, "shared_", input_saved=False,
            group=SHARED_EXPERTS,
        )  # fmt: skip
        if gate:
            # sigmoid(x·w_g) · shared output: the product saves both (T·h and T values).
            ops.append(
                make_op(
                    "shared_gate",
                    "mlp",
                    B * tokens * (h + 1),
                    matmul_flops(tokens, 1, h),
                    SHARED_EXPERTS,  # SharedExpertMLP.forward applies its gate
                    grads=(0, X),
                    workspace=X,
                    matmul=Matmul(tokens, 1, h, 1, B),
                    moved=shared_gate_moved(shapes),
                )
            )
    return ops


def router_bias_parameters(spec: ModelSpec) -> int:
    """The router's per-expert biases: DeepSeek-V3's routing bias (expert_bias; Megatron-Core's
    --moe-router-enable-expert-bias) and, with `bias`, the gating linear's own bias
    (Megatron-Core's TopKRouter under add_bias_linear, router.py since core_v0.15.0;
    GptOssTopKRouter.bias, modeling_gpt_oss.py, transformers v5.25.0)."""
    return spec.experts * (int(spec.expert_bias) + int(spec.bias))


def moe_layer_parameters(spec: ModelSpec) -> tuple[int, int, int]:
    """(tensor-parallel, replicated, expert) parameters of one MoE MLP.

    Experts: E·(h·w1 + F_e·h) with w1 = 2F_e gated (gate and up) or F_e, plus biases, split
    over ep·etp ranks. Router E·h (+ `router_bias_parameters`), whole on every rank
    (Megatron's TopKRouter weight is not tensor-parallel). Shared experts: a TP-split MLP of
    shared_ffn_hidden; their sigmoid gate h, whole. Mixtral-8x7B: 1,409,318,912 per layer.
    """
    h, E, F = spec.hidden, spec.experts, spec.moe_ffn_hidden
    gated = spec.mlp != "gelu"
    w1 = (2 if gated else 1) * F
    expert = h * w1 + F * h + ((w1 + h) if spec.bias else 0)
    replicated = E * h + router_bias_parameters(spec)
    split = 0
    if spec.shared_ffn_hidden:
        S = spec.shared_ffn_hidden
        sw1 = (2 if gated else 1) * S
        split = h * sw1 + S * h + ((sw1 + h) if spec.bias else 0)
        replicated += h if spec.shared_expert_gate else 0
    return split, replicated, E * expert
