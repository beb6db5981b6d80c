"""Fine-tuning with frozen weights, LoRA and QLoRA: what changes in a layer's op table and in
the model states when the base weights do not train (docs/fine-tuning.md).

- A frozen linear layer y = x·Wᵀ needs only W for its input gradient dX = dY·W and computes no
  weight gradient: autograd saves its input only when the weight requires a gradient (PyTorch's
  generated MmBackward saves `self` only if `mat2` needs a gradient; tools/autograd/
  derivatives.yaml, `mm`), and its backward runs one GEMM instead of two.
- LoRA (Hu et al. 2021, §4.1) adds y += B·A·dropout(x)·(alpha/r) beside each targeted linear,
  with A (r x in) and B (out x r) trained. PEFT's `lora.Linear.forward` (peft v0.17.0,
  src/peft/tuners/lora/layer.py): `result = result + lora_B(lora_A(dropout(x))) * scaling`,
  where `dropout` is nn.Identity when lora_dropout is 0. A saves its input (x itself, or the
  dropout's new output and its mask), B saves A's r-wide output; the multiply by the Python
  float `scaling` and the add save nothing.
- QLoRA (Dettmers et al. 2023) keeps the frozen linear weights in 4-bit NormalFloat with
  double-quantised block statistics (`quantized_weight_bytes`); bitsandbytes' MatMul4Bit
  (bitsandbytes 0.45.5, bitsandbytes/autograd/_functions.py) saves no activation
  (`ctx.tensors = (None, B)`: the packed weight only) and dequantises the weight to the
  activation dtype in forward and again in backward for dX, each time a memory-bound kernel
  that reads the packed weight and its statistics and writes the dequantised copy
  (`dequantize_4bit_bytes`). Releases before 0.43.2 keep the input too
  (`matmul_4bit_keeps_input`).
- LLM.int8() (Dettmers et al. 2022) keeps the frozen weights in int8 with an fp32 scale per
  row; bitsandbytes' MatMul8bitLt quantises each input to int8 for an int8 GEMM and keeps the
  input itself for the backward, which rebuilds the weight in the activation dtype for dX
  (`int8_forward_bytes`, `dequantize_8bit_bytes`, `matmul_8bit_keeps_transposed_input`).

- DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", §4.3; PEFT's
  `use_dora`, peft v0.21.2 src/peft/tuners/lora/dora.py `DoraLinearLayer.forward` and
  variants.py `DoraLinearVariant.forward`) adds a trained magnitude vector m of `out` values
  per adapter and, each forward, the column norm ‖W + scaling·B·A‖ of the weight (detached):
  B·A is formed as lora_B(lora_A(eye(in))), whose graph is dropped with the detach. The
  output adds (m/‖·‖ - 1)·base_result + (m/‖·‖)·lora_B(lora_A(x))·scaling, so autograd keeps
  the base output and B's output (`out` wide each) and three `out`-long vectors (the norm,
  m/‖·‖ - 1 and m/‖·‖). With dropout PEFT runs the base GEMM again on the dropped input
  (base_result = F.linear(dropout(x), W)).

PEFT names the linear layers of a Llama layer q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj and down_proj; ckplan's ops are qkv_proj (q, k, v), out_proj (o), fc1 (gate and up, or
up alone in a GELU MLP) and fc2 (down).

- A layer whose MLP is a mixture of experts (`_moe_layer`): Hugging Face transformers v5.25.0
  holds the routed experts as 3D parameters of one module and the router as a bare parameter
  (models/mixtral/modeling_mixtral.py `MixtralExperts.gate_up_proj`, `down_proj`,
  `MixtralTopKRouter.weight`; the same in qwen2_moe, qwen3_moe, olmoe and gpt_oss), not as
  nn.Linear modules. The shared experts' MLP is nn.Linear modules (Qwen2MoeSparseMoeBlock.
  shared_expert's gate_proj, up_proj and down_proj; ckplan's shared_fc1 and shared_fc2). The
  adapters sit on the attention projections: for the MLP's names and all-linear, PEFT 0.21.2
  adapts the experts' 3D parameters and the router of Mixtral- and Qwen-MoE models instead
  (peft/utils/transformers_weight_conversion.py `_convert_peft_config_moe`, target_parameters),
  which the spec refuses. The experts, the router, the shared experts and their gate stay
  frozen: no weight-gradient GEMM, no saved input (`FROZEN_MOE_GEMMS`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ckplan.model.layers import LayerKind, layer_kinds
from ckplan.model.op import MASK_BYTES, Op, matmul_flops
from ckplan.model.parts import LORA_TARGETS
from ckplan.model.spec import ChainSpec

# ckplan's linear op holding each PEFT module
SITE_OF = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "out_proj",
    "gate_proj": "fc1",
    "up_proj": "fc1",
    "down_proj": "fc2",
}
# ... and in a layer whose MLP is a mixture of experts: the shared experts' MLP
SHARED_EXPERT_SITE_OF = SITE_OF | {
    "gate_proj": "shared_fc1",
    "up_proj": "shared_fc1",
    "down_proj": "shared_fc2",
}
FROZEN_LINEARS = ("qkv_proj", "out_proj", "fc1", "fc2", "shared_fc1", "shared_fc2")
# the GEMMs of a mixture of experts that no adapter sits beside, frozen with the base weights
FROZEN_MOE_GEMMS = ("router", "expert_fc1", "expert_fc2", "shared_gate")
# bitsandbytes' defaults (bitsandbytes 0.45.5, bitsandbytes/functional.py quantize_4bit and
# quantize_blockwise): 64 weights per 4-bit block; double quantisation quantises the blocks'
# fp32 absmax to 8 bits in blocks of 256, each with an fp32 absmax, around one fp32 offset.
NF4_BLOCK = 64
NF4_STATS_BLOCK = 256
NF4_CODE_BYTES = 16 * 4  # get_4bit_type: the 16 fp32 levels of nf4/fp4, one tensor per weight
FP32_BYTES = 4
HALF_BYTES = 2


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter of one layer: its PEFT module, the op it sits beside, its widths."""

    module: str
    site: str
    fan_in: int
    fan_out: int

    def parameters(self, rank: int, dora: bool = False) -> int:
        """A (r x in) and B (out x r): r·(in + out) (Hu et al. 2021, §4.1); with DoRA the
        magnitude vector too, out (peft v0.21.2, dora.py `update_layer`: the weight norm's
        shape, one value per output row)."""
        return rank * (self.fan_in + self.fan_out) + (self.fan_out if dora else 0)


# bitsandbytes' first release whose MatMul4Bit no longer keeps its input
MATMUL_4BIT_DROPS_INPUT_FROM = (0, 43, 2)


def matmul_4bit_keeps_input(bitsandbytes_version: str | None) -> bool:
    """Whether bitsandbytes' 4-bit matmul keeps its input A alive until its backward.

    bitsandbytes 0.43.0 and 0.43.1, bitsandbytes/autograd/_functions.py `MatMul4Bit.forward`:
    `if any(ctx.needs_input_grad[:2]): ctx.tensors = (A, B)`, a reference on the autograd
    node that its backward never reads (it computes dX = dY·dequantize(B) only); commit
    9e75374 ("fix QLoRA mem bug: delete useless buffered activation", bitsandbytes PR #1270,
    2024-07-16), first released in 0.43.2, keeps `(None, B)`. `bitsandbytes_version` None
    is a current release: False."""
    if bitsandbytes_version is None:
        return False
    return _release(bitsandbytes_version) < MATMUL_4BIT_DROPS_INPUT_FROM


# bitsandbytes' first release whose MatMul8bitLt quantises a frozen weight's input one way only
MATMUL_8BIT_FAST_PATH_FROM = (0, 45, 0)
# transformers' BitsAndBytesConfig(load_in_8bit=True) default llm_int8_threshold: LLM.int8()'s
# outlier threshold (Dettmers et al. 2022, §3.2), which turns on the outlier search each forward
INT8_THRESHOLD = 6.0


def _release(bitsandbytes_version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in bitsandbytes_version.split("."))


def matmul_8bit_keeps_transposed_input(bitsandbytes_version: str | None) -> bool:
    """Whether bitsandbytes' LLM.int8() matmul keeps a column-wise int8 copy of its input (CAt,
    with its fp32 column statistics SCAt) until its backward, beside the input itself.

    bitsandbytes 0.41.0 to 0.44.1, bitsandbytes/autograd/_functions.py `MatMul8bitLt.forward`:
    `CA, CAt, SCA, SCAt, coo_tensorA = F.double_quant(A.to(torch.float16), ...)` on every call,
    then `if any(ctx.needs_input_grad[:2]): ctx.tensors = (CAt, subA, A)`. From 0.45.0 a weight
    that needs no gradient takes the fast path, `F.int8_vectorwise_quant`, and CAt is None.
    `bitsandbytes_version` None is a current release: False."""
    if bitsandbytes_version is None:
        return False
    return _release(bitsandbytes_version) < MATMUL_8BIT_FAST_PATH_FROM


def int8_transposed_input_bytes(tokens: int, fan_in: int) -> int:
    """Bytes of the copy `matmul_8bit_keeps_transposed_input` describes, for one int8 linear:
    CAt, one int8 per input value, and SCAt, one fp32 per input feature (bitsandbytes 0.44.1
    functional.py `double_quant`: `out_col` in A's shape, `col_stats` of A's columns)."""
    return tokens * fan_in + FP32_BYTES * fan_in


def int8_forward_bytes(tokens: int, fan_in: int, fan_out: int, dtype_bytes: int, fp16: bool) -> int:
    """HBM bytes one LLM.int8() linear moves beside its int8 GEMM in the forward, as
    bitsandbytes 0.45.5 runs a frozen weight (bitsandbytes/autograd/_functions.py
    `MatMul8bitLt.forward`, functional.py `int8_vectorwise_quant`, `int8_mm_dequant`), per
    input value (tokens·fan_in) and output value (tokens·fan_out):

    - `A.to(torch.float16)`: reads the input, writes fp16 (none under fp16 activations);
    - the outlier search at llm_int8_threshold 6.0 (`INT8_THRESHOLD`): `A.abs()` reads 2 and
      writes 2 bytes, `>= threshold` reads 2 and writes a 1-byte bool, `outliers.any()` and
      `outliers.any(dim=0)` read it once each;
    - `cint8_vector_quant` reads 2 and writes the 1-byte codes, and an fp32 scale per row;
    - `int8_mm_dequant` reads the GEMM's int32 output and writes fp16, with both scale vectors;
    - `.to(A.dtype)`: reads fp16 and writes the activation dtype (none under fp16).

    The outlier columns' own fp16 product (`addmm(subA, state.subB)`) depends on the data and
    is not counted. derived: the bytes each kernel reads and writes."""
    cast_in = 0 if fp16 else dtype_bytes + HALF_BYTES
    cast_out = 0 if fp16 else HALF_BYTES + dtype_bytes
    outlier_search = (2 + 2) + (2 + 1) + 1 + 1 if INT8_THRESHOLD > 0 else 0
    quantize = HALF_BYTES + 1
    dequantize = FP32_BYTES + HALF_BYTES
    per_input = cast_in + outlier_search + quantize
    return (
        tokens * fan_in * per_input
        + FP32_BYTES * tokens  # the row scales, written by the quantisation
        + tokens * fan_out * (dequantize + cast_out)
        + FP32_BYTES * (tokens + fan_out)  # both scale vectors, read by the dequantisation
    )


def dequantize_8bit_bytes(fan_in: int, fan_out: int, dtype_bytes: int) -> int:
    """HBM bytes one LLM.int8() linear's backward moves to rebuild its weight for dX
    (bitsandbytes 0.45.5 `MatMul8bitLt.backward`: `CB = state.CB.to(ctx.dtype_A, copy=True)
    .mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))`, then `torch.matmul(grad_output, CB)`):
    the copy reads the int8 codes and writes the activation dtype, the scale vector is read
    and written once, and the in-place multiply reads the weight and the scales and writes
    the weight. derived: the bytes each kernel reads and writes."""
    n = fan_in * fan_out
    return (
        n * (1 + dtype_bytes)
        + 2 * FP32_BYTES * fan_out
        + n * 2 * dtype_bytes
        + FP32_BYTES * fan_out
    )


def _moe_layer(spec: ChainSpec, kind: LayerKind | None) -> bool:
    """Whether a layer of `kind` (None: the first layer's, a uniform model's only kind) has a
    mixture of experts for its MLP."""
    if not spec.experts:
        return False
    return (layer_kinds(spec)[0] if kind is None else kind).moe


def site_of(spec: ChainSpec, kind: LayerKind | None = None) -> dict[str, str]:
    """ckplan's op holding each PEFT-named module in a layer of `kind`: `SITE_OF`, or with a
    mixture of experts `SHARED_EXPERT_SITE_OF`."""
    return SHARED_EXPERT_SITE_OF if _moe_layer(spec, kind) else SITE_OF


def linear_shapes(spec: ChainSpec, kind: LayerKind | None = None) -> dict[str, tuple[int, int]]:
    """(in, out) of each PEFT-named linear layer of one layer of `kind`, whole (not split over
    tp): q a·d, k and v g·d, o from a·d, gate and up F (gated MLPs only), down to h. In a layer
    whose MLP is a mixture of experts the MLP's are the shared experts' (F their total width;
    none without shared experts); the routed experts and the router are no linear modules
    (the module docstring)."""
    h, d = spec.hidden, spec.head_dim
    F = spec.shared_ffn_hidden if _moe_layer(spec, kind) else spec.ffn_hidden
    shapes = {
        "q_proj": (h, spec.heads * d),
        "k_proj": (h, spec.kv_heads * d),
        "v_proj": (h, spec.kv_heads * d),
        "o_proj": (spec.heads * d, h),
        "gate_proj": (h, F),
        "up_proj": (h, F),
        "down_proj": (F, h),
    }
    if spec.mlp == "gelu" or not F:
        del shapes["gate_proj"]
    if not F:
        del shapes["up_proj"], shapes["down_proj"]
    return shapes


def adapters(spec: ChainSpec, kind: LayerKind | None = None) -> tuple[Adapter, ...]:
    """The LoRA adapters of one layer of `kind`, in layer order (all-linear: every linear layer
    of the layer, the output layer excluded, as PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND)."""
    shapes = linear_shapes(spec, kind)
    sites = site_of(spec, kind)
    return tuple(
        Adapter(name, sites[name], *shapes[name])
        for name in LORA_TARGETS
        if name in spec.finetune.adapters and name in shapes
    )


def adapter_tensor_elements(spec: ChainSpec, kind: LayerKind | None = None) -> tuple[int, ...]:
    """The elements of each of one layer's adapter tensors: per adapter lora_A (r x in) and
    lora_B (out x r) (Hu et al. 2021, §4.1), and with DoRA the magnitude vector (out)."""
    rank, dora = spec.finetune.lora_rank, spec.finetune.use_dora
    tensors: list[int] = []
    for adapter in adapters(spec, kind):
        tensors += [rank * adapter.fan_in, adapter.fan_out * rank]
        if dora:
            tensors.append(adapter.fan_out)
    return tuple(tensors)


def lora_layer_parameters(spec: ChainSpec, kind: LayerKind | None = None) -> int:
    """Trainable parameters of the adapters of one layer of `kind`: Σ r·(in + out) (PEFT's
    print_trainable_parameters counts the same lora_A and lora_B weights)."""
    finetune = spec.finetune
    return sum(
        adapter.parameters(finetune.lora_rank, finetune.use_dora)
        for adapter in adapters(spec, kind)
    )


def largest_layer_lora_parameters(spec: ChainSpec) -> int:
    """The most adapter parameters one layer of `spec` has, over its kinds of layer."""
    return max(lora_layer_parameters(spec, kind) for kind in set(layer_kinds(spec)))


def lora_parameters(spec: ChainSpec, kind_counts: dict[LayerKind, int]) -> int:
    """Trainable parameters of the adapters of `kind_counts`' layers (count per kind)."""
    return sum(count * lora_layer_parameters(spec, kind) for kind, count in kind_counts.items())


def quantized_weight_bytes(fan_in: int, fan_out: int, weight_format: str) -> int:
    """Bytes of one frozen linear weight of fan_in·fan_out values in `weight_format`.

    nf4 / fp4 (bitsandbytes 0.45.5, functional.quantize_4bit with Params4bit's defaults
    blocksize 64, compress_statistics True, as QLoRA's recipe bnb_4bit_use_double_quant): two
    values per byte, ⌈n/2⌉; per block of 64 an 8-bit quantised absmax; per 256 of those an fp32
    absmax (quantize_blockwise's state2); one fp32 offset; the 16 fp32 code values. The
    256-entry dynamic map of the second level is one cached tensor for all weights (not
    counted).
    int8 (bitsandbytes Int8Params, LLM.int8(), Dettmers et al. 2022): one byte per value and an
    fp32 scale per output row (SCB).
    bf16 / fp16 / fp32: 2, 2 or 4 bytes per value.
    """
    n = fan_in * fan_out
    if weight_format in ("nf4", "fp4"):
        blocks = -(-n // NF4_BLOCK)
        second_level = -(-blocks // NF4_STATS_BLOCK)
        return -(-n // 2) + blocks + FP32_BYTES * second_level + FP32_BYTES + NF4_CODE_BYTES
    if weight_format == "int8":
        return n + FP32_BYTES * fan_out
    return n * {"bf16": 2, "fp16": 2, "fp32": 4}[weight_format]


def quantization_statistics_bytes(fan_in: int, fan_out: int, weight_format: str) -> int:
    """Bytes of one frozen nf4 / fp4 weight beyond its packed values (`quantized_weight_bytes`
    less ⌈n/2⌉): the blocks' absmax, the second level's and the code, which bitsandbytes keeps
    in the weight's QuantState, an attribute of the Params4bit, not in the parameter's data
    (bitsandbytes 0.43.0, nn/modules.py `Params4bit.__new__`: `self.quant_state =
    quant_state`; functional.py `quantize_4bit`: the data is the packed `out` alone). ZeRO-3
    and FSDP shard a module's parameters' data only, so every rank keeps these whole. 0 for the
    other formats."""
    if weight_format not in ("nf4", "fp4"):
        return 0
    n = fan_in * fan_out
    return quantized_weight_bytes(fan_in, fan_out, weight_format) - -(-n // 2)


def layer_quantization_statistics_bytes(spec: ChainSpec, kind: LayerKind | None = None) -> int:
    """One layer's `quantization_statistics_bytes` over its frozen linear weights."""
    fmt = spec.finetune.weight_format
    if fmt is None:
        return 0
    return sum(
        quantization_statistics_bytes(fan_in, fan_out, fmt)
        for fan_in, fan_out in linear_shapes(spec, kind).values()
    )


def gathered_weight_bytes(
    fan_in: int, fan_out: int, weight_format: str | None, weight_bytes: int
) -> int:
    """Bytes of one frozen linear weight as ZeRO-3 or FSDP gathers it, its parameter's data:
    the packed values of a 4-bit weight, ⌈n/2⌉ (its statistics are not the parameter's data,
    `quantization_statistics_bytes`), int8's n bytes, else n values at their bytes
    (`weight_bytes` where no format is given)."""
    n = fan_in * fan_out
    if weight_format in ("nf4", "fp4"):
        return -(-n // 2)
    if weight_format == "int8":
        return n
    per_value = weight_bytes if weight_format is None else {"fp32": 4}.get(weight_format, 2)
    return n * per_value


def expert_weight_shapes(spec: ChainSpec, kind: LayerKind | None = None) -> list[tuple[int, int]]:
    """(in, out) of each frozen weight matrix of a layer of `kind`'s mixture of experts beyond
    its linear modules (`linear_shapes`): per routed expert its fc1 (h to 2F_e gated, F_e) and
    fc2 (F_e to h), the router (h to E) and the shared experts' gate (h to 1); none in a
    dense layer. Their biases are not counted, as for the linears."""
    if not _moe_layer(spec, kind):
        return []
    h, width = spec.hidden, spec.moe_ffn_hidden
    fc1 = (h, (1 if spec.mlp == "gelu" else 2) * width)
    shapes = [fc1, (width, h)] * spec.experts + [(h, spec.experts)]
    if spec.shared_ffn_hidden and spec.shared_expert_gate:
        shapes.append((h, 1))
    return shapes


def gathered_layer_bytes(
    spec: ChainSpec, weight_bytes: int, kind: LayerKind | None = None
) -> tuple[int, int]:
    """(one layer, its largest weight): the bytes ZeRO-3 gathers of one layer of `kind`'s frozen
    linear weights, its experts' and router's (`expert_weight_shapes`, at `weight_bytes` a
    value) and its adapters (`gathered_weight_bytes`; the adapters at `weight_bytes` per value;
    the norms, below the persistence threshold, stay whole and are not counted). None: the
    model's largest layer."""
    if kind is None and spec.experts:
        return max(
            gathered_layer_bytes(spec, weight_bytes, each) for each in set(layer_kinds(spec))
        )
    fmt = spec.finetune.weight_format
    weights = [
        gathered_weight_bytes(i, o, fmt, weight_bytes)
        for i, o in linear_shapes(spec, kind).values()
    ]
    weights += [weight_bytes * i * o for i, o in expert_weight_shapes(spec, kind)]
    adapter_values = lora_layer_parameters(spec, kind)
    return sum(weights) + weight_bytes * adapter_values, max(weights)


def frozen_linear_bytes(spec: ChainSpec, weight_bytes: int, kind: LayerKind | None = None) -> int:
    """Bytes of one layer's frozen linear weights (the biases excluded): each weight in the
    weight_format, or at `weight_bytes` per value when none is given."""
    fmt = spec.finetune.weight_format
    return sum(
        fan_in * fan_out * weight_bytes
        if fmt is None
        else quantized_weight_bytes(fan_in, fan_out, fmt)
        for fan_in, fan_out in linear_shapes(spec, kind).values()
    )


def linear_weight_parameters(spec: ChainSpec, kind: LayerKind | None = None) -> int:
    """Values of one layer's linear weights (biases excluded)."""
    return sum(fan_in * fan_out for fan_in, fan_out in linear_shapes(spec, kind).values())


def dequantize_4bit_bytes(fan_in: int, fan_out: int, weight_format: str) -> int:
    """HBM bytes one dequantisation of a 4-bit (fan_in x fan_out) weight moves: it reads the
    packed values and their double-quantised statistics (`quantized_weight_bytes`) and writes
    the weight in the 2-byte compute dtype. bitsandbytes 0.45.5 bitsandbytes/autograd/
    _functions.py, `MatMul4Bit`: forward `F.linear(A, F.dequantize_4bit(B, quant_state)
    .to(A.dtype).t(), bias)`, backward `torch.matmul(grad_output, F.dequantize_4bit(B,
    ctx.state).to(grad_output.dtype).t())`; `dequantize_4bit` (functional.py) first expands the
    nested absmax (`dequantize_blockwise`), then writes the weight in `quant_state.dtype`, the
    compute dtype (`.to` is then no copy). derived: the bytes each kernel reads and writes."""
    return quantized_weight_bytes(fan_in, fan_out, weight_format) + HALF_BYTES * fan_in * fan_out


def bitsandbytes_keeps_input(spec: ChainSpec) -> bool:
    """Whether the frozen linears' bitsandbytes matmul holds each input in `ctx.tensors`, a
    Python attribute of its autograd node: MatMul8bitLt in every release (int8 weights),
    MatMul4Bit before 0.43.2 (`matmul_4bit_keeps_input`)."""
    fmt = spec.finetune.weight_format
    if fmt == "int8":
        return True
    return fmt in ("nf4", "fp4") and matmul_4bit_keeps_input(spec.finetune.bitsandbytes_version)


def held_through_checkpoint_bytes(ops: tuple[Op, ...], spec: ChainSpec) -> int:
    """Bytes of one layer that `bitsandbytes_keeps_input`'s matmuls hold on their autograd
    nodes (the frozen linear ops' saved bytes, `frozen_ops`: each op's input, and an int8
    op's column-wise copies before 0.45.0); 0 where bitsandbytes keeps none. Non-reentrant
    checkpointing (torch.utils.checkpoint with use_reentrant=False) drops what autograd saves
    through its saved-tensor hooks, not a node's Python attributes, so a recomputed layer
    keeps these from its forward to its backward; reentrant checkpointing runs the first
    forward without a graph and keeps them only inside the recomputation. Checked on the CPU
    with bitsandbytes 0.45.5's and 0.50.1's own MatMul8bitLt
    (validation/bitsandbytes_matmul8bit_input.py)."""
    if spec.training == "full" or not bitsandbytes_keeps_input(spec):
        return 0
    return sum(op.saved_bytes for op in ops if op.name in FROZEN_LINEARS and op.matmul)


def frozen_ops(
    ops: tuple[Op, ...], spec: ChainSpec, kind: LayerKind | None = None
) -> tuple[Op, ...]:
    """The op table with the base weights frozen, and LoRA's ops after the linears they adapt
    (an op post-pass, like `ops.fp8_saved`, so that every strategy, breakdown and chain reads
    the same table). derived:

    - A frozen linear saves its input only where another user saves the same storage: a LoRA
      adapter without dropout on it (one storage, counted once with the linear), or, for
      out_proj beside flash attention, the attention output O that the kernel saves anyway.
      Its backward is the input-gradient GEMM alone (backward FLOPs = forward FLOPs) and it
      has no bias gradient to sum.
    - QLoRA: its backward dequantises the (largest) weight of the op to the activation dtype,
      a temporary beside its gradients; its forward and its backward each move every 4-bit
      weight's dequantisation (`dequantize_4bit_bytes`) as memory-bound bytes, which a
      re-forward repeats. Under bitsandbytes before 0.43.2 a 4-bit linear keeps
      its input until its backward (`matmul_4bit_keeps_input`), whoever else saves it: one
      input per op, since the projections an op holds read the same tensor (q, k and v the
      normed x, gate and up the normed x).
    - LLM.int8() (weight_format int8): bitsandbytes' MatMul8bitLt keeps its input until its
      backward in every release (`ctx.tensors = (CAt, subA, A)`), before 0.45.0 with a
      column-wise int8 copy of it per linear (`int8_transposed_input_bytes`); its forward
      moves the input's casts, outlier search and quantisation and the output's dequantisation
      (`int8_forward_bytes`), its backward the weight's dequantisation
      (`dequantize_8bit_bytes`), as memory-bound bytes. The int8 GEMM is timed as the op's
      GEMM at the GPU's BF16 rate, and the outlier columns' fp16 product is not counted.
    - `{site}_lora`, one op per adapted linear: per adapter A's r-wide output (B's input); with
      lora_dropout, per adapter the dropout output A saves and its 1-byte mask (CUDA's
      native_dropout); FLOPs 2·tokens·r·(in + out) forward, twice that backward (both
      adapters train and pass dX on). Its backward reads the linear's output gradient (counted
      with the linear) and holds, for one adapter at a time, the gradients of the scaled
      product (out), of A's output (r) and of its input (in, twice with dropout) until they
      are added to the linear's input gradient: workspace.
    - A mixture of experts' frozen GEMMs (`FROZEN_MOE_GEMMS`): each backward the input-gradient
      GEMM alone. The router saves no input (the normed x: no adapter reads it, the spec
      keeps them on the attention), the experts' fc1 and fc2 save nothing (the dispatched
      rows and the activation's output), the shared experts' gate keeps what its product
      saves.
    """
    finetune = spec.finetune
    if finetune.training == "full":
        return ops
    B = spec.dtype_bytes
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    rank = finetune.lora_rank
    dropout = finetune.lora_dropout > 0
    by_site: dict[str, list[Adapter]] = {}
    for adapter in adapters(spec, kind):
        by_site.setdefault(adapter.site, []).append(adapter)
    shapes = linear_shapes(spec, kind)
    sites = site_of(spec, kind)
    site_weights: dict[str, int] = {}
    # quantised weights: the bytes their kernels move beside the GEMMs, forward and backward,
    # and what an int8 linear keeps beyond its input
    moved_forward: dict[str, int] = {}
    moved_backward: dict[str, int] = {}
    kept: dict[str, int] = {}
    four_bit = finetune.weight_format in ("nf4", "fp4")
    eight_bit = finetune.weight_format == "int8"
    keeps_transposed = eight_bit and matmul_8bit_keeps_transposed_input(
        finetune.bitsandbytes_version
    )
    for name, (fan_in, fan_out) in shapes.items():
        site = sites[name]
        site_weights[site] = max(site_weights.get(site, 0), fan_in * fan_out)
        forward = backward = extra = 0
        if four_bit:
            forward = backward = dequantize_4bit_bytes(fan_in, fan_out, finetune.weight_format)
        if eight_bit:
            fp16 = spec.precision == "fp16"
            forward = int8_forward_bytes(tokens, fan_in, fan_out, B, fp16)
            backward = dequantize_8bit_bytes(fan_in, fan_out, B)
            extra = int8_transposed_input_bytes(tokens, fan_in) if keeps_transposed else 0
        moved_forward[site] = moved_forward.get(site, 0) + forward
        moved_backward[site] = moved_backward.get(site, 0) + backward
        kept[site] = kept.get(site, 0) + extra
    quantized = finetune.weight_format in ("nf4", "fp4", "int8")
    kept_by_bitsandbytes = bitsandbytes_keeps_input(spec)
    out: list[Op] = []
    for op in ops:
        if op.name in FROZEN_MOE_GEMMS:
            out.append(_frozen_moe_gemm(op))
            continue
        if op.name not in FROZEN_LINEARS or op.matmul is None:
            out.append(op)
            continue
        site = by_site.get(op.name, [])
        keeps_input = (
            (bool(site) and not dropout)
            or (op.name == "out_proj" and op.saved_until is not None)
            or kept_by_bitsandbytes
        )
        dequantized = HALF_BYTES * site_weights[op.name] if quantized else 0
        out.append(
            dataclasses.replace(
                op,
                saved_bytes=(op.saved_bytes if keeps_input else 0) + kept.get(op.name, 0),
                backward_flops=op.forward_flops,
                forward_bytes=op.forward_bytes + moved_forward.get(op.name, 0),
                backward_bytes=moved_backward.get(op.name, 0),
                grad_workspace_bytes=op.grad_workspace_bytes + dequantized,
            )
        )
        if site:
            dora = finetune.use_dora
            out.append(lora_op(op, site, B, tokens, rank, dropout, dora, quantized))
    return tuple(out)


def _frozen_moe_gemm(op: Op) -> Op:
    """One of `FROZEN_MOE_GEMMS` with its weight frozen (`frozen_ops`): the input-gradient
    GEMM alone in backward; the router and the experts save no input, the shared gate keeps
    what its product saves."""
    saved = 0 if op.name in ("router", "expert_fc1", "expert_fc2") else op.saved_bytes
    return dataclasses.replace(op, saved_bytes=saved, backward_flops=op.forward_flops)


def lora_op(
    base: Op,
    site: list[Adapter],
    B: int,
    tokens: int,
    rank: int,
    dropout: bool,
    dora: bool = False,
    quantized: bool = False,
) -> Op:
    """The adapters beside one linear op (`frozen_ops`). Moves (derived): per adapter, forward
    reads x and writes the dropout output and mask (with dropout), reads and writes the
    out-wide product for the scaling and adds it to the linear's output (read two, write one);
    backward reads dY and writes the scaled gradient, with dropout reads the mask and the
    gradient and writes dX, and adds dX to the linear's input gradient (read two, write one).
    With DoRA, `dora_terms` adds its own."""
    saved = flops = backward_flops = forward_moved = backward_moved = workspace = 0
    for adapter in site:
        fan_in, fan_out = adapter.fan_in, adapter.fan_out
        adapter_flops = matmul_flops(tokens, rank, fan_in) + matmul_flops(tokens, fan_out, rank)
        saved += B * tokens * rank
        flops += adapter_flops
        backward_flops += 2 * adapter_flops
        forward_moved += 5 * B * tokens * fan_out
        backward_moved += 2 * B * tokens * fan_out + 3 * B * tokens * fan_in
        if dropout:
            saved += (B + MASK_BYTES) * tokens * fan_in
            forward_moved += (2 * B + MASK_BYTES) * tokens * fan_in
            backward_moved += (2 * B + MASK_BYTES) * tokens * fan_in
        in_grads = (2 if dropout else 1) * fan_in
        adapter_workspace = B * tokens * (fan_out + rank + in_grads)
        if dora:
            terms = dora_terms(adapter, B, tokens, rank, dropout, quantized)
            saved += terms.saved
            flops += terms.forward_flops
            backward_flops += terms.backward_flops
            forward_moved += terms.forward_bytes
            backward_moved += terms.backward_bytes
            adapter_workspace = max(adapter_workspace + terms.backward_workspace, terms.transient)
        workspace = max(workspace, adapter_workspace)
    return Op(
        f"{base.name}_lora",
        base.component,
        saved,
        flops,
        backward_flops,
        base.group,
        grad_workspace_bytes=workspace,
        forward_bytes=forward_moved,
        backward_bytes=backward_moved,
    )


@dataclass(frozen=True)
class DoraTerms:
    """What DoRA adds to one adapter (`dora_terms`)."""

    saved: int
    forward_flops: int
    backward_flops: int
    forward_bytes: int
    backward_bytes: int
    backward_workspace: int  # beside LoRA's, in the adapter's backward
    transient: int  # the weight norm's tensors, alive in each forward (and recomputation)


def dora_terms(
    adapter: Adapter, B: int, tokens: int, rank: int, dropout: bool, quantized: bool = False
) -> DoraTerms:
    """DoRA's additions to one adapter: PEFT's `DoraLinearLayer.forward` (peft v0.21.2,
    src/peft/tuners/lora/dora.py), checked against autograd in tests/test_finetune_torch.py.
    derived:

    - saved: the base output and B's output, B·tokens·out each (the multiplies by m/‖·‖ - 1
      and m/‖·‖ save their tensor operands), and three out-long vectors: the detached norm
      (the division's divisor, for m's gradient), m/‖·‖ - 1 and m/‖·‖, 3·B·out. The graph of
      lora_B(lora_A(eye(in))) is dropped by the detach: nothing of it is kept.
    - FLOPs: forward, B·A as lora_B(lora_A(eye)), 2·in·in·r + 2·in·r·out, and with dropout the
      base GEMM again on the dropped input, 2·tokens·in·out, whose backward is one input-
      gradient GEMM (the weight is frozen). The element-wise work is counted as moves.
    - moves: forward writes eye (in²) and B·A (in·out), reads them back, forms W + s·B·A and
      its norm (reads W, B·A, the scaled copy and the sum; writes the scaled copy and the sum:
      6·in·out), and per token four multiplies and one more add over out (read two or one,
      write one: 2 + 2 + 2 + 3 + 3 = 12 per value against LoRA's 5: 7·out more); backward
      reads dY twice for the two products' gradients and their saved operands, writes both
      (6·out per token), and the magnitude's gradient sums over tokens (read 2·out).
    - backward workspace: the two out-wide products of the magnitude's gradient and the base
      output's scaled gradient, 2·B·tokens·out.
    - transient: eye(in), A(eye) (in·r), B·A, its scaled copy and the sum (in·out each), alive
      together while the norm is taken: B·(in² + in·r + 3·in·out); over a quantised weight
      (QLoRA) also its dequantised copy (`dequantize_module_weight`), B·in·out more.
    """
    fan_in, fan_out = adapter.fan_in, adapter.fan_out
    lora_weight = matmul_flops(fan_in, rank, fan_in) + matmul_flops(fan_in, fan_out, rank)
    base_again = matmul_flops(tokens, fan_out, fan_in) if dropout else 0
    return DoraTerms(
        saved=2 * B * tokens * fan_out + 3 * B * fan_out,
        forward_flops=lora_weight + base_again,
        backward_flops=base_again,
        forward_bytes=B * (2 * fan_in * fan_in + 2 * fan_in * fan_out + 6 * fan_in * fan_out)
        + 7 * B * tokens * fan_out,
        backward_bytes=8 * B * tokens * fan_out,
        backward_workspace=2 * B * tokens * fan_out,
        transient=B
        * (fan_in * fan_in + fan_in * rank + (4 if quantized else 3) * fan_in * fan_out),
    )
