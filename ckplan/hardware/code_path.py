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
  fused kernels than under torch.compile or eager PyTorch.
- **Kernels for the memory-bound ops** (`kernels`): Megatron's fused CUDA kernels and
  torch.compile's generated ones (Inductor fuses each chain of element-wise ops into one kernel)
  move what the op table says; eager PyTorch runs each step of a norm, an activation and RoPE as
  its own kernel and moves more (`EAGER_BYTES`, derived below from the Hugging Face / torchtitan
  Llama code).
- **GEMM precision** (`precision`): FP8 linear layers (Transformer Engine, torchao float8) run at
  the FP8 tensor-core rate and pay for casting their inputs and gradients to FP8; the attention
  core and the output layer stay in BF16 (Megatron-LM and torchao's defaults). Under
  Transformer Engine the scaling recipe (`fp8_recipe`) changes what each cast and each
  sequence-parallel gather moves (`fp8_quantize_bytes`, `fp8_amax_pass_bytes`,
  `fp8_gathered_bytes`) and, under current scaling, adds an amax all-reduce before each FP8
  gather (`current_scaling_amax_reductions`, timed in ckplan.hardware.step_time).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from ckplan.hardware.gpus import GPU, GPUError
from ckplan.hardware.roofline import OpTime, memory_seconds, op_backward_time, op_forward_time
from ckplan.model.op import ATTENTION_CORE, Op, in_group

# Eager PyTorch against the fused kernel, bytes moved per op (forward, backward), derived from
# the Hugging Face / torchtitan Llama modules element by element, with B = 2:
# - RMSNorm (LlamaRMSNorm.forward): x.to(fp32) (read 2, write 4), pow(2) (4, 4), mean (4),
#   x * rsqrt(var) (4, 4), .to(dtype) (4, 2), weight * x (2, 2): 36 bytes per element against
#   the fused kernel's 4 (read x, write y), 9x; its autograd backward runs each step's gradient
#   (about 30 bytes per element against the fused backward's 16 in `LayerShapes.norm_moved`),
#   1.9x. LayerNorm's eager module is one ATen kernel (torch.nn.functional.layer_norm): 1x.
# - SwiGLU (act_fn(gate) * up): silu (2, 2) then the product (4, 2), 10 bytes per element against
#   the fused bias_swiglu's 6, 1.7x; backward 16 against 10, 1.6x.
# Residual adds, dropout and GEMMs are the same kernels either way.
EAGER_BYTES: dict[tuple[str, str], tuple[float, float]] = {
    ("norm", "rmsnorm"): (9.0, 1.9),
    ("act", "swiglu"): (1.7, 1.6),
    ("act", "geglu"): (1.7, 1.6),
}
# RoPE applied eagerly (apply_rotary_pos_emb: rotate_half's slices, negation and cat, q·cos,
# rotate_half(q)·sin, the sum) moves about 24 bytes per element of Q and of K, the fused kernel
# 4: 20 bytes more per element, forward and backward alike (derived from the code as above).
EAGER_ROPE_EXTRA_BYTES = 20
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
# The GEMMs' and attention kernels' sustained rate per code path (`kernels`), relative to
# Megatron's fused kernels, fitted by validation/fit_time_model.py on the calibration split
# (docs/validation.md, "The time model's fitted constants"): what a step's GEMMs and attention
# lose outside Transformer Engine / Megatron's code (PyTorch's cuBLAS calls without fused
# epilogues, torchao's separate FP8 scaling kernels, the kernel launch gaps between them and
# FSDP2's per-parameter hooks). A code path with fewer calibration runs than the fit's minimum
# keeps 1.0; fused is the reference.
# calibration runs: fused 53, compiled 6, eager 4
KERNEL_RATES: dict[str, float] = {"fused": 1.0, "compiled": 0.835, "eager": 1.0}
NORM_OPS = ("norm1", "norm2", "qk_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "kv_norm")
NOT_FP8 = ("output", "router")  # the output layer and the router stay in BF16


@dataclass(frozen=True)
class CodePath:
    """What a run's execution changes in the roofline of its ops (see the module docstring)."""

    gpu: GPU  # compute rates at the sustained fraction, the attention kernel's at this length
    fp8_gpu: GPU | None  # the same for FP8 GEMMs; None: BF16 GEMMs
    eager: bool
    norm: str
    mlp: str
    rope: bool
    fp8_recipe: str | None = None  # Transformer Engine's scaling recipe (precision fp8)
    norm_fused: bool = False  # the norms are fused into the linear layers after them (Megatron)
    # torchao float8's weights (precision float8): "cast" from bf16 on every forward, or
    # "gathered" in float8 by FSDP2 (fsdp_float8_all_gather): `float8_weight_cast_bytes`
    float8_weights: str | None = None

    def forward(self, op: Op, dtype_bytes: int) -> OpTime:
        return self._time(op, dtype_bytes, backward=False)

    def backward(self, op: Op, dtype_bytes: int) -> OpTime:
        return self._time(op, dtype_bytes, backward=True)

    def _time(self, op: Op, dtype_bytes: int, backward: bool) -> OpTime:
        op = self._eager(op, dtype_bytes) if self.eager else op
        timer = op_backward_time if backward else op_forward_time
        if self.fp8_gpu is None or not fp8_gemm(op):
            return timer(op, self.gpu, dtype_bytes)
        # the GEMMs at the FP8 rate (1-byte operands), the element-wise kernels as they are
        gemm = timer(dataclasses.replace(op, forward_bytes=0, backward_bytes=0), self.fp8_gpu, 1)
        rest = timer(dataclasses.replace(op, matmul=None, forward_flops=0, backward_flops=0),
                     self.gpu, dtype_bytes)  # fmt: skip
        mm = op.matmul
        cols = mm.n if backward else mm.k  # the output gradient's width, or the input's
        rows = mm.batch * mm.m
        cast = fp8_quantize_bytes(self.fp8_recipe, rows, cols)
        # a norm fused into the layer finds its output's amax as it writes it
        if backward or not (self.norm_fused and op.name in NORM_FUSED_LINEARS):
            cast += fp8_amax_pass_bytes(self.fp8_recipe, rows * cols, dtype_bytes)
        if self.float8_weights is not None:
            both = float8_weight_cast_bytes(mm.batch * mm.k * mm.n, self.float8_weights)
            cast += both[1] if backward else both[0]
        return OpTime(gemm.matmul, rest.memory + memory_seconds(self.gpu, cast))

    def _eager(self, op: Op, dtype_bytes: int) -> Op:
        kind = ("norm", self.norm) if op.name in NORM_OPS else (op.name, self.mlp)
        forward, backward = EAGER_BYTES.get(kind, (1.0, 1.0))
        extra = 0
        if self.rope and op.name == "qkv_proj" and op.matmul is not None:
            mm = op.matmul  # (tokens x (q + k + v) width); Q and K are all but V's share
            extra = EAGER_ROPE_EXTRA_BYTES * mm.batch * mm.m * mm.n * 2 // 3
        if self.rope and op.name == "rope":
            # a per-op policy's RoPE unit (model.op_policy.rope_moved_bytes): reads and writes
            # each element of Q and K once in the fused kernel
            extra = EAGER_ROPE_EXTRA_BYTES * (op.forward_bytes // (2 * dtype_bytes))
        if (forward, backward, extra) == (1.0, 1.0, 0):
            return op
        return dataclasses.replace(
            op,
            forward_bytes=round(op.forward_bytes * forward) + extra,
            backward_bytes=round(op.backward_bytes * backward) + extra,
        )


def fp8_gemm(op: Op) -> bool:
    """Whether `op`'s GEMM runs in FP8 under `precision` fp8 or float8."""
    return op.matmul is not None and op.name not in NOT_FP8 and not in_group(op, ATTENTION_CORE)


def fp8_quantize_bytes(recipe: str | None, rows: int, cols: int) -> int:
    """Bytes one FP8 cast of a (rows, cols) BF16 tensor moves: it reads the tensor and writes
    the row-wise and the column-wise (transposed) FP8 copy, `FP8_CAST_BYTES` per element
    (torchao's float8 scaling and delayed and current scaling alike, `recipe` None or either);
    MXFP8 writes each copy's E8M0 scales too, one byte per `MXFP8_BLOCK` values along its
    rows for the row-wise copy and along its columns for the column-wise one (TE v2.9
    mxfp8_tensor.py `MXFP8Quantizer.make_empty`: rowwise scale_inv (rows, cols/32),
    columnwise (rows/32, cols); their padding to 128x4 tiles left out). Derived."""
    cast = FP8_CAST_BYTES * rows * cols
    if recipe == "mxfp8":
        blocks = -(-cols // MXFP8_BLOCK) * rows + -(-rows // MXFP8_BLOCK) * cols
        cast += blocks
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
    `cast_transpose` with the scale and amax pointers); MXFP8 finds each block's scale in the
    cast kernel. 0 for both."""
    return dtype_bytes * elements if recipe == "current" else 0


def fp8_gathered_bytes(recipe: str | None, elements: int) -> int:
    """Bytes of one FP8 sequence-parallel all-gather of `elements` values in all: one byte each
    (`FP8_GATHER_BYTES`), and under MXFP8 one E8M0 scale byte per `MXFP8_BLOCK` of them (TE
    v2.9 transformer_engine/pytorch/distributed.py `_all_gather_mxfp8` gathers the data and its
    scale_inv of the copy the GEMM uses). Derived."""
    gathered = FP8_GATHER_BYTES * elements
    if recipe == "mxfp8":
        gathered += -(-elements // MXFP8_BLOCK)
    return gathered


def current_scaling_amax_reductions(recipe: str | None, sp: bool, tp: int) -> int:
    """All-reduces of an `AMAX_BYTES` amax over the tensor-parallel group before each FP8
    sequence-parallel gather (a column-parallel layer's input in the forward, a row-parallel
    layer's output gradient in the backward): 1 under current scaling with sp and tp > 1
    (TE v2.9 module/linear.py and layernorm_linear.py `_customize_quantizers_float8_current_
    scaling`: `with_amax_reduction = True`, `amax_reduction_group = self.tp_group` when
    `sequence_parallel`; `quantize_impl` waits on it before the cast). Delayed scaling reduces
    its amaxes once per micro-batch, not per gather; MXFP8's block scales need none. 0 else."""
    return 1 if recipe == "current" and sp and tp > 1 else 0


def sequence_parallel_gather_bytes(precision: str, framework: str, op: Op) -> int:
    """Bytes per element of the tensor-parallel all-gathers of `op` under sequence parallelism
    (its input for a column-parallel layer, its output gradient for a row-parallel one).

    Transformer Engine (Megatron's `precision` fp8) gathers them in FP8 (`FP8_GATHER_BYTES`):
    NVIDIA/TransformerEngine v1.8 transformer_engine/pytorch/module/layernorm_linear.py (the
    norm writes FP8, `gather_along_first_dim(ln_out, ...)` in the forward and the backward),
    module/base.py `grad_output_preprocess` ("FP8 case with gather: unfused bgrad, cast,
    transpose for efficient gather") and `initialize_ub` ("AllGather buffers use fp8 when using
    fp8 recipe", the userbuffers of tp_comm_overlap); v2.9 transformer_engine/pytorch/
    distributed.py `gather_along_first_dim` (`_all_gather_fp8` for delayed and current
    scaling). Other frameworks' gathers and the BF16 GEMMs' keep the GEMM's dtype."""
    assert op.matmul is not None
    return FP8_GATHER_BYTES if _gathers_in_fp8(precision, framework, op) else op.matmul.dtype_bytes


def _gathers_in_fp8(precision: str, framework: str, op: Op) -> bool:
    """Whether Transformer Engine casts `op`'s sequence-parallel gather to FP8 (sources in
    `sequence_parallel_gather_bytes`): an FP8 GEMM under Megatron's precision fp8."""
    return precision == "fp8" and framework == "megatron" and fp8_gemm(op)


def sequence_parallel_gather_size(spec, op: Op, elements: int) -> int:
    """Bytes of one sequence-parallel all-gather of `elements` values of `op` (a ModelSpec or
    ChainSpec's run): `sequence_parallel_gather_bytes` each, with MXFP8's scales
    (`fp8_gathered_bytes`) where the gather is in FP8.

    derived: the per-element bytes times the elements, MXFP8's scale bytes added by
    `fp8_gathered_bytes` (sources there)."""
    if _gathers_in_fp8(spec.precision, spec.framework, op):
        return fp8_gathered_bytes(spec.fp8_recipe, elements)
    return sequence_parallel_gather_bytes(spec.precision, spec.framework, op) * elements


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
    float8_all_gather: bool = False,
) -> CodePath:
    """The code path of a run on `gpu` (`seq`: query tokens per context-parallel rank): the
    GEMMs and attention at the GPU's sustained fraction, its clock factor and the code path's
    rate (`KERNEL_RATES`)."""
    rate = gpu.sustained_fraction * gpu.clock_factor * KERNEL_RATES.get(kernels, 1.0)
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
    float8_weights = None
    if precision == "float8":
        float8_weights = FLOAT8_WEIGHT_CASTS[1 if float8_all_gather else 0]
    return CodePath(
        effective, fp8, kernels == "eager", norm, mlp, rope, fp8_recipe, norm_fused, float8_weights
    )


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
        spec.fsdp_float8_all_gather,
    )
