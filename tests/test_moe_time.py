"""The time model for MoE and MLA layers: GEMM shapes, bytes moved, expert-parallel
communication, expert-data-parallel reduction, the optimizer over held parameters, MoE MFU."""

import dataclasses

import pytest
from needs_torch import torch_or_skip
from small_specs import SMALL_MOE

from ckplan.hardware import communication as comm
from ckplan.hardware.expert_parallel import (
    ExpertParallelComm,
    combine_bytes,
    dispatch_bytes,
    expert_parallel_comm,
    exposed_fraction,
)
from ckplan.hardware.gpus import GPUError, gpu_from_mapping
from ckplan.hardware.roofline import (
    backward_matmuls,
    contended_matmul_seconds,
    matmul_seconds,
    op_forward_time,
)
from ckplan.hardware.step_time import (
    data_parallel_seconds,
    layer_time,
    mla_comm,
    optimizer_seconds,
    step_time,
    tensor_parallel_comm,
)
from ckplan.inputs.gpus import load_gpu
from ckplan.model import memory
from ckplan.model.flops import model_flops_per_iteration
from ckplan.model.layers import LayerKind
from ckplan.model.moe import (
    expert_matmul,
    fp8_padded_rows,
    fp8_pads_expert_rows,
    fp8_row_align,
    routed_rows,
)
from ckplan.model.op import LayerShapes
from ckplan.model.ops import layer_ops
from ckplan.model.spec import spec_from_mapping
from ckplan.plan import evaluate, parse_strategy

MOE_LAYER = LayerKind(moe=True)
DENSE_LAYER = LayerKind()

SMALL = SMALL_MOE
# h 64, a 4, q_lora 16, kv_lora 8, nope 8, rope 4, v 8; s 16, b 1 (T = 16), B = 2.
MLA = {
    "name": "small-mla",
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "seq": 16,
    "micro_batch": 1,
    "vocab": 0,
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention": "flash",
    "bias": False,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
}


def small(**changes):
    return spec_from_mapping({**SMALL, **changes})


def tensor_bytes(value) -> int:
    """The bytes of a tensor argument or output of an aten op; 0 for anything else."""
    import torch

    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def byte_tally(moved_by):
    """A TorchDispatchMode class whose `moved` adds up `moved_by(func, args, outputs)` over every
    aten op dispatched inside it: the bytes a block of PyTorch code moves, by the caller's rule."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tally(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Tally.moved += moved_by(func, args, out if isinstance(out, tuple) else (out,))
            return out

    return Tally


def moe_ops(spec):
    return {op.name: op for op in layer_ops(spec, MOE_LAYER)}


@pytest.fixture
def h100():
    return load_gpu("h100-sxm")


# ---- op annotations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("mixtral-8x7b", {}),
        ("mixtral-8x7b", {"tp": 2, "sp": True, "ep": 4, "dp": 4}),
        ("deepseek-v3", {"pp": 61, "ep": 64, "dp": 64}),
        ("deepseek-v3", {"tp": 4, "sp": True, "pp": 61, "ep": 8, "etp": 1, "dp": 2}),
        ("qwen3-30b-a3b", {"ep": 8, "dp": 8, "moe_imbalance": "1.37"}),
        ("qwen3-30b-a3b", {"ep": 4, "dp": 4, "capacity_factor": 1.25}),
    ],
)
def test_every_moe_and_mla_matmul_matches_its_flops(spec_of, name, overrides):
    """The GEMM shapes the time model reads reproduce the FLOPs the memory/FLOP model counts,
    for every op of every layer kind: router, grouped expert GEMMs (also under an imbalance
    factor whose rows do not split evenly over the local experts), shared experts, MLA."""
    spec = spec_of(name, **overrides)
    for kind in (DENSE_LAYER, MOE_LAYER):
        for op in layer_ops(spec, kind):
            if op.forward_flops and not op.fused_kernel:
                assert op.matmul is not None, (name, op.name)
                mm = op.matmul
                assert op.forward_flops == 2 * mm.batch * mm.m * mm.n * mm.k, (name, op.name)


def test_moe_ops_carry_shapes_bytes_and_no_tp_collective():
    """Router (T x h) @ (h x E); experts grouped over the E/ep local experts; the permutation,
    routing and activation kernels move bytes; only the shared experts are tensor-parallel."""
    ops = moe_ops(small(shared_experts=1))
    assert (ops["router"].matmul.m, ops["router"].matmul.n, ops["router"].matmul.k) == (64, 4, 64)
    fc1 = ops["expert_fc1"].matmul
    assert (fc1.m, fc1.n, fc1.k, fc1.batch) == (128 // 4, 2 * 32, 64, 4)
    fc2 = ops["expert_fc2"].matmul
    assert (fc2.m, fc2.n, fc2.k, fc2.batch) == (32, 64, 32, 4)
    for name in ("router_probs", "permute", "expert_act", "unpermute"):
        assert ops[name].forward_bytes > 0 and ops[name].backward_bytes > 0, name
    tp = {name for name, op in ops.items() if op.tp_comm}
    assert tp == {"qkv_proj", "out_proj", "shared_fc1", "shared_fc2"}


def test_moe_bytes_moved_by_hand():
    """T = 64, E = 4, k = 2, S = R = 128 rows, h = 64, F = 32, B = 2, one rank (4 local
    experts, so the received rows are sorted by expert too).
    expert_act (fused weighted SwiGLU): B·R·(3F + 1) = 2·128·97; backward B·R·(5F + 2).
    permute: map transposed 2·T·E, indices 8·(T + S), probabilities transposed 2B·T·E and
    masked_select'ed (B + 1)·T·E + B·S, index_select 8·S + 2B·S·h, the sort 2B·R·(h + 1).
    unpermute: zeros B·T·h, scatter_add 8·S + 2B·S·h, un-sort 2B·R·h, the residual add 3X.
    router_probs forward: per (token, expert) 2B + 9 (top-k read, dense probabilities, int map
    and its bool) + (B + 4) + 4 + 9 + 4 + 1 (aux softmax, its top-k, map, sums) = 37; per
    (token, choice) 70 (top-k outputs, k-way softmax and casts, scatters)."""
    ops = moe_ops(small())
    assert ops["expert_act"].forward_bytes == 2 * 128 * 97
    assert ops["expert_act"].backward_bytes == 2 * 128 * 162
    permute = 2 * 256 + 8 * (64 + 128) + 4 * 256 + 3 * 256 + 2 * 128
    permute += 8 * 128 + 4 * 128 * 64 + 4 * 128 * 65
    assert ops["permute"].forward_bytes == permute == 71168
    X = 2 * 64 * 64
    unpermute = 2 * 64 * 64 + 8 * 128 + 4 * 128 * 64 + 4 * 128 * 64 + 3 * X
    assert ops["unpermute"].forward_bytes == unpermute
    assert ops["unpermute"].backward_bytes == 8 * 128 + 4 * 128 * 64 + 4 * 128 * 64
    assert ops["router_probs"].forward_bytes == 37 * 256 + 70 * 128
    # With one local expert (ep = E) nothing is sorted: 2B·R·(h + 1) less.
    ep4 = small(ep=4, dp=4, tp=1)
    assert moe_ops(ep4)["permute"].forward_bytes == permute - 4 * 128 * 65


def test_fused_permutation_bytes_by_hand():
    """--moe-permute-fusion on the small layer (T = 64, E = 4, k = 2, S = R = 128, h = 64,
    B = 2, four local experts: the fused sort by expert runs), Transformer Engine v2.9's kernels
    tensor by tensor. make_row_id_map: the bool map read (256) and the int32 (T, 2E + 1) map's
    first E columns written (1,024), read and rewritten (2,048), read (1,024), and per token its
    k rows and k experts (1,024) and its count (256). _permute_kernel: the 64 input rows
    (8,192), the counts (256), per row sent its row and expert (8), its probability read and
    written (4) and the row written (128). The sort: a 128-row int32 map written and read
    (1,024), the rows and probabilities copied (4·128·65). backward: the (T, E) probability
    gradient zeroed (512), counts (256), per row 140 again, B·T·h written (8,192), the sort's
    inverse (33,280 + 512)."""
    ops = moe_ops(small(moe_permute_fusion=True))
    row_map = 256 + 1024 + 2048 + 1024 + 1024 + 256
    forward = row_map + 8192 + 256 + 140 * 128 + 1024 + 4 * 128 * 65
    assert ops["permute"].forward_bytes == forward == 66304
    assert ops["permute"].backward_bytes == 512 + 256 + 140 * 128 + 8192 + 4 * 128 * 65 + 512
    assert ops["permute"].saved_bytes == 4 * 64 * 9 + 4 * 128  # row map, sort map
    # Unpermute: the un-sort (map 1,024, rows 4·128·64), counts, per row its source and row
    # (132), the sum written (8,192) and the residual add (3X); backward the transposed.
    X = 2 * 64 * 64
    unpermute = 1024 + 4 * 128 * 64 + 256 + 132 * 128 + 8192 + 3 * X
    assert ops["unpermute"].forward_bytes == unpermute
    assert ops["unpermute"].backward_bytes == 512 + 4 * 128 * 64 + 8192 + 256 + 132 * 128
    assert ops["unpermute"].saved_bytes == 4 * 128
    unfused = moe_ops(small())
    for name in ("permute", "unpermute"):
        assert ops[name].forward_bytes < unfused[name].forward_bytes
    assert unfused["unpermute"].saved_bytes == 0


def test_fused_router_bytes_by_hand():
    """--moe-router-fusion: per (token, expert), B = 2: top-k with its score function reads the
    logits and writes probabilities, map and intermediate (3B + 1), the aux-loss scores the
    same, the map's per-expert sum (1), the aux loss reads the scores (B): 17; backward the aux
    loss's gradient (B), the two score backwards (3B, 3B + 1), their sum (3B): 21. It keeps the
    map and two intermediates, (1 + 2B) per (token, expert); nothing per choice."""
    fused = moe_ops(small(moe_router_fusion=True))["router_probs"]
    assert (fused.forward_bytes, fused.backward_bytes) == (17 * 256, 21 * 256)
    assert fused.saved_bytes == 5 * 256
    assert moe_ops(small())["router_probs"].saved_bytes == 12 * 128 + 4 * 256


def test_fused_kernels_leave_the_other_ops_alone():
    """Only the routing, permutation and unpermutation ops change; the experts' GEMMs, their
    activation and the FLOPs do not."""
    plain, fused = moe_ops(small()), moe_ops(small(moe_permute_fusion=True, moe_router_fusion=True))
    for name in ("router", "expert_fc1", "expert_act", "expert_fc2"):
        assert plain[name] == fused[name]
    for attribute in ("forward_flops", "backward_flops"):
        flops = [sum(getattr(op, attribute) for op in ops.values()) for ops in (plain, fused)]
        assert flops[0] == flops[1]


def test_token_dropping_bytes_by_hand():
    """Capacity 1.0: C = ceil(64·2·1.0/4) = 32 per expert, E·C = 128 slots. Forward per (token,
    expert): top-k's read (B), zeros_like (B), the out-of-place scatter's copy (2B), .bool()
    (B + 1), the product (2B + 1): 16; per slot top-k's values and int64 indices (10) and the
    scatter's indices and ones (10). Backward: the product's (2B + 1) = 5. The router keeps the
    mask (1 per (token, expert)) beside its own tensors; dropless moves none of it."""
    dropless = moe_ops(small())["router_probs"]
    padded = moe_ops(small(capacity_factor=1.0))["router_probs"]
    assert padded.forward_bytes - dropless.forward_bytes == 16 * 256 + 20 * 128
    assert padded.backward_bytes - dropless.backward_bytes == 5 * 256
    assert padded.saved_bytes - dropless.saved_bytes == 256


def test_token_dropping_matches_torch_ops():
    """Megatron-Core's apply_router_token_dropping (core_v0.14.0 moe_utils.py, drop policy
    "probs", pad_to_capacity) run on CPU in bf16: the aten ops it dispatches, each reading its
    tensor inputs and writing its outputs (zeros_like writes only; the out-of-place scatter also
    writes its E·C values after the copy), add up to `token_dropping_moved`, forward and
    backward."""
    torch = torch_or_skip()
    from ckplan.model.moe import expert_capacity, token_dropping_moved

    spec = small(capacity_factor=1.0)
    shapes = LayerShapes.of(spec)
    tokens, E = shapes.stream_tokens, spec.experts
    C = expert_capacity(spec, tokens)
    size = tensor_bytes

    def moved_by(func, args, outputs):
        moved = sum(size(value) for value in outputs)
        if func is not torch.ops.aten.zeros_like.default:
            moved += sum(size(value) for value in args)
        if func is torch.ops.aten.scatter.value:
            moved += E * C * shapes.B
        return moved

    Tally = byte_tally(moved_by)

    torch.manual_seed(0)
    probs = torch.rand(tokens, E, dtype=torch.bfloat16, requires_grad=True)
    with Tally():
        _, indices = torch.topk(probs, k=C, dim=0, sorted=False)
        mask = torch.zeros_like(probs).scatter(0, indices, 1).bool()
        final = probs * mask
    forward, Tally.moved = Tally.moved, 0
    grad = torch.ones_like(final)
    with Tally():
        torch.autograd.grad(final, probs, grad)  # the gradient handed on, not accumulated
    assert (forward, Tally.moved) == token_dropping_moved(spec, shapes)
    assert int(mask.sum()) == E * C  # padded: every expert holds its capacity


def test_eager_and_gelu_expert_activations():
    """Eager SwiGLU: 5F + (2F + 1) forward, 8F + (4F + 2) backward; GELU: 2F + (2F + 1),
    3F + (4F + 2), over the R = 128 rows, F = 32, B = 2."""
    eager = moe_ops(small(fused_swiglu=False))["expert_act"]
    assert (eager.forward_bytes, eager.backward_bytes) == (2 * 128 * 225, 2 * 128 * 386)
    gelu = moe_ops(small(mlp="gelu"))["expert_act"]
    assert (gelu.forward_bytes, gelu.backward_bytes) == (2 * 128 * 129, 2 * 128 * 226)


def test_fp8_row_padding_by_hand():
    """Megatron under FP8 copies the grouped GEMMs' rows to 16-row alignment (Transformer
    Engine Fp8Padding / Fp8Unpadding). Dropless: R = 128 rows, 4 local experts of 32 rows
    (R' = 128): fc1 pads the input and probabilities, B·(R + R')·(h + 1) = 2·256·65 each way;
    fc2 un-pads the output, 2·256·64 each way; BF16 moves neither."""
    bf16, fp8 = moe_ops(small()), moe_ops(small(precision="fp8"))
    for name, row in (("expert_fc1", 65), ("expert_fc2", 64)):
        assert bf16[name].forward_bytes == bf16[name].backward_bytes == 0
        assert fp8[name].forward_bytes == fp8[name].backward_bytes == 2 * 256 * row


def test_fp8_row_padding_with_a_capacity_factor():
    """With a capacity factor every local expert holds its capacity: ceil(1.0·64·2/4) = 32 rows
    from the one rank, already a multiple of 16, so nothing is copied; at 1.25, 40 rows pad to
    48: R = 160, R' = 192, fc2 moves B·(R + R')·h = 2·352·64."""
    aligned = small(precision="fp8", capacity_factor=1.0)
    shapes = LayerShapes.of(aligned)
    assert not fp8_pads_expert_rows(aligned, shapes)
    assert moe_ops(aligned)["expert_fc2"].forward_bytes == 0
    padded = small(precision="fp8", capacity_factor=1.25)
    shapes = LayerShapes.of(padded)
    assert (routed_rows(padded, shapes), fp8_padded_rows(padded, shapes)) == (160, 192)
    assert moe_ops(padded)["expert_fc2"].forward_bytes == 2 * 352 * 64


def test_fp8_row_padding_aligns_to_32_rows_under_mxfp8():
    """Transformer Engine's Fp8Padding aligns to 32 rows under MXFP8: at capacity 1.25 the 40
    rows of each of the 4 experts pad to 64 (R' = 256, where 16-row alignment gives 48 each);
    at capacity 1.0 the 32 rows are already aligned, so nothing is copied."""
    padded = small(precision="fp8", fp8_recipe="mxfp8", capacity_factor=1.25)
    shapes = LayerShapes.of(padded)
    assert fp8_row_align(padded) == 32
    assert (routed_rows(padded, shapes), fp8_padded_rows(padded, shapes)) == (160, 256)
    aligned = small(precision="fp8", fp8_recipe="mxfp8", capacity_factor=1.0)
    assert not fp8_pads_expert_rows(aligned, LayerShapes.of(aligned))


def test_fp8_row_padding_is_megatrons_alone():
    """torchtitan's and Hugging Face's experts run no TEGroupedMLP: no copy under FP8 either;
    a dense model has no experts to pad."""
    for framework in ("torchtitan", "hf"):
        spec = small(precision="fp8", framework=framework)
        assert not fp8_pads_expert_rows(spec, LayerShapes.of(spec))
    dense = spec_from_mapping(
        {k: v for k, v in SMALL.items() if k not in ("experts", "top_k", "moe_ffn_hidden")}
        | {"precision": "fp8"}
    )
    assert not fp8_pads_expert_rows(dense, LayerShapes.of(dense))


def test_fp8_row_padding_is_timed_as_memory_bound(h100):
    """The copies are memory-bound bytes of the expert GEMMs' ops: under FP8 the fc2 forward
    takes their bytes at the sustained bandwidth more than the same op without them."""
    from ckplan.hardware.code_path import spec_code_path
    from ckplan.hardware.roofline import memory_seconds

    spec = small(precision="fp8")
    path = spec_code_path(spec, h100)
    fc2 = moe_ops(spec)["expert_fc2"]
    bare = dataclasses.replace(fc2, forward_bytes=0)
    extra = path.forward(fc2, 2).memory - path.forward(bare, 2).memory
    assert extra == pytest.approx(memory_seconds(path.gpu, 2 * 256 * 64))


def test_grouped_gemm_rows_follow_imbalance_and_capacity():
    """Per local expert: T·k/E_l rows on average, twice that at moe_imbalance 2, the padded
    ep·capacity with a capacity factor; 65·2·1.5 = 195 rows do not split over 2 experts:
    one group of 195 rows keeps the FLOPs exact."""
    base = small(ep=2, dp=2)
    shapes = LayerShapes.of(base)
    assert expert_matmul(base, shapes, 64, 64).m == 128 // 2
    double = base.replace(moe_imbalance="2")
    assert expert_matmul(double, shapes, 64, 64).m == 256 // 2
    capped = base.replace(capacity_factor=1.5)
    capacity = -(-64 * 2 * 3 // (2 * 4))  # ceil(T·k·c/E) = 24
    assert expert_matmul(capped, shapes, 64, 64).m == 2 * capacity
    odd = small(ep=2, dp=2, seq=65, micro_batch=1, moe_imbalance="1.5")
    odd_shapes = LayerShapes.of(odd)
    mm = expert_matmul(odd, odd_shapes, 64, 64)
    assert routed_rows(odd, odd_shapes) == 195 and (mm.m, mm.batch) == (195, 1)


def test_moe_layer_time_scales_with_routed_rows(h100):
    """The expert GEMMs' time grows with the rows routed to the rank: 2x rows, 2x the GEMM time
    at shapes large enough to fill the GPU (Mixtral's experts, T = 4096, ep 8)."""
    spec = spec_from_mapping(
        {**SMALL, "hidden": 4096, "heads": 32, "seq": 4096, "micro_batch": 1, "experts": 8,
         "moe_ffn_hidden": 14336, "ep": 8, "dp": 8}
    )  # fmt: skip
    busy = spec.replace(moe_imbalance="2")

    def experts(s):
        ops = moe_ops(s)
        return sum(op_forward_time(ops[n], h100).total for n in ("expert_fc1", "expert_fc2"))

    assert experts(busy) / experts(spec) == pytest.approx(2.0, rel=0.01)
    assert (
        layer_time(busy, h100, MOE_LAYER).forward.total
        > layer_time(spec, h100, MOE_LAYER).forward.total
    )


def test_mla_shapes_collectives_and_bytes(h100):
    """Down projections over the rank's own s/t tokens, no collective; up projections
    column-parallel, gathering their latent (s·b·rank values) under SP; the RoPE key gathered
    on its own; latent norms move 2 and 5 latents (+ the KV latent's contiguous copy)."""
    spec = spec_from_mapping({**MLA, "tp": 2, "sp": True, "heads": 4})
    ops = {op.name: op for op in layer_ops(spec)}
    assert ops["q_down"].tp_comm is None and ops["kv_down"].tp_comm is None
    assert (ops["q_down"].matmul.m, ops["q_down"].matmul.n) == (8, 16)  # 16 tokens / t
    assert ops["q_up"].tp_comm == "column" and ops["kv_up"].tp_comm == "column"
    latent = 2 * 8 * 16
    assert (ops["q_norm"].forward_bytes, ops["q_norm"].backward_bytes) == (
        2 * latent,
        5 * latent,
    )
    kv_latent = 2 * 8 * 8
    assert ops["kv_norm"].forward_bytes == 4 * kv_latent
    bandwidth = 450e9 * 0.7
    forward, backward = tensor_parallel_comm(spec, h100, (ops["q_up"],))
    latency = 8.4e-6 + 3.4e-6  # NCCL's ring latency, one step for 2 ranks (h100-sxm.yaml)
    assert comm.all_gather_latency(h100, 2) == pytest.approx(latency)
    latent_gather = comm.all_gather_seconds(2 * 16 * 16, 2, bandwidth) + latency
    assert forward == pytest.approx(latent_gather)
    input_grad, weight_grad = backward_matmuls(ops["q_up"].matmul)

    def beside(seconds, gemm):
        alone, contended = matmul_seconds(h100, gemm), contended_matmul_seconds(h100, gemm)
        return comm.overlapped(seconds, alone, contended)

    assert backward == pytest.approx(
        beside(latent_gather, input_grad) + beside(latent_gather, weight_grad)
    )
    rope_forward, rope_backward = mla_comm(spec, h100)
    rope = 2 * 16 * 4
    assert rope_forward == pytest.approx(comm.all_gather_seconds(rope, 2, bandwidth) + latency)
    assert rope_backward == pytest.approx(comm.reduce_scatter_seconds(rope, 2, bandwidth) + latency)
    assert mla_comm(spec.replace(sp=False), h100) == (0.0, 0.0)
    # Q assembled by a cat: Q read and written, forward and backward (T·a/t·(nope + rope)).
    d_q = 2 * 16 * 2 * 12
    assert ops["q_up"].forward_bytes == 2 * d_q == ops["q_up"].backward_bytes


# ---- communication formulas ----------------------------------------------------------------


def test_all_to_all_hand_computed():
    """64 MB per rank over 8 ranks at 100 GB/s: 7/8 of it leaves, 0.56 ms; nothing at 1 rank."""
    assert comm.all_to_all_seconds(64e6, 8, 1e11) == pytest.approx(0.56e-3)
    assert comm.all_to_all_seconds(64e6, 1, 1e11) == 0.0


def test_ranks_per_node(h100):
    assert comm.ranks_per_node(h100, 8, 1) == 8  # fits
    assert comm.ranks_per_node(h100, 64, 1) == 8  # 8 nodes of 8
    assert comm.ranks_per_node(h100, 8, 2) == 4  # 16 GPUs, 4 of the group per node
    assert comm.ranks_per_node(h100, 4, 16) == 1  # one per node


def test_hierarchical_all_to_all_switches_links(h100):
    """Inside a node the plain all-to-all on NVLink; 16 ranks on two 8-GPU nodes: 7/16 of S on
    NVLink (450e9 x 0.7), 8/16 on the network (50e9 x 0.85), the slower, the network's."""
    S = 64e6
    link, network = 450e9 * 0.7, 50e9 * 0.85
    inside = comm.hierarchical_all_to_all_seconds(S, 8, 1, h100)
    assert inside == pytest.approx(comm.all_to_all_seconds(S, 8, link))
    across = comm.hierarchical_all_to_all_seconds(S, 16, 1, h100)
    assert across == pytest.approx(8 / 16 * S / network)
    assert across > 3 * comm.all_to_all_seconds(S, 16, link)
    assert comm.hierarchical_all_to_all_seconds(S, 1, 1, h100) == 0.0


def test_expert_parallel_comm_zero_without_ep(h100):
    """ep = etp = 1: the dispatcher moves nothing between GPUs; a dense model neither."""
    assert expert_parallel_comm(small(), h100) == ExpertParallelComm()
    spec = small()
    assert layer_time(spec, h100, MOE_LAYER).expert_forward_comm == 0.0
    plain = small(experts=0, top_k=2)
    assert expert_parallel_comm(plain.replace(experts=0), h100).forward == 0.0


def test_expert_parallel_dispatch_hand_computed(h100):
    """Mixtral-like layer, T = 4096 tokens, k = 2, ep = 8 in one node: S = 8192 rows; dispatch
    B·S·(h + 1) = 2·8192·4097 bytes, combine 2·8192·4096, each 7/8 over NVLink at
    450e9 x 0.7; backward the same again."""
    spec = spec_from_mapping(
        {**SMALL, "hidden": 4096, "heads": 32, "seq": 4096, "micro_batch": 1, "experts": 8,
         "moe_ffn_hidden": 14336, "ep": 8, "dp": 8}
    )  # fmt: skip
    shapes = LayerShapes.of(spec)
    assert dispatch_bytes(spec, shapes) == 2 * 8192 * 4097
    assert combine_bytes(spec, shapes) == 2 * 8192 * 4096
    ep = expert_parallel_comm(spec, h100)
    link = 450e9 * 0.7
    assert ep.dispatch == pytest.approx(7 / 8 * 2 * 8192 * 4097 / link)
    assert ep.combine == pytest.approx(7 / 8 * 2 * 8192 * 4096 / link)
    assert ep.gather == ep.scatter == 0.0
    assert ep.backward == ep.forward
    layer = layer_time(spec, h100, MOE_LAYER)
    assert layer.expert_forward_comm == pytest.approx(ep.forward)
    dense = layer_time(spec.replace(ep=1, dp=8), h100, MOE_LAYER)
    assert layer.forward_comm - dense.forward_comm == pytest.approx(ep.forward)


def test_expert_parallel_across_nodes_and_imbalance(h100):
    """ep = 16 spans two nodes: the network share sets the time. The busiest rank under
    `worst` routing receives T·ep·min(k, E/ep) rows and the all-to-all waits for it."""
    spec = spec_from_mapping(
        {**SMALL, "hidden": 4096, "heads": 32, "seq": 4096, "micro_batch": 1, "experts": 16,
         "moe_ffn_hidden": 1024, "ep": 16, "dp": 16}
    )  # fmt: skip
    ep = expert_parallel_comm(spec, h100)
    size = 2 * 8192 * 4097
    assert ep.dispatch == pytest.approx(8 / 16 * size / (50e9 * 0.85))
    worst = spec.replace(moe_imbalance="worst")
    rows = 4096 * 16 * 1  # min(k, E/ep) = 1
    assert dispatch_bytes(worst, LayerShapes.of(worst)) == 2 * rows * 4097
    assert expert_parallel_comm(worst, h100).dispatch == pytest.approx(
        8 / 16 * 2 * rows * 4097 / (50e9 * 0.85)
    )


def test_expert_tensor_parallel_gather_and_scatter(h100):
    """tp = etp = 2, ep = 4: the received rows are all-gathered over the 2 etp ranks (R = 2·S
    rows of h + 1 values) and the outputs reduce-scattered; the ep group of 4 ranks 2 apart
    spans 8 GPUs, one node."""
    spec = small(tp=2, sp=True, ep=4, dp=4)
    shapes = LayerShapes.of(spec)
    T = 64 // 2
    S = T * 2
    R = routed_rows(spec, shapes)
    assert R == 2 * S
    ep = expert_parallel_comm(spec, h100)
    link = 450e9 * 0.7
    assert ep.gather == pytest.approx(comm.all_gather_seconds(2 * R * 65, 2, link))
    assert ep.scatter == pytest.approx(comm.reduce_scatter_seconds(2 * R * 64, 2, link))
    assert ep.dispatch == pytest.approx(comm.all_to_all_seconds(2 * S * 65, 4, link))


def test_ep_overlap_hides_up_to_the_layer_compute(h100):
    """exposed_fraction: none hidden at overlap 0; at 1 all of it when the compute is longer,
    else the compute's worth."""
    assert exposed_fraction(2.0, 5.0, 0.0) == 1.0
    assert exposed_fraction(2.0, 5.0, 1.0) == 0.0
    assert exposed_fraction(2.0, 1.0, 1.0) == pytest.approx(0.5)
    assert exposed_fraction(2.0, 5.0, 0.25) == pytest.approx(0.75)
    assert exposed_fraction(0.0, 1.0, 0.5) == 0.0
    spec = small(ep=4, dp=4)
    hidden = layer_time(spec, h100.replace(ep_overlap=1.0), MOE_LAYER)
    layer = layer_time(spec, h100, MOE_LAYER)
    ep = expert_parallel_comm(spec, h100)
    compute = layer.forward.total + layer.backward.total
    exposed = max(0.0, ep.forward + ep.backward - compute)
    assert hidden.expert_forward_comm + hidden.expert_backward_comm == pytest.approx(exposed)


def test_ep_overlap_key_is_validated(h100):
    with pytest.raises(GPUError, match="'ep_overlap' must be in \\[0, 1\\]"):
        gpu_from_mapping({**h100.to_dict(), "ep_overlap": 1.5})


def test_h800_datasheet_figures():
    """H800 SXM: the H100 SXM's compute and memory, NVLink 400 GB/s (200 each way), one
    400 Gb/s InfiniBand port per GPU (DeepSeek-V3 report: 50 GB/s)."""
    gpu = load_gpu("h800")
    h100 = load_gpu("h100-sxm")
    assert (gpu.bf16_flops, gpu.hbm_bytes_per_s, gpu.memory_bytes) == (
        h100.bf16_flops,
        h100.hbm_bytes_per_s,
        h100.memory_bytes,
    )
    assert (gpu.link_bytes_per_s, gpu.network_bytes_per_s, gpu.gpus_per_node) == (200e9, 50e9, 8)


# ---- recompute, data parallelism, optimizer -----------------------------------------------


def test_moe_recompute_reruns_the_all_to_alls(h100):
    """`moe` (--moe-layer-recompute) re-runs the dispatcher in every MoE layer's backward:
    m micro-batches x MoE layers x the forward's EP communication more; `experts` re-runs the
    expert MLPs only, on the rows already dispatched: no more communication."""
    spec = small(ep=4, dp=4, microbatches=2)
    ep = expert_parallel_comm(spec, h100).forward
    none = step_time(evaluate(spec, parse_strategy("none", spec)), h100)
    moe = step_time(evaluate(spec, parse_strategy("moe", spec)), h100)
    experts = step_time(evaluate(spec, parse_strategy("experts", spec)), h100)
    assert none.expert_parallel_seconds == pytest.approx(2 * 4 * 2 * ep)  # m·L·(fwd + bwd)
    assert moe.expert_parallel_seconds - none.expert_parallel_seconds == pytest.approx(2 * 4 * ep)
    assert experts.expert_parallel_seconds == pytest.approx(none.expert_parallel_seconds)
    full = step_time(evaluate(spec, parse_strategy("full", spec)), h100)
    assert full.expert_parallel_seconds == pytest.approx(3 * 2 * 4 * ep)


def test_data_parallel_reduces_experts_over_their_own_group(spec_of, h100):
    """Mixtral, ep 8, dp 16, ZeRO 1: the dense parameters' gradients over the 16 dp ranks
    (consecutive, tp = 1: two nodes, the network), the experts' over their expert-data-parallel
    group of 2 ranks ep·etp = 8 apart (the next node: the network)."""
    spec = spec_of("mixtral-8x7b", ep=8, dp=16, zero=1)
    dense, experts = memory.stage_parameters(spec, memory.busiest_stage(spec))
    network = 50e9 * 0.85
    assert spec.expert_data_parallel == 2

    def zero1(params, ranks):
        return comm.reduce_scatter_seconds(4 * params, ranks, network) + comm.all_gather_seconds(
            2 * params, ranks, network
        )

    assert data_parallel_seconds(spec, h100) == pytest.approx(zero1(dense, 16) + zero1(experts, 2))
    # ep = 1: the experts share the dense group (expert-DP = dp), the old all-in-one sum.
    one = spec.replace(ep=1)
    dense1, experts1 = memory.stage_parameters(one, memory.busiest_stage(one))
    assert data_parallel_seconds(one, h100) == pytest.approx(
        zero1(dense1, 16) + zero1(experts1, 16)
    )


def test_optimizer_steps_the_parameters_held(spec_of, h100):
    """ZeRO 1: dense parameters' states over dp, experts' over expert-DP, 30 bytes moved per
    parameter (4 gradient + 2·4 master + 2·8 moments + 2 weight), as model_state_bytes shards."""
    spec = spec_of("mixtral-8x7b", ep=8, dp=16, zero=1)
    dense, experts = memory.stage_parameters(spec, memory.busiest_stage(spec))
    held = -(-dense // 16) + -(-experts // 2)
    assert optimizer_seconds(spec, h100) == pytest.approx(held * 30 / (3.35e12 * 0.8))
    states = memory.model_state_bytes(spec)
    assert states.optimizer == pytest.approx(12 * held, rel=1e-6)


# ---- model FLOPs and MFU -------------------------------------------------------------------


TINY = {
    "name": "tiny-moe",
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "seq": 32,
    "micro_batch": 1,
    "vocab": 100,
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention": "flash",
    "bias": False,
    "ffn_hidden": 128,
    "experts": 4,
    "top_k": 2,
    "moe_ffn_hidden": 32,
    "shared_experts": 1,
    "moe_layers": "1",
}


def test_moe_model_flops_by_hand():
    """A dense layer and an MoE layer, h 64, a = g = 4, s 32, V 100, per sequence forward:
    attention 2sh(h + 2gd) + 2sh² + 4s²h = 786,432 + 262,144 + 262,144 per layer; dense
    SwiGLU 6shF = 1,572,864 (F 128); MoE router 2shE = 16,384, k = 2 routed experts of F_e 32,
    2·6·s·h·32 = 786,432 (not all 4), one shared 6·s·h·32 = 393,216; logits 2shV = 409,600.
    Model FLOPs per iteration = 3 x that x global batch (Korthikanti App. A: active experts
    only, no recompute), whatever the parallel layout."""
    attention = 786_432 + 262_144 + 262_144
    forward = 2 * attention + 1_572_864 + (16_384 + 786_432 + 393_216) + 409_600
    assert forward == 5_799_936
    spec = spec_from_mapping(TINY)
    assert model_flops_per_iteration(spec, 8) == 3 * forward * 8
    laid_out = spec_from_mapping({**TINY, "ep": 2, "dp": 2, "tp": 2, "sp": True})
    assert model_flops_per_iteration(laid_out, 8) == 3 * forward * 8
    everyone = spec_from_mapping({**TINY, "top_k": 4})  # all 4 experts active: 2x the experts
    assert model_flops_per_iteration(everyone, 8) == 3 * (forward + 786_432) * 8


def test_moe_mfu_is_model_flops_over_step(h100):
    """MFU = 3·forward·global batch / (step x GPUs x peak), the same with ep."""
    spec = spec_from_mapping({**TINY, "ep": 2, "dp": 2, "microbatches": 4})
    plan = evaluate(spec, parse_strategy("none", spec))
    time = step_time(plan, h100)
    global_batch = 1 * 4 * 2
    expected = 3 * 5_799_936 * global_batch / (time.step_seconds * 2 * h100.bf16_flops)
    assert time.mfu == pytest.approx(expected)
    assert time.to_dict()["expert_parallel_seconds"] == time.expert_parallel_seconds > 0


def test_router_gemm_is_timed_on_its_shape(h100):
    """The router's (T x h) @ (h x E) is a skinny GEMM: its time is the roofline of that
    shape, not its FLOPs at matmul_efficiency."""
    ops = moe_ops(small())
    router = ops["router"]
    assert op_forward_time(router, h100).matmul == pytest.approx(
        matmul_seconds(h100, router.matmul)
    )


def test_qwen3_token_dropping_layout_pads_to_capacity(spec_of):
    """NVIDIA's 25.09 Qwen3-30B-A3B token-dropping row (capacity 1.0, padded; MBS 2, seq 4096,
    TP 1, EP 8): T = 8,192 tokens per micro-batch, ceil(8,192·8·1.0/128) = 512 rows per expert
    from each rank, E·512 = 65,536 = T·k rows sent and, every expert full, received; each of the
    16 local experts holds 4,096 rows, a multiple of 16, so FP8 copies nothing, where the
    dropless layout copies every row."""
    from ckplan.model.moe import expert_capacity, sent_rows

    layout = dict(seq=4096, micro_batch=2, tp=1, pp=2, dp=8, ep=8, precision="fp8")
    padded = spec_of("qwen3-30b-a3b", **layout, capacity_factor=1.0)
    shapes = LayerShapes.of(padded)
    assert expert_capacity(padded, shapes.stream_tokens) == 512
    assert sent_rows(padded, shapes) == routed_rows(padded, shapes) == 65536
    assert not fp8_pads_expert_rows(padded, shapes)
    dropless = spec_of("qwen3-30b-a3b", **layout)
    assert fp8_pads_expert_rows(dropless, LayerShapes.of(dropless))


def test_padded_permutation_matches_torch_ops():
    """Megatron-Core's `permute(..., drop_and_pad=True)` (core_v0.14.0 moe_utils.py), run on CPU
    in bf16 on the small layer padded to capacity 1.0 (every expert's column holds C = 32
    tokens): the aten ops it dispatches add up to `padded_permute_moved` less the reorder by
    local expert, forward and backward, and what they keep is the two int64 index tensors.
    Each op reads its tensor inputs and writes its outputs, views move nothing, arange and
    new_zeros write only, an index_select reads as many values as it writes, an index_add reads
    its source and writes as many values."""
    torch = torch_or_skip()
    from ckplan.model.moe import expert_capacity, padded_permute_moved, permute_saved

    spec = small(capacity_factor=1.0)
    shapes = LayerShapes.of(spec)
    tokens, E, h, B = shapes.stream_tokens, spec.experts, spec.hidden, shapes.B
    C = expert_capacity(spec, tokens)
    aten = torch.ops.aten
    views = {aten.permute.default, aten.slice.Tensor, aten.view.default, aten.unsqueeze.default}
    writes_only = {aten.arange.default, aten.new_zeros.default}

    size = tensor_bytes

    def moved_by(func, args, outputs):
        written = sum(size(value) for value in outputs)
        if func in views:
            return 0
        if func is aten.index_select.default:
            return size(args[2]) + 2 * written
        if func is aten.index_add.default:
            return size(args[2]) + 2 * size(args[3])
        if func in writes_only:
            return written
        return written + sum(size(value) for value in args)

    Tally = byte_tally(moved_by)

    torch.manual_seed(0)
    hidden = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, E, dtype=torch.bfloat16, requires_grad=True)
    _, chosen = torch.topk(probs.detach(), k=C, dim=0)
    routing_map = torch.zeros(tokens, E, dtype=torch.bool).scatter(0, chosen, True)
    with Tally():  # moe_utils.permute, the drop_and_pad branch, as written there
        routing_map = routing_map.to(dtype=torch.int8).T.contiguous()
        sorted_indices = routing_map.argsort(dim=-1, descending=True, stable=True)[:, :C]
        sorted_indices = sorted_indices.contiguous().view(-1)
        probs_T_1D = probs.T.contiguous().view(-1)
        indices_dim0 = torch.arange(E).unsqueeze(-1)
        indices_dim1 = sorted_indices.view(E, C)
        indices_1D = (indices_dim0 * tokens + indices_dim1).view(-1)
        permuted_probs = probs_T_1D.index_select(0, indices_1D)
        permuted_input = hidden.index_select(0, sorted_indices)
    forward, Tally.moved = Tally.moved, 0
    grads = (torch.ones_like(permuted_input), torch.ones_like(permuted_probs))
    with Tally():
        torch.autograd.grad((permuted_input, permuted_probs), (hidden, probs), grads)
    rows = routed_rows(spec, shapes)
    reorder = 2 * B * rows * (h + 1)  # four local experts: the transposed copy after the a2a
    assert (forward + reorder, Tally.moved + reorder) == padded_permute_moved(spec, shapes)
    assert permute_saved(spec, shapes) == size(sorted_indices) + size(indices_1D)
    assert moe_ops(spec)["permute"].forward_bytes == forward + reorder
