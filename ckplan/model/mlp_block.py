"""The MLP block's ops: fc1, its activation and fc2 of a dense MLP, shared by the dense layers
(`ckplan.model.ops`) and the shared experts of a mixture of experts (`ckplan.model.moe`)."""

from __future__ import annotations

from ckplan.model.op import (
    DENSE_MLP,
    LayerShapes,
    Op,
    column_parallel_saved_input_bytes,
    make_op,
    matmul_flops,
)
from ckplan.model.spec import ChainSpec


def dense_mlp_ops(spec: ChainSpec, shapes: LayerShapes, out_grad: int) -> list[Op]:
    """fc1, its activation and fc2 of a dense MLP (or of shared experts: `moe.py`), in the
    DENSE_MLP recompute group."""
    return mlp_block_ops(spec, shapes, spec.ffn_hidden, out_grad, prefix="", group=DENSE_MLP)


def mlp_block_ops(
    spec: ChainSpec,
    shapes: LayerShapes,
    ffn: int,
    out_grad: int,
    prefix: str,
    *,
    input_saved: bool = True,
    input_grad: bool = True,
    group: str | None = None,
) -> list[Op]:
    """A TP-split MLP of width `ffn` over the layer's tokens; op names get `prefix`.

    `input_saved` False: fc1's input is a storage another op saves already (the shared experts
    read the router's input); `input_grad` False: fc1's input gradient is added in place into
    a gradient another op allocates (counted as workspace).
    """
    B, X, tokens = shapes.B, shapes.X, shapes.tokens
    sharded = shapes.sharded
    ffn_elems = sharded(tokens * ffn)  # (s, b, F) elements per rank
    fc1_in = column_parallel_saved_input_bytes(spec, shapes) if input_saved else 0
    in_grads = (X, 0) if input_grad else (0, X)  # (input grad, workspace)
    # The dense MLP's fc2 output meets the residual stream: its add, unless the bias-dropout-add
    # of mlp_dropout does it; biases' gradients sum the output gradients.
    residual = shapes.residual_add if (prefix == "" and spec.dropout == 0) else 0
    bias = B if spec.bias else 0
    ops: list[Op] = []
    if spec.mlp == "gelu":
        ops.append(
            make_op(
                f"{prefix}fc1",
                "mlp",
                fc1_in,
                matmul_flops(tokens, sharded(ffn), spec.hidden),
                group,
                grads=(B * ffn_elems, in_grads[0]),
                workspace=in_grads[1],
                matmul=shapes.linear(tokens, sharded(ffn), spec.hidden),
                moved=(0, bias * ffn_elems),
                tp_comm="column",
            )
        )
        # GELU saves its input; gelu_backward(dY, x) is one element-wise kernel: one new tensor.
        # Moves: reads x, writes y (Megatron's fused bias-GELU); backward reads dY and x.
        ops.append(
            make_op(
                f"{prefix}act",
                "mlp",
                B * ffn_elems,
                0,
                group,
                grads=(B * ffn_elems,) * 2,
                moved=(2 * B * ffn_elems, 3 * B * ffn_elems),
            )
        )
    else:
        # SwiGLU / GeGLU (Shazeer 2020): fc1 computes gate and up (2F wide). A fused kernel
        # (Megatron's bias_swiglu) saves the fc1 output, 2F; eager silu(gate) * up also keeps
        # silu(gate), 3F. Eager code runs fc1 as two linears (HF gate_proj, up_proj): the
        # first's output gradient (F) is freed before the second's input gradient is allocated,
        # so the backward never holds more than d gate, d up and one input gradient either.
        ops.append(
            make_op(
                f"{prefix}fc1",
                "mlp",
                fc1_in,
                matmul_flops(tokens, sharded(2 * ffn), spec.hidden),
                group,
                grads=(2 * B * ffn_elems, in_grads[0]),
                workspace=in_grads[1],
                matmul=shapes.linear(tokens, sharded(2 * ffn), spec.hidden),
                moved=(0, bias * 2 * ffn_elems),
                tp_comm="column",
            )
        )
        # Backward: d gate and d up, 2F, from dY, F. Fused (Megatron's swiglu_back): one kernel
        # writing [d gate | d up]. Eager: MulBackward writes d silu(gate) and d up, then
        # SiluBackward d gate while dY is already freed: never more than 3F either.
        # Moves, fused: reads gate and up, writes y; backward reads dY, gate and up, writes
        # d gate and d up. Eager: silu(gate) (2F), the product (3F); backward 3F + 2F + 3F.
        swiglu_moved = (
            (3 * B * ffn_elems, 5 * B * ffn_elems)
            if spec.fused_swiglu
            else (5 * B * ffn_elems, 8 * B * ffn_elems)
        )
        ops.append(
            make_op(
                f"{prefix}act",
                "mlp",
                B * ffn_elems * (2 if spec.fused_swiglu else 3),
                0,
                group,
                grads=(B * ffn_elems, 2 * B * ffn_elems),
                moved=swiglu_moved,
            )
        )
    # Saves its input; its output gradient is the residual-stream gradient (no dropout) or the
    # gradient the op after it allocates.
    ops.append(
        make_op(
            f"{prefix}fc2",
            "mlp",
            B * ffn_elems,
            matmul_flops(tokens, spec.hidden, sharded(ffn)),
            group,
            grads=(out_grad, B * ffn_elems),
            matmul=shapes.linear(tokens, spec.hidden, sharded(ffn)),  # reduce-scattered under SP
            moved=(residual, bias * shapes.stream),
            tp_comm="row",
        )
    )
    return ops
