"""One op of a layer: what it saves for backward, what its forward costs, what it moves.

Modelled the way `torch.utils.flop_counter` models aten ops: one small record per op, with the
bytes it saves for backward, its forward/backward FLOPs (matmuls only, 2·m·n·k each; element-wise
ops count as 0), and the recompute group it belongs to. `LayerShapes` holds the per-rank sizes
the ops of one layer are built from. The tables of ops per layer kind are `ckplan.model.ops`
(dense and sliding-window transformer layers), `ckplan.model.mla` and `ckplan.model.moe`.

Notation (Korthikanti et al. 2022, §4): s sequence, b micro-batch, h hidden, a heads, g kv heads,
d = h/a, F ffn hidden, B bytes per activation value, t tensor-parallel size. Dropout masks are one
byte per value. All counts are for one GPU: head- and ffn-sharded tensors are divided by t, the
rest by t only under sequence parallelism (Korthikanti §4.2.2), and every token count by the
context-parallel size cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.model.frameworks import framework_version
from ckplan.model.parts import cached_hash
from ckplan.model.spec import ChainSpec

ATTENTION_CORE = "attention_core"
# recompute group: a dense layer's MLP (fc1, its activation, fc2), Megatron-Core's
# --recompute-modules mlp
DENSE_MLP = "mlp"
FP32_BYTES = 4
MASK_BYTES = 1  # a dropout mask value
# The norms whose input gradient is added to the residual-stream gradient (a post-norm's is
# read by the op before it, like any other op's; memory.layer_backward_walk).
RESIDUAL_NORMS = ("norm1", "norm2")


@dataclass(frozen=True)
class Matmul:
    """One (batched) GEMM of an op's forward: `batch` x (m x k) @ (k x n), operands and result
    of `dtype_bytes` each. Its backward is the two transposed products (ckplan.hardware)."""

    __hash__ = cached_hash  # a cache key, hashed on every lookup

    m: int
    n: int
    k: int
    batch: int = 1
    dtype_bytes: int = 2


@dataclass(frozen=True)
class Op:
    __hash__ = cached_hash  # a cache key, hashed on every lookup

    name: str
    component: str  # "attention" | "mlp" | "norm"
    saved_bytes: int  # what autograd keeps for this op's backward
    forward_flops: int
    backward_flops: int
    group: str | None = None  # recompute group, e.g. ATTENTION_CORE
    # What the op's backward holds besides the saved tensors (memory.layer_backward_walk), in
    # bytes on one GPU; parameter gradients are model states, never counted here.
    # The gradient of its output that it reads, allocated by the backward of the op after it
    # and freed when this backward returns; 0 when it is the residual-stream gradient itself
    # (the walk counts that one).
    output_grad_bytes: int = 0
    # The gradients it allocates for its activation inputs, read by the ops before it (a norm's
    # is added to the residual-stream gradient).
    input_grad_bytes: int = 0
    # Temporaries allocated and freed inside its backward, counted alive together with the two
    # gradients above (an upper bound where they are not alive at once).
    grad_workspace_bytes: int = 0
    # Another op that saves the same storage and is backpropagated later: the storage is freed
    # after that op's backward, not this one's (flash attention's output O, out_proj's input).
    saved_until: str | None = None
    # What the time model reads (ckplan.hardware.roofline); the defaults suit ops without them.
    matmul: Matmul | None = None  # its forward GEMM; None for element-wise ops
    # HBM bytes its memory-bound kernels read and write (element-wise, reductions, copies;
    # not the GEMM's own operands): what it moves, not what it saves.
    forward_bytes: int = 0
    backward_bytes: int = 0
    # The tensor-parallel collective around it (Megatron-LM): "column" (input all-gathered under
    # SP, input gradient all-reduced or reduce-scattered) or "row" (output all-reduced, or
    # reduce-scattered under SP).
    tp_comm: str | None = None
    fused_kernel: bool = False  # one compute-bound kernel timed on its FLOPs (flash attention)
    # HBM bytes of the separate memory-bound kernels a fused kernel runs beside, (forward,
    # backward): PyTorch's ring attention's merges and accumulators around its flash calls
    # (ckplan.model.context_parallel.ring_moved_bytes)
    side_bytes: tuple[int, int] = (0, 0)


def split_share(value: int, parts: int) -> int:
    """Per-rank share of `value` elements split over `parts` ranks (the largest share)."""
    return -(-value // parts)


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m x k) @ (k x n) matmul: one multiply and one add per term."""
    return 2 * m * n * k


def make_op(
    name: str,
    component: str,
    saved: int,
    flops: int = 0,
    group: str | None = None,
    *,
    grads: tuple[int, int] = (0, 0),
    workspace: int = 0,
    saved_until: str | None = None,
    matmul: Matmul | None = None,
    moved: tuple[int, int] = (0, 0),
    tp_comm: str | None = None,
) -> Op:
    """An op whose backward costs twice its forward: derived, the gradient w.r.t. the input and
    w.r.t. the weight are one matmul each of the forward's size (Korthikanti App. A).
    `grads` is (output_grad_bytes, input_grad_bytes), see `Op`; `moved` is (forward_bytes,
    backward_bytes)."""
    out_grad, in_grad = grads
    return Op(
        name,
        component,
        saved,
        flops,
        2 * flops,
        group,
        out_grad,
        in_grad,
        workspace,
        saved_until,
        matmul,
        *moved,
        tp_comm,
    )


@dataclass(frozen=True)
class LayerShapes:
    """The per-rank sizes every op of one transformer layer is built from (one micro-batch).

    Tensors split by heads or by the FFN width are divided by t; the residual stream is divided
    by t only under sequence parallelism (Korthikanti §4.2.2); every token count by cp.
    """

    B: int  # bytes per activation value
    t: int  # tensor-parallel size
    tokens: int  # s·b on this rank (s / cp)
    stream_tokens: int  # tokens of a residual-stream tensor on this rank (/t under SP)
    stream: int  # elements of an (s, b, h) residual-stream tensor on this rank
    X: int  # bytes of that tensor (or of its gradient)
    replicated: int  # t under SP, else 1

    @classmethod
    def of(cls, spec: ChainSpec) -> LayerShapes:
        tokens = (spec.seq // spec.cp) * spec.micro_batch
        replicated = spec.tp if spec.sp else 1
        stream = split_share(tokens * spec.hidden, replicated)
        B = spec.dtype_bytes
        return cls(
            B, spec.tp, tokens, split_share(tokens, replicated), stream, B * stream, replicated
        )

    def sharded(self, elements: int) -> int:
        return split_share(elements, self.t)

    # Bytes moved (the time model, ckplan.hardware): what kernels read and write.
    @property
    def norm_moved(self) -> tuple[int, int]:
        """A norm reads x and writes y. Its backward is two passes in Megatron-LM's fused kernel
        (fused_kernels/layer_norm_cuda_kernel.cu, HostLayerNormGradient):
        cuComputePartGradGammaBeta reads dy and x, cuComputeGradInput reads them again and
        writes dx; then autograd adds dx to the residual-stream gradient (read two, write one)."""
        return 2 * self.X, 8 * self.X

    @property
    def residual_add(self) -> int:
        """A residual add, or Megatron's fused bias-dropout-add, reads the branch and the
        residual and writes the sum."""
        return 3 * self.X

    @property
    def dropout_moved(self) -> tuple[int, int]:
        """Bias-dropout-add: the add and a 1-byte mask; backward reads dy and the mask, writes
        dx (and the row-parallel bias gradient, a sum of dy, counted with the linear)."""
        mask = MASK_BYTES * self.stream
        return self.residual_add + mask, 2 * self.X + mask

    def linear(self, m: int, n: int, k: int) -> Matmul:
        return Matmul(m, n, k, 1, self.B)


def in_group(op: Op, group: str) -> bool:
    """Whether `op` belongs to recompute group `group`; groups nest with "/" (the expert MLPs,
    EXPERTS = "moe/experts", are part of the whole MoE block, MOE = "moe")."""
    return op.group is not None and (op.group == group or op.group.startswith(group + "/"))


def column_parallel_saved_input_bytes(spec: ChainSpec, shapes: LayerShapes) -> int:
    """Bytes a layer's column-parallel linear (the QKV projection, a dense MLP's fc1) saves of
    its input: the residual stream's share on this rank, except under torchtitan's sequence
    parallelism, where it is the whole sequence, s·b·h/cp. Megatron-LM's
    LinearWithGradAccumulationAndAsyncCommunication saves the sequence shard and all-gathers it
    again in its backward (megatron/core/tensor_parallel/layers.py); torchtitan's blocks gather
    the norm's output before the projections, `PrepareModuleInput(input_layouts=(Shard(1),),
    desired_input_layouts=(Replicate(),))` on `attention` and `feed_forward`
    (torchtitan/parallelisms/parallelize_llama.py `apply_tp` at 9dec370; the same contracts in
    0.3.0's models/common/decoder_sharding.py), and F.linear saves the gathered local tensor,
    one storage for wq, wk, wv and one for w1, w3 (counted on fake ranks,
    validation/torch_fsdp2_tp_memory.py). With torchao's float8 at that commit (`precision:
    float8`, `framework_version: "2024.12"`) `PrepareFloat8ModuleInput` casts to float8 before
    the all-gather (torchao/float8/float8_tensor_parallel.py at eab345c) and
    `manual_float8_matmul_with_args_in_float8` saves that float8 input (float8_linear.py at
    eab345c): one byte an element. `kernels: fused` stands for Megatron-LM's fused modules
    (hardware.code_path), whose linear saves the shard: a private stack described as
    torchtitan's state layout with Megatron-like kernels (the Llama 3 paper's, which cites
    Korthikanti et al. for its tensor parallelism) keeps the shard."""
    if not saves_gathered_input(spec):
        return shapes.B * shapes.stream
    gathered = shapes.tokens * spec.hidden
    if spec.precision == "float8" and framework_version(spec) == "2024.12":
        return gathered
    return shapes.B * gathered


def saves_gathered_input(spec: ChainSpec) -> bool:
    """Whether the column-parallel linears save their all-gathered input (torchtitan's sequence
    parallelism, `column_parallel_saved_input_bytes`) rather than the sequence shard, which
    Megatron-LM all-gathers again in the backward."""
    torchtitan_tp = spec.framework == "torchtitan" and spec.kernels != "fused"
    return torchtitan_tp and spec.sp and spec.tp > 1


def kv_heads_per_rank(spec: ChainSpec) -> int:
    """K/V heads on one tensor-parallel rank: g/t, or one replicated head when t > g
    (Megatron-LM replicates the query groups when tp exceeds num_query_groups)."""
    return -(-spec.kv_heads // spec.tp)
