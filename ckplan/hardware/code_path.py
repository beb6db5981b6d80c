"""The code a framework runs the op table with, and what it changes in each op's time.

The op table counts what Megatron-LM's fused kernels do (`ckplan.model.ops`). A run differs in
four ways, each a key of the model's `Execution` part:

- **Attention kernel** (`attention_kernel`): FlashAttention-2, -3, cuDNN's fused attention,
  Triton, or PyTorch's SDPA (whose flash backend is FlashAttention-2). Each kernel's throughput
  grows with the sequence length towards a plateau, e(s) = plateau · s / (s + s½), fitted per
  GPU to the kernels' published benchmarks (the GPU files cite them), never to training runs.
- **Sustained rates** (`GPU.sustained_fraction`, `GPU.clock_factor`): kernel benchmarks and MAMF
  are best shapes on an idle, cool GPU; a training step's GEMMs run at power and clocks under
  full load, beside NCCL, with transposed backward operands. The share they sustain is fitted to
  published training runs per GPU family (docs/validation.md), and scaled per code path
  (`KERNEL_RATES`): the same GEMM shapes run at a different sustained rate under Megatron's
  fused kernels than under PyTorch's, eager or compiled alike (`RATE_GROUPS`).
- **Kernels for the memory-bound ops** (`kernels`): Megatron's fused CUDA kernels and
  torch.compile's generated ones (Inductor fuses each chain of element-wise ops into one kernel)
  move what the op table says; eager PyTorch runs each step of a norm, an activation and RoPE as
  its own kernel and moves more (`eager_rmsnorm_bytes`, `eager_gated_act_bytes`,
  `eager_rope_bytes`, `split_projection_sum_bytes`: torchtitan's Llama code, measured by
  validation/torchtitan_eager_bytes.py).
- **GEMM precision** (`precision`): FP8 linear layers (Transformer Engine, torchao float8) run at
  the FP8 tensor-core rate and pay for casting their inputs and gradients to FP8; the attention
  core and the output layer stay in BF16 (Megatron-LM and torchao's defaults). Under
  Transformer Engine the scaling recipe (`fp8_recipe`) changes what each cast and each
  sequence-parallel gather moves (`fp8_quantize_bytes`, `fp8_amax_pass_bytes`,
  `fp8_gathered_bytes`, `fp8_block_gathered_bytes`) and, under current scaling, adds an amax
  all-reduce before each FP8 gather (`current_scaling_amax_reductions`, timed in
  ckplan.hardware.step_time); under block scaling the GEMMs run at the GPU's block-scaled
  rate (`GPU.fp8_block_gemm_rate`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from ckplan.hardware.gpus import GPU, GPUError
from ckplan.hardware.roofline import OpTime, memory_seconds, op_backward_time, op_forward_time
from ckplan.model.async_tp import uses_async_tp
from ckplan.model.fp8_blocks import block_scale_bytes_1d
from ckplan.model.frameworks import framework_version
from ckplan.model.op import ATTENTION_CORE, Op, in_group
from ckplan.model.parts import cached_hash

# Eager PyTorch's norms, gated activations and RoPE run each step as its own ATen kernel; the
# bytes they move per element are `eager_rmsnorm_bytes`, `eager_gated_act_bytes` and
# `eager_rope_bytes` (torchtitan 9dec370's modules, measured on the CPU by
# validation/torchtitan_eager_bytes.py; Hugging Face's LlamaRMSNorm and LlamaMLP run the same
# ops). The op table's fused kernels move `FUSED_NORM_BYTES` and `FUSED_GATED_ACT_BYTES`
# per element (ckplan.model.op.LayerShapes.norm_moved, ckplan.model.mlp_block's swiglu_moved).
# LayerNorm's eager module is one ATen kernel (torch.nn.functional.layer_norm): 1x. Residual
# adds, dropout and GEMMs are the same kernels either way.
FUSED_NORM_BYTES = (2, 8)  # x B: reads x, writes y; backward two passes, dx and the residual add
FUSED_GATED_ACT_BYTES = (3, 5)  # x B: reads gate and up, writes y; backward reads 3, writes 2
UNFUSED_GATED_ACT_BACKWARD_BYTES = 8  # x B: the `fused_swiglu: false` table's backward
EAGER_GATED_ACTS = ("swiglu", "geglu")
# torchtitan's Llama projects Q, K and V with three nn.Linear and the gated MLP's gate and up
# with two (torchtitan/models/llama/model.py at 9dec370, `Attention.wq`/`wk`/`wv`,
# `FeedForward.w1`/`w3`): autograd sums their input gradients, one add per projection beyond the
# first (`split_projection_sum_bytes`), where Megatron's fused linear_qkv and linear_fc1 write
# one gradient.
TORCHTITAN_QKV_PROJECTIONS = 3
TORCHTITAN_GATED_FC1_PROJECTIONS = 2
# FP8 casts (Transformer Engine's cast-transpose, torchao's float8 scaling): each linear GEMM's
# input is read in BF16 and written in FP8 twice (row-wise and column-wise for the backward's
# transposed use), 4 bytes per element in the forward; the output gradient likewise in the
# backward. torchao's own roofline counts the same for its dynamic scaling under torch.compile,
# the amax reduction fused into the op before (torchao/float8/roofline_utils.py at eab345c,
# `get_tensor_memory_traffic_bytes` with fuse_with_prev); its weight casts, 6 bytes per weight
# element each forward there, are not counted (docs/time-model.md, "Not modelled").
FP8_CAST_BYTES = 4
# Transformer Engine all-gathers the sequence-parallel shards of an FP8 GEMM's operands after
# casting them, one byte per element: a column-parallel layer's input (the forward's gather and
# the backward's re-gather for the weight gradient) and a row-parallel layer's output gradient;
# the reduce-scatters stay in BF16 (`fp8_gather_bytes`).
FP8_GATHER_BYTES = 1
# MXFP8 (OCP Microscaling Formats v1.0, Transformer Engine's MXFP8BlockScaling): one E8M0 scale
# byte per block of 32 consecutive values, along the rows for the row-wise copy and along the
# columns for the column-wise one (TE v2.9 transformer_engine/pytorch/tensor/mxfp8_tensor.py,
# `MXFP8_BLOCK_SCALING_SIZE = 32`).
MXFP8_BLOCK = 32
# The amax each current-scaling cast all-reduces (max) over the tensor-parallel group before a
# sequence-parallel gather: one fp32 value (TE v2.9 csrc/quantizer.cpp,
# `Float8CurrentScalingQuantizer::quantize_impl`, `amax_reduction_group->allreduce`).
AMAX_BYTES = 4
# The FP8 linear layers whose input comes from a norm fused into them: Megatron-Core's layer
# spec builds linear_qkv, a dense layer's linear_fc1 and, with q/kv norms, MLA's linear_q_up_proj
# and linear_kv_up_proj as TELayerNormColumnParallelLinear (megatron/core/models/gpt/
# gpt_layer_specs.py, core_v0.15.3); an MoE layer's pre_mlp_layernorm is a separate TENorm, so
# its experts' and shared experts' fc1 and MLA's down projections cast a BF16 input.
NORM_FUSED_LINEARS = ("qkv_proj", "fc1", "q_up", "kv_up")
# The GEMMs' and attention kernels' sustained rate per group of code paths (`RATE_GROUPS`),
# relative to Megatron's fused kernels, fitted by validation/fit_time_model.py on the calibration
# split (docs/validation.md, "The time model's fitted constants"): what a step's GEMMs and
# attention lose outside Transformer Engine / Megatron's code (PyTorch's cuBLAS calls without
# fused epilogues, torchao's separate FP8 scaling kernels, the kernel launch gaps between them
# and FSDP2's per-parameter hooks). A group with fewer calibration runs than the fit's minimum
# keeps 1.0; fused is the reference.
# calibration runs: fused 55, pytorch 15
KERNEL_RATES: dict[str, float] = {"fused": 1.0, "pytorch": 0.847}
# Eager and compiled PyTorch share one rate: they run the same GEMM and attention kernels.
# Inductor lowers aten.mm/addmm/bmm to a Triton template only under max-autotune and otherwise
# calls the ATen (cuBLAS) kernel (torch/_inductor/kernel/mm.py `tuned_mm`, utils.py
# `use_triton_template` gated on `max_autotune or max_autotune_gemm`, v2.5.0 to v2.13.0), and
# torchtitan compiles each block in the default mode (`torch.compile(transformer_block,
# fullgraph=True)`, parallelize_llama.py at 9dec370 and 4d88a8a); SDPA runs the same flash kernel
# either way. What compiling changes is the memory-bound ops, counted by their bytes (`kernels`).
RATE_GROUPS: dict[str, str] = {"fused": "fused", "eager": "pytorch", "compiled": "pytorch"}
NORM_OPS = ("norm1", "norm2", "qk_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "kv_norm")
NOT_FP8 = ("output", "router")  # the output layer and the router stay in BF16


@dataclass(frozen=True)
class CodePath:
    """What a run's execution changes in the roofline of its ops (see the module docstring)."""

    __hash__ = cached_hash  # a cache key, hashed on every lookup

    gpu: GPU  # compute rates at the sustained fraction, the attention kernel's at this length
    fp8_gpu: GPU | None  # the same for FP8 GEMMs; None: BF16 GEMMs
    eager: bool
    norm: str
    mlp: str
    rope: bool
    fp8_recipe: str | None = None  # Transformer Engine's scaling recipe (precision fp8)
    norm_fused: bool = False  # the norms are fused into the linear layers after them (Megatron)
    # Q and K's share of the QKV projection's width, (a + g, a + 2g): RoPE rotates those
    qk_share: tuple[int, int] = (2, 3)
    # eager only: Q, K, V and gate, up projected by separate linears (torchtitan's Llama)
    split_projections: bool = False
    fused_act: bool = True  # the op table counts the gated activation's fused kernel
    # torchao float8's weights (precision float8): "cast" from bf16 on every forward, or
    # "gathered" in float8 by FSDP2 (fsdp_float8_all_gather): `float8_weight_cast_bytes`
    float8_weights: str | None = None
    # torchtitan's async TP: the tensor-parallel linears' micro-pipelined GEMMs run in this many
    # row chunks (`micro_pipelined_chunks`); 1 otherwise
    tp_chunks: int = 1

    def forward(self, op: Op, dtype_bytes: int) -> OpTime:
        return self._time(op, dtype_bytes, backward=False)

    def backward(self, op: Op, dtype_bytes: int) -> OpTime:
        return self._time(op, dtype_bytes, backward=True)

    # the policy searches time the same ops of a layout again and again (a re-run's units)
    @lru_cache(maxsize=8192)  # noqa: B019 (code paths are few, lru-cached themselves)
    def _time(self, op: Op, dtype_bytes: int, backward: bool) -> OpTime:
        op = self._eager(op, dtype_bytes) if self.eager else op
        chunks = self.tp_chunks if op.tp_comm is not None and op.matmul is not None else 1
        if chunks > 1:
            op = _with_partial_sum_bytes(op, chunks, dtype_bytes, backward)
        timer = op_backward_time if backward else op_forward_time
        if self.fp8_gpu is None or not fp8_gemm(op):
            return timer(op, self.gpu, dtype_bytes, chunks)
        # the GEMMs at the FP8 rate (1-byte operands), the element-wise kernels as they are
        gemm = timer(
            dataclasses.replace(op, forward_bytes=0, backward_bytes=0), self.fp8_gpu, 1, chunks
        )
        rest = timer(dataclasses.replace(op, matmul=None, forward_flops=0, backward_flops=0),
                     self.gpu, dtype_bytes)  # fmt: skip
        mm = op.matmul
        cols = mm.n if backward else mm.k  # the output gradient's width, or the input's
        rows = mm.batch * mm.m
        cast = fp8_quantize_bytes(self.fp8_recipe, rows, cols, mm.batch)
        # a norm fused into the layer finds its output's amax as it writes it
        if backward or not (self.norm_fused and op.name in NORM_FUSED_LINEARS):
            cast += fp8_amax_pass_bytes(self.fp8_recipe, rows * cols, dtype_bytes)
        if self.float8_weights is not None:
            both = float8_weight_cast_bytes(mm.batch * mm.k * mm.n, self.float8_weights)
            cast += both[1] if backward else both[0]
        return OpTime(gemm.matmul, rest.memory + memory_seconds(self.gpu, cast))

    def _eager(self, op: Op, dtype_bytes: int) -> Op:
        B = dtype_bytes
        forward, backward = op.forward_bytes, op.backward_bytes
        if op.name in NORM_OPS and self.norm == "rmsnorm":
            # per element of the normalised tensor, the fused op's bytes over FUSED_NORM_BYTES
            eager_forward, eager_backward = eager_rmsnorm_bytes(B)
            fused_forward, fused_backward = FUSED_NORM_BYTES
            forward = forward * eager_forward // (fused_forward * B)
            backward = backward * eager_backward // (fused_backward * B)
        if op.name == "act" and self.mlp in EAGER_GATED_ACTS:
            eager_forward, eager_backward = eager_gated_act_bytes(B)
            if self.fused_act:
                forward = forward * eager_forward // (FUSED_GATED_ACT_BYTES[0] * B)
                backward = backward * eager_backward // (FUSED_GATED_ACT_BYTES[1] * B)
            else:
                # a table built with `fused_swiglu: false` counts eager's forward already (its
                # per-op units split silu and the product), not all of its backward
                backward = backward * eager_backward // (UNFUSED_GATED_ACT_BACKWARD_BYTES * B)
        if op.name == "output" and self.norm == "rmsnorm":
            # the final norm's share of the output op: 2 and 3 bytes per element of the stream
            # (step_time._output_op), read x and write y, read x and dy and write dx; eagerly
            # the whole module, whose input gradient meets no residual add
            elements = op.matmul.m * op.matmul.k if op.matmul is not None else 0
            eager_forward, eager_backward = eager_rmsnorm_bytes(B)
            forward += (eager_forward - 2 * B) * elements
            backward += (eager_backward - 3 * B - 3 * B) * elements
        if self.rope and op.name == "qkv_proj" and op.matmul is not None:
            mm = op.matmul  # (tokens x (q + k + v) width); RoPE rotates Q and K
            qk, qkv = self.qk_share
            elements = mm.batch * mm.m * mm.n * qk // qkv
            rope_forward, rope_backward = eager_rope_bytes(B)
            forward += rope_forward * elements
            backward += rope_backward * elements
        if self.rope and op.name == "rope":
            # a per-op policy's RoPE unit, re-run forward only (model.op_policy.rope_moved_bytes):
            # the fused kernel's read and write of each element of Q and K, eagerly the whole
            # eager RoPE
            elements = op.forward_bytes // (2 * B)
            forward += (eager_rope_bytes(B)[0] - 2 * B) * elements
        if self.split_projections and op.matmul is not None:
            projections = {"qkv_proj": TORCHTITAN_QKV_PROJECTIONS}.get(op.name, 0)
            if op.name == "fc1" and self.mlp in EAGER_GATED_ACTS:
                projections = TORCHTITAN_GATED_FC1_PROJECTIONS
            if projections:
                mm = op.matmul  # the input: tokens x k
                backward += split_projection_sum_bytes(projections, B) * mm.batch * mm.m * mm.k
        if (forward, backward) == (op.forward_bytes, op.backward_bytes):
            return op
        return dataclasses.replace(op, forward_bytes=forward, backward_bytes=backward)


def micro_pipelined_chunks(spec) -> int:
    """Row chunks of each tensor-parallel linear's micro-pipelined GEMMs: tp under torchtitan's
    async TP (`model.async_tp.uses_async_tp`), else 1.

    Inductor's micro-pipeline pass (torch/_inductor/fx_passes/micro_pipeline_tp.py, run by
    post_grad.py on the forward and the backward graph alike) replaces an all-gather along the
    sequence followed by matmuls with `fused_all_gather_matmul` (a column-parallel layer's
    forward; a row-parallel layer's input gradient) and a matmul followed by a reduce-scatter
    with `fused_matmul_reduce_scatter` (a row-parallel layer's forward; a column-parallel
    layer's input gradient). Both run one matmul per rank's shard of the rows:
    `_fused_all_gather_matmul_impl`'s `default_consumer` calls `mm_out_op(shard, B, ...)` on
    each gathered (m/tp, k) shard, `_fused_matmul_reduce_scatter_impl`'s `chunk_producer`
    `mm_out_op(A_shards[rank], B, ...)` on each (m/tp, k) chunk
    (torch/distributed/_symmetric_memory/__init__.py, v2.6 line to v2.13.0; the scaled
    variants under float8 alike). The weight gradient's product, on the gathered tensor, stays
    whole."""
    if uses_async_tp(spec.framework, spec.tp, spec.sp, spec.tp_comm_overlap, spec.kernels):
        return spec.tp
    return 1


def micro_pipelined_partial_sum_bytes(rows: int, cols: int, chunks: int, dtype_bytes: int) -> int:
    """Bytes of the reduction after a micro-pipelined matmul's reduce-scatter: the (rows, cols)
    product arrives as `chunks` partial (rows/chunks, cols) blocks, one from each rank
    (`stacked_partials`), which one kernel sums into this rank's (rows/chunks, cols) share
    (`reduce_fn`, torch.sum over the ranks, in `_fused_matmul_reduce_scatter_impl`,
    torch/distributed/_symmetric_memory/__init__.py, v2.6 line to v2.13.0): it reads all and
    writes one share, ceil(rows / chunks) rows as torch.chunk cuts them. NCCL's reduce-scatter
    sums inside its own kernel, so plain TP has no such pass. Derived."""
    return rows * cols * dtype_bytes + -(-rows // chunks) * cols * dtype_bytes


def _with_partial_sum_bytes(op: Op, chunks: int, dtype_bytes: int, backward: bool) -> Op:
    """`op` with the partial-sum pass of its micro-pipelined reduce-scatter: a row-parallel
    layer's output in the forward, a column-parallel layer's input gradient in the backward."""
    mm = op.matmul
    rows = mm.batch * mm.m
    if backward and op.tp_comm == "column":
        extra = micro_pipelined_partial_sum_bytes(rows, mm.k, chunks, dtype_bytes)
        return dataclasses.replace(op, backward_bytes=op.backward_bytes + extra)
    if not backward and op.tp_comm == "row":
        extra = micro_pipelined_partial_sum_bytes(rows, mm.n, chunks, dtype_bytes)
        return dataclasses.replace(op, forward_bytes=op.forward_bytes + extra)
    return op


def _cast_bytes(dtype_bytes: int) -> int:
    """Bytes per element of an eager cast between the activation dtype and fp32 (`x.float()`,
    `type_as`, `.to(dtype)`): read B, write 4, or the reverse; none in fp32, where PyTorch
    returns the tensor itself. Derived (aten._to_copy)."""
    return 0 if dtype_bytes == 4 else dtype_bytes + 4


def eager_rmsnorm_bytes(dtype_bytes: int) -> tuple[int, int]:
    """Bytes per element that eager RMSNorm's kernels read and write, (forward, backward), the
    backward with the add of its input gradient to the residual-stream gradient (3B), as the
    op table's norms count it.

    Source: torchtitan 9dec370 torchtitan/models/norms.py `RMSNorm.forward`,
    `self._norm(x.float()).type_as(x) * self.weight` with `_norm` = `x * torch.rsqrt(
    x.pow(2).mean(-1, keepdim=True) + self.eps)` (the llama3 configs' norm_type "rmsnorm";
    transformers' LlamaRMSNorm runs the same ops). Forward: the cast to fp32 (C = B + 4), pow
    (8), mean (4), x · rsqrt (8), the cast back (C), the weight's product (2B). Backward, as
    autograd runs it: the weight's product's two gradients (2B, 3B) and the weight gradient's
    sum (B), the cast's (C), x · rsqrt's two gradients (8, 12) and rsqrt's sum (4), mean's
    expand-divide (4), pow's (x^1: 8, then 8 and 12), the sum of x's two fp32 gradients (12),
    the first cast's (C), the residual add (3B). In bf16, 36 and 98 bytes, measured by
    validation/torchtitan_eager_bytes.py (per token, h = 4096: 72.0 forward and 196.0 backward
    for the block's two norms)."""
    B, C = dtype_bytes, _cast_bytes(dtype_bytes)
    forward = C + 8 + 4 + 8 + C + 2 * B
    backward = (2 * B + 3 * B + B) + C + (8 + 12 + 4) + 4 + (8 + 8 + 12) + 12 + C + 3 * B
    return forward, backward


def eager_gated_act_bytes(dtype_bytes: int) -> tuple[int, int]:
    """Bytes per element of the gated MLP's hidden width that eager `act(gate) * up` moves,
    (forward, backward).

    Source: torchtitan 9dec370 torchtitan/models/llama/model.py `FeedForward.forward`,
    `F.silu(self.w1(x)) * self.w3(x)` (transformers' LlamaMLP `act_fn(gate_proj(x)) *
    up_proj(x)` alike; GeGLU's gelu the same kernels): silu reads and writes (2B), the product
    reads two and writes one (3B); backward the product's two gradients (3B each) and
    silu_backward (reads dy and gate, writes d gate, 3B). In bf16 10 and 18 bytes, measured by
    validation/torchtitan_eager_bytes.py (35.0 and 63.0 per token with F = 3.5h)."""
    B = dtype_bytes
    return 2 * B + 3 * B, 3 * B + 3 * B + 3 * B


def eager_rope_bytes(dtype_bytes: int) -> tuple[int, int]:
    """Bytes per element of Q and K that eager RoPE moves, (forward, backward).

    Source: torchtitan 9dec370 torchtitan/models/llama/model.py `apply_rotary_emb`:
    `view_as_complex(xq.float()...)` (the cast, C = B + 4), the complex64 product with
    `freqs_cis` (read 4, write 4 per real element), `view_as_real(...).type_as(xq)` (C); the
    backward runs the casts' gradients and the product with the conjugate `freqs_cis` (C + 8 +
    C). In bf16 20 bytes each way, measured by validation/torchtitan_eager_bytes.py (25.25 and
    25.75 per token for Q and K's 1.25h; the rest is the table's broadcast). Transformers'
    `apply_rotary_pos_emb` (rotate_half's slices, negation and cat, q·cos, rotate_half(q)·sin,
    their sum) moves about as much, derived the same way."""
    C = _cast_bytes(dtype_bytes)
    return C + 8 + C, C + 8 + C


def split_projection_sum_bytes(projections: int, dtype_bytes: int) -> int:
    """Bytes per element of a layer input that autograd's sums of the input gradients of
    `projections` separate linear layers on it move: one add (read two, write one, 3B) per
    projection beyond the first. Measured by validation/torchtitan_eager_bytes.py (18.0 per
    token and h: two adds under Q, K, V and one under the MLP's gate and up). Derived."""
    return (projections - 1) * 3 * dtype_bytes


def fp8_gemm(op: Op) -> bool:
    """Whether `op`'s GEMM runs in FP8 under `precision` fp8 or float8."""
    return op.matmul is not None and op.name not in NOT_FP8 and not in_group(op, ATTENTION_CORE)


def fp8_quantize_bytes(recipe: str | None, rows: int, cols: int, groups: int = 1) -> int:
    """Bytes one FP8 cast of a (rows, cols) BF16 tensor moves: it reads the tensor and writes
    the row-wise and the column-wise (transposed) FP8 copy, `FP8_CAST_BYTES` per element
    (torchao's float8 scaling and delayed and current scaling alike, `recipe` None or either);
    MXFP8 writes each copy's E8M0 scales too, one byte per `MXFP8_BLOCK` values along its
    rows for the row-wise copy and along its columns for the column-wise one (TE v2.9
    mxfp8_tensor.py `MXFP8Quantizer.make_empty`: rowwise scale_inv (rows, cols/32),
    columnwise (rows/32, cols); their padding to 128x4 tiles left out). Block scaling
    ("blockwise") writes both copies' fp32 scales, one per 128 values, in the GEMM-ready
    shapes (`fp8_blocks.block_scale_bytes_1d`; TE v2.9 float8_blockwise_tensor.py
    `Float8BlockQuantizer.make_empty`), for each of `groups` equal row groups cast on their
    own (a grouped GEMM's per-expert inputs). Derived."""
    cast = FP8_CAST_BYTES * rows * cols
    if recipe == "mxfp8":
        blocks = -(-cols // MXFP8_BLOCK) * rows + -(-rows // MXFP8_BLOCK) * cols
        cast += blocks
    if recipe == "blockwise":
        per_group = rows // groups
        scales = block_scale_bytes_1d(per_group, cols, "rowwise")
        scales += block_scale_bytes_1d(per_group, cols, "columnwise")
        cast += groups * scales
    return cast


FLOAT8_WEIGHT_CASTS = ("cast", "gathered")


def float8_weight_cast_bytes(weights: int, how: str) -> tuple[int, int]:
    """(forward, backward) HBM bytes of torchao float8's handling of one linear's `weights`
    (elements on this GPU) beyond the GEMM, tensorwise dynamic scaling:

    - "cast": `Float8Linear.forward` finds the bf16 weight's amax and casts it on every
      forward, re-runs included (torchao/float8/float8_linear.py at eab345c); torchao's
      roofline counts 6 bytes an element (torchao/float8/roofline_utils.py at eab345c,
      `get_float8_mem_sympy`: the amax reads 2, the cast reads 2 and writes the row- and
      column-major float8 copies, 1 each; the backward's is "already casted", 0);
    - "gathered" (`fsdp_float8_all_gather`): the weight arrives from FSDP2's all-gather as a
      row-major `Float8Tensor` and no forward casts it (its shard's cast is the all-gather's,
      `float8_shard_cast_bytes`); the backward's grad_input GEMM takes it as `_scaled_mm`'s
      second operand, which `preprocess_addmm` makes column-major, `b_data.t().contiguous()
      .t()` (torchao/float8/float8_ops.py at eab345c): reads and writes 1 byte an element."""
    if how == "cast":
        return 6 * weights, 0
    return 0, 2 * weights


def float8_shard_cast_bytes(shard: int) -> int:
    """HBM bytes of casting one weight's fp32 shard (`shard` elements) to float8 before each
    FSDP2 all-gather under `fsdp_float8_all_gather`: `fsdp_pre_all_gather` with the scale
    precomputed (`hp_tensor_and_scale_to_float8`, torchao/float8/fsdp_utils.py at eab345c;
    FSDP2 hands the extension the sharded parameter itself, fp32 under torchtitan's
    MixedPrecisionPolicy, torch/distributed/fsdp/_fully_shard/_fsdp_param.py, PyTorch
    v2.13.0) reads 4 bytes an element and writes 1."""
    return (4 + 1) * shard


def float8_precompute_amax_bytes(shard: int) -> int:
    """HBM bytes of `precompute_float8_dynamic_scale_for_fsdp` once a step, after the
    optimizer: `torch._foreach_norm(weights, ord=math.inf)` over the fp32 shards reads 4 bytes
    an element, then one all-reduce of the stacked amaxes, a few bytes a weight, not counted
    (torchao/float8/fsdp_utils.py at eab345c)."""
    return 4 * shard


def fp8_amax_pass_bytes(recipe: str | None, elements: int, dtype_bytes: int) -> int:
    """Bytes a cast reads before it casts, to find the tensor's amax: current scaling's
    `Float8CurrentScalingQuantizer::quantize_impl` runs `nvte_compute_amax` over the input, then
    the cast (TE v2.9 transformer_engine/pytorch/csrc/quantizer.cpp), one more read of the
    B-byte input; a norm fused into the linear layer computes the amax as it writes its output
    (v2.9 csrc/extensions/normalization.cpp, `Impl::FUSED_NORM_AMAX_FP8`, then
    `quantize_with_amax`), so the caller skips those. Delayed scaling casts with the scale of
    the amax history and records the amax in the same kernel (TE v1.8 and v2.9
    `cast_transpose` with the scale and amax pointers); MXFP8 and block scaling find each
    block's scale in the cast kernel (TE v2.9 common/transpose/
    quantize_transpose_vector_blockwise.cu and quantize_transpose_square_blockwise.cu: the
    block's amax, then its scale and cast, in one kernel). 0 for all three."""
    return dtype_bytes * elements if recipe == "current" else 0


def fp8_gathered_bytes(recipe: str | None, elements: int) -> int:
    """Bytes of one FP8 sequence-parallel all-gather of `elements` values in all: one byte each
    (`FP8_GATHER_BYTES`), and under MXFP8 one E8M0 scale byte per `MXFP8_BLOCK` of them (TE
    v2.9 transformer_engine/pytorch/distributed.py `_all_gather_mxfp8` gathers the data and its
    scale_inv of the copy the GEMM uses). Block scaling: `fp8_block_gathered_bytes`. Derived."""
    gathered = FP8_GATHER_BYTES * elements
    if recipe == "mxfp8":
        gathered += -(-elements // MXFP8_BLOCK)
    return gathered


FP8_BLOCK_GATHER_USAGES = ("rowwise", "columnwise", "both")


def fp8_block_gathered_bytes(rows: int, cols: int, tp: int, usage: str) -> int:
    """Bytes of one sequence-parallel all-gather under block scaling of a (rows, cols) tensor
    whose `rows` are split over `tp` ranks: the FP8 data of each copy `usage` names, one byte
    a value, and its fp32 scales in the compact all-gather format (each rank's shard's,
    `fp8_blocks.block_scale_bytes_1d` with compact). TE v2.9 transformer_engine/pytorch/
    distributed.py `_all_gather_fp8_blockwise` all-gathers `_rowwise_data` and
    `_rowwise_scale_inv` where the quantizer has row-wise usage and `_columnwise_data` and
    `_columnwise_scale_inv` where it has column-wise usage, in one coalesced group. Which
    usages (module/linear.py, layernorm_linear.py, base.py `grad_output_preprocess`): a
    column-parallel layer's forward gathers its input row-wise ("rowwise"), its backward
    re-gathers the saved column-wise copy for the weight gradient ("columnwise"); a
    row-parallel layer's backward gathers the output gradient with both usages set
    (`quantizer.set_usage(rowwise=True, columnwise=True)`, "dgrad GEMM requires row-wise
    usage, wgrad GEMM requires column-wise usage"), both copies: "both". Derived."""
    local = rows // tp
    copies = ("rowwise", "columnwise") if usage == "both" else (usage,)
    gathered = 0
    for copy in copies:
        gathered += FP8_GATHER_BYTES * rows * cols
        gathered += tp * block_scale_bytes_1d(local, cols, copy, compact=True)
    return gathered


def current_scaling_amax_reductions(recipe: str | None, sp: bool, tp: int) -> int:
    """All-reduces of an `AMAX_BYTES` amax over the tensor-parallel group before each FP8
    sequence-parallel gather (a column-parallel layer's input in the forward, a row-parallel
    layer's output gradient in the backward): 1 under current scaling with sp and tp > 1
    (TE v2.9 module/linear.py and layernorm_linear.py `_customize_quantizers_float8_current_
    scaling`: `with_amax_reduction = True`, `amax_reduction_group = self.tp_group` when
    `sequence_parallel`; `quantize_impl` waits on it before the cast). Delayed scaling reduces
    its amaxes once per micro-batch, not per gather; MXFP8's and block scaling's block scales
    need none (`_customize_quantizers_float8_blockwise_scaling` sets `all_gather_usage`, no
    amax reduction). 0 else."""
    return 1 if recipe == "current" and sp and tp > 1 else 0


def sequence_parallel_gather_bytes(
    precision: str, framework: str, op: Op, version: str | None = None
) -> int:
    """Bytes per element of the tensor-parallel all-gathers of `op` under sequence parallelism
    (its input for a column-parallel layer, its output gradient for a row-parallel one), for
    `framework` at its `version` (`frameworks.framework_version`).

    Transformer Engine (Megatron's `precision` fp8) gathers them in FP8 (`FP8_GATHER_BYTES`):
    NVIDIA/TransformerEngine v1.8 transformer_engine/pytorch/module/layernorm_linear.py (the
    norm writes FP8, `gather_along_first_dim(ln_out, ...)` in the forward and the backward),
    module/base.py `grad_output_preprocess` ("FP8 case with gather: unfused bgrad, cast,
    transpose for efficient gather") and `initialize_ub` ("AllGather buffers use fp8 when using
    fp8 recipe", the userbuffers of tp_comm_overlap); v2.9 transformer_engine/pytorch/
    distributed.py `gather_along_first_dim` (`_all_gather_fp8` for delayed and current
    scaling). torchtitan of December 2024 (`framework_version` "2024.12") with torchao's float8,
    tensor-wise scaling its one recipe there, gathers them in float8 too: its tensor-parallel
    plan takes torchao's `PrepareFloat8ModuleInput` before the attention and the feed-forward
    and `Float8ColwiseParallel` / `Float8RowwiseParallel` for the linears
    (torchtitan/parallelisms/parallelize_llama.py `apply_tp` at 9dec370; at 820504e for the
    tensor-wise recipe, `enable_float8_tensorwise_tp`), which cast the input to float8 before
    its all-gather and, through `NoopFwToFloat8BwDynamic` after the output's reduce-scatter,
    the output gradient before the backward's all-gather (torchao/float8/
    float8_tensor_parallel.py at eab345c); torchtitan 0.3.0's row-wise recipes run plain
    tensor parallelism. Other frameworks' gathers and the BF16 GEMMs' keep the GEMM's dtype."""
    assert op.matmul is not None
    in_fp8 = _gathers_in_fp8(precision, framework, op, version)
    return FP8_GATHER_BYTES if in_fp8 else op.matmul.dtype_bytes


def _gathers_in_fp8(precision: str, framework: str, op: Op, version: str | None) -> bool:
    """Whether `op`'s sequence-parallel gathers are cast to FP8 (sources in
    `sequence_parallel_gather_bytes`): an FP8 GEMM under Megatron's precision fp8 or under
    torchtitan 2024.12's float8."""
    if not fp8_gemm(op):
        return False
    return (precision == "fp8" and framework == "megatron") or (
        precision == "float8" and framework == "torchtitan" and version == "2024.12"
    )


def sequence_parallel_gather_size(spec, op: Op, rows: int, cols: int, usage: str) -> int:
    """Bytes of one sequence-parallel all-gather of a (rows, cols) tensor of `op` (a ModelSpec
    or ChainSpec's run; `rows` gathered over its tp ranks): `sequence_parallel_gather_bytes`
    each, with MXFP8's scales (`fp8_gathered_bytes`) where the gather is in FP8, and under block
    scaling the copies `usage` names with their scales (`fp8_block_gathered_bytes`).

    derived: the per-element bytes times the elements, the scale bytes added by
    `fp8_gathered_bytes` and `fp8_block_gathered_bytes` (sources there)."""
    elements = rows * cols
    version = framework_version(spec)
    if not _gathers_in_fp8(spec.precision, spec.framework, op, version):
        per_element = sequence_parallel_gather_bytes(spec.precision, spec.framework, op, version)
        return per_element * elements
    if spec.fp8_recipe == "blockwise":
        return fp8_block_gathered_bytes(rows, cols, spec.tp, usage)
    return fp8_gathered_bytes(spec.fp8_recipe, elements)


def attention_plateau(gpu: GPU, kernel: str) -> float:
    """The kernel's forward + backward plateau as a share of bf16_flops; SDPA's flash backend is
    FlashAttention-2. GPUError where the kernel does not run on this GPU."""
    plateau = {
        "flash2": gpu.flash_attention_efficiency,
        "sdpa": gpu.flash_attention_efficiency,
        "flash3": gpu.flash3_efficiency,
        "cudnn": gpu.cudnn_attention_efficiency,
        "triton": gpu.triton_attention_efficiency,
    }[kernel]
    if not plateau:
        raise GPUError(f"attention_kernel {kernel!r} has no figure for GPU {gpu.name!r}")
    return plateau


def attention_efficiency(gpu: GPU, kernel: str, seq: int) -> float:
    """e(s) = plateau · s / (s + attention_half_seq) at `seq` query tokens per rank."""
    plateau = attention_plateau(gpu, kernel)
    return plateau * seq / (seq + gpu.attention_half_seq)


@lru_cache(maxsize=512)
def code_path(
    gpu: GPU,
    attention_kernel: str,
    seq: int,
    precision: str,
    kernels: str,
    norm: str,
    mlp: str,
    rope: bool,
    fp8_recipe: str | None = None,
    norm_fused: bool = False,
    qk_share: tuple[int, int] = (2, 3),
    split_projections: bool = False,
    fused_act: bool = True,
    float8_all_gather: bool = False,
    tp_chunks: int = 1,
) -> CodePath:
    """The code path of a run on `gpu` (`seq`: query tokens per context-parallel rank): the
    GEMMs and attention at the GPU's sustained fraction, its clock factor and the rate of the
    code path's group (`KERNEL_RATES`, `RATE_GROUPS`)."""
    rate = gpu.sustained_fraction * gpu.clock_factor * KERNEL_RATES.get(RATE_GROUPS[kernels], 1.0)
    effective = dataclasses.replace(
        gpu,
        matmul_efficiency=gpu.matmul_efficiency * rate,
        flash_attention_efficiency=attention_efficiency(gpu, attention_kernel, seq) * rate,
    )
    fp8 = None
    if precision in ("fp8", "float8"):
        if not gpu.fp8_flops:
            raise GPUError(f"precision fp8 needs FP8 tensor cores; GPU {gpu.name!r} has none")
        fp8 = dataclasses.replace(
            effective,
            bf16_flops=gpu.fp8_flops,
            matmul_efficiency=gpu.fp8_matmul_efficiency * rate,
        )
        if fp8_recipe == "mxfp8" and not gpu.mxfp8:
            raise GPUError(
                f"fp8_recipe mxfp8 needs MXFP8 tensor cores (compute capability 10.x, e.g. "
                f"b200); GPU {gpu.name!r} has none (gpu.mxfp8)"
            )
        if fp8_recipe == "blockwise":
            if not gpu.fp8_block_gemm_rate:
                raise GPUError(
                    f"fp8_recipe blockwise needs block-scaled FP8 GEMMs (compute capability "
                    f"9.x, e.g. h100-sxm); GPU {gpu.name!r} has none (gpu.fp8_block_gemm_rate)"
                )
            fp8 = dataclasses.replace(
                fp8, matmul_efficiency=fp8.matmul_efficiency * gpu.fp8_block_gemm_rate
            )
    float8_weights = None
    if precision == "float8":
        float8_weights = FLOAT8_WEIGHT_CASTS[1 if float8_all_gather else 0]
    return CodePath(
        effective,
        fp8,
        kernels == "eager",
        norm,
        mlp,
        rope,
        fp8_recipe,
        norm_fused,
        qk_share,
        split_projections,
        fused_act,
        float8_weights,
        tp_chunks,
    )


@lru_cache(maxsize=512)
def spec_code_path(spec, gpu: GPU) -> CodePath:
    """`code_path` for a model description (a ModelSpec or its ChainSpec)."""
    return code_path(
        gpu,
        spec.attention_kernel,
        max(1, spec.seq // spec.cp),
        spec.precision,
        spec.kernels,
        spec.norm,
        spec.mlp,
        spec.positions == "rope",
        spec.fp8_recipe,
        spec.framework == "megatron",
        (spec.heads + spec.kv_heads, spec.heads + 2 * spec.kv_heads),
        spec.framework == "torchtitan",
        spec.fused_swiglu,
        spec.fsdp_float8_all_gather,
        micro_pipelined_chunks(spec),
    )
