"""The fp32 scales of Transformer Engine's Float8BlockScaling (`fp8_recipe: blockwise`).

Float8BlockScaling is DeepSeek-V3's fine-grained FP8 scheme (arXiv 2412.19437 §3.3.2: 1x128
activation tiles, 128x128 weight blocks) as Transformer Engine runs it: "Float8BlockScaling
recipe enables block scaling with FP8 as described in DeepSeek-v3 paper" (NVIDIA/
TransformerEngine v2.9 docs/examples/fp8_primer.ipynb). Its recipe scales activations and
gradients in 1-D blocks (`x_block_scaling_dim = 1`, `grad_block_scaling_dim = 1`) and weights in
2-D blocks (`w_block_scaling_dim = 2`) of `FP8_BLOCK` values, one fp32 scale each
(transformer_engine/common/recipe/__init__.py, v2.9), and writes the row-wise copy and the
column-wise (transposed) one each from the BF16 tensor ("both versions are computed from the high
precision input to avoid double quantization errors").

Each copy's scale tensor has the shape `Float8BlockQuantizer.get_scale_shape` gives it
(transformer_engine/pytorch/tensor/float8_blockwise_tensor.py, v2.9), for a (rows, cols) tensor:

- 1-D, GEMM-ready (what the GEMMs read): row-wise (ceil(cols/128), roundup4(rows)), column-wise
  (ceil(rows/128), roundup4(cols)) ("CuBLAS requries 1x128 scaling factor to be padded and
  transposed");
- 1-D, compact (`all_gather_usage`: the sequence-parallel all-gathers' format): row-wise
  (rows, ceil(cols/128)), column-wise (ceil(rows/128), cols), unpadded;
- 2-D (the weights): row-wise (ceil(rows/128), roundup4(ceil(cols/128))), column-wise
  (ceil(cols/128), roundup4(ceil(rows/128))).
"""

from __future__ import annotations

FP8_BLOCK = 128  # Float8BlockQuantizer.block_len
FP8_BLOCK_SCALE_BYTES = 4  # torch.float32 scale_inv
FP8_BLOCK_SCALE_PAD = 4  # the GEMM-ready inner dimension's multiple (round_up_to_nearest_multiple)
SCALE_USAGES = ("rowwise", "columnwise")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(value: int, multiple: int) -> int:
    return _ceil(value, multiple) * multiple


def block_scale_bytes_1d(rows: int, cols: int, usage: str, compact: bool = False) -> int:
    """Bytes of the fp32 scales of one copy (`usage` "rowwise" or "columnwise") of a (rows,
    cols) tensor in 1x128 blocks: one scale per 128 values along its rows (row-wise) or its
    columns (column-wise), the GEMM-ready shape padded to 4 in its inner dimension, the
    compact one not (module docstring; TE v2.9 `Float8BlockQuantizer.get_scale_shape`)."""
    if usage == "rowwise":
        outer, inner = _ceil(cols, FP8_BLOCK), rows
    else:
        outer, inner = _ceil(rows, FP8_BLOCK), cols
    if not compact:
        inner = _round_up(inner, FP8_BLOCK_SCALE_PAD)
    return FP8_BLOCK_SCALE_BYTES * outer * inner


def block_scale_bytes_2d(rows: int, cols: int, usage: str) -> int:
    """Bytes of the fp32 scales of one copy of a (rows, cols) weight in 128x128 blocks (module
    docstring; TE v2.9 `Float8BlockQuantizer.get_scale_shape` with block_scaling_dim 2)."""
    row_blocks, col_blocks = _ceil(rows, FP8_BLOCK), _ceil(cols, FP8_BLOCK)
    if usage == "rowwise":
        return FP8_BLOCK_SCALE_BYTES * row_blocks * _round_up(col_blocks, FP8_BLOCK_SCALE_PAD)
    return FP8_BLOCK_SCALE_BYTES * col_blocks * _round_up(row_blocks, FP8_BLOCK_SCALE_PAD)


def saved_input_scale_bytes(rows: int, cols: int, groups: int = 1, compact: bool = False) -> int:
    """Bytes of the scales an FP8 linear keeps for backward with its input under blockwise
    scaling: the column-wise copy's, the row-wise copy (data and scales) dropped after the
    forward GEMM (TE v2.9 module/linear.py and layernorm_linear.py: `inputmat.update_usage(
    rowwise_usage=False, columnwise_usage=True)`, "Discard row-wise data since it is not needed
    in backward pass"; `Float8BlockQuantizer` keeps the base class's
    `supports_only_rowwise_all_gather` False, so the sequence-parallel branch drops it too;
    layernorm_linear.py: `isinstance(ln_out, (MXFP8TensorStorage,
    Float8BlockwiseQTensorStorage))` -> `ln_out.update_usage(rowwise_usage=False)`),
    of a (rows, cols) input split into `groups` equal row groups, each quantized on its own
    (module/grouped_linear.py's per-expert inputs); `compact` under a sequence-parallel
    column-parallel layer, whose input quantizer writes the all-gather format
    (`_customize_quantizers_float8_blockwise_scaling`: `all_gather_usage = True`)."""
    return groups * block_scale_bytes_1d(rows // groups, cols, "columnwise", compact)


def weight_block_scale_bytes(out_features: int, in_features: int) -> int:
    """Bytes of the fp32 scales that one FP8 weight of shape (out_features, in_features)
    carries under block scaling, row-wise and column-wise copy together: TE v2.9
    `Float8BlockQuantizer.make_empty` (tensor/float8_blockwise_tensor.py) allocates
    `scale_inv` of `get_scale_shape(shape, columnwise=False)` with the row-wise data and
    `columnwise_scale_inv` of `get_scale_shape(shape, columnwise=True)` with the column-wise
    data, both fp32, the weight quantizer's `block_scaling_dim` 2 (`block_scale_bytes_2d`).
    The 2-D block count rounds up per matrix and the inner dimension to 4 blocks: a
    (4096, 14336) weight has 32 x 112 blocks, row-wise scales (32, 112) and column-wise
    (112, 32), 28,672 bytes; a (576, 7168) one 5 x 56, row-wise (5, 56) and column-wise
    (56, roundup4(5) = 8), 2,912 bytes."""
    rowwise = block_scale_bytes_2d(out_features, in_features, "rowwise")
    return rowwise + block_scale_bytes_2d(out_features, in_features, "columnwise")


def weight_block_amaxes(out_features: int, in_features: int) -> int:
    """Amaxes that the FP8 primary weights' cast computes and all-reduces for one (out_features,
    in_features) weight under block scaling: TE v2.9 tensor/utils.py
    `_cast_master_weights_to_fp8_blockwise_scaling`, `scale_shape = model_weight.
    _get_quantizer().get_scale_shape(model_weight.shape, False)`, `num_amaxes =
    scale_shape[0] * scale_shape[1]`: the row-wise 2-D scale shape's elements, its padding to
    4 blocks included (`block_scale_bytes_2d` over its 4 bytes a scale)."""
    return block_scale_bytes_2d(out_features, in_features, "rowwise") // FP8_BLOCK_SCALE_BYTES
