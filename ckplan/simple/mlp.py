"""The NumPy MLP `ckplan verify` runs (`kind: mlp`): its op table, its exact workspaces and its
parameters, as one more kind of layer beside the transformer's.

A stack of L layers relu(x @ w1 + b1) @ w2 + b2 (width d = hidden, inner width f = ffn_hidden, b
rows = micro_batch), run for real by `ckplan.simple.verify`, so that every plan's predicted
peak, layer forwards and FLOPs can be measured. The model's functions ask this module for what
differs from a transformer layer; everything else (chains, schedules, plans) is shared.
"""

from __future__ import annotations

from ckplan.model.op import Matmul, Op, matmul_flops
from ckplan.model.spec import ChainSpec


def input_bytes(spec: ChainSpec) -> int:
    """A layer's input and output, (b, d)."""
    return spec.dtype_bytes * spec.micro_batch * spec.hidden


def layer_parameters(spec: ChainSpec) -> int:
    """w1, b1, w2, b2."""
    h, f = spec.hidden, spec.ffn_hidden
    return h * f + f + f * h + h


def layer_ops(spec: ChainSpec) -> tuple[Op, ...]:
    """One layer: relu(x @ w1 + b1) @ w2 + b2, width d = hidden, f = ffn_hidden, rows =
    micro_batch.

    The executor keeps only each layer's input and rebuilds the hidden activation in the
    backward pass (its backward recomputes x_in @ w1 + b1), so fc1 saves its input
    and nothing else is kept; fc1's backward costs one extra forward matmul (derived: gx = g_pre
    @ w1ᵀ and gw1 = x_inᵀ @ g_pre, plus the re-run of x_in @ w1).
    """
    B, rows, d, f = spec.dtype_bytes, spec.micro_batch, spec.hidden, spec.ffn_hidden
    fc1_flops = matmul_flops(rows, f, d)
    fc2_flops = matmul_flops(rows, d, f)
    hidden, out = B * rows * f, B * rows * d  # (b, f) and (b, d) arrays, bytes
    # Bytes moved, as simple/verify.py runs the layer: forward `a += b1` (read, write a),
    # relu in place (read, write a), `y += b2` (read, write y). Backward: the re-run fc1 with
    # its bias add and relu, gb2 = Σ g (read g), the 0/1 mask in place (read, write a),
    # gh *= mask (read two, write one), gb1 = Σ gh (read gh).
    return (
        Op(
            "fc1",
            "mlp",
            B * rows * d,
            fc1_flops,
            3 * fc1_flops,
            matmul=Matmul(rows, f, d, 1, B),
            forward_bytes=2 * hidden,
            backward_bytes=2 * hidden + 3 * hidden + hidden,
        ),
        Op("act", "mlp", 0, 0, 0, forward_bytes=2 * hidden, backward_bytes=2 * hidden + 2 * hidden),
        Op(
            "fc2",
            "mlp",
            0,
            fc2_flops,
            2 * fc2_flops,
            matmul=Matmul(rows, d, f, 1, B),
            forward_bytes=2 * out,
            backward_bytes=out,
        ),
    )


def forward_workspace_bytes(spec: ChainSpec) -> int:
    """Transient bytes of one layer forward of the NumPy MLP beyond its input and output.

    derived from simple/verify.py's layer forward (in place):
    ``a = x @ w1`` (b, f); ``a += b1``; ``relu(a)`` in place; ``y = a @ w2`` (b, d); ``y += b2``.
    Alive at once: the hidden activation ``a``, b·f values, and the output ``y`` (counted by the
    chain as x_{i+1}). So the workspace is b·f·B.
    """
    return spec.dtype_bytes * spec.micro_batch * spec.ffn_hidden


def backward_workspace_bytes(spec: ChainSpec) -> int:
    """Transient bytes of one layer backward of the NumPy MLP beyond tape x_i, δ_{i+1}, δ_i.

    derived from simple/verify.py's layer backward (in place; weight
    and bias gradients go into preallocated buffers, not counted here). In order:
    ``a = x @ w1 + b1``, relu in place (b, f); ``gw2 = aᵀ @ g``; ``gb2 = Σ g``; ``a`` turned in
    place into the 0/1 mask ``(h_pre > 0)``; ``gh = g @ w2ᵀ`` (b, f) — now ``a`` and ``gh`` are
    alive, 2·b·f values; ``gh *= a`` (the pre-activation gradient); ``a`` freed; ``δ_i = gh @ w1ᵀ``
    (b, d) — now ``gh`` and ``δ_i``, b·f + b·d; ``gw1 = xᵀ @ gh``, ``gb1 = Σ gh``; ``gh`` freed.
    The peak is max(2·b·f, b·f + b·d) values; the chain adds δ_i (b·d) to every backward step
    (schedules rule 5), so the workspace is B·b·(max(2f, f + d) - d) = B·b·max(2f - d, f).
    """
    b, d, f = spec.micro_batch, spec.hidden, spec.ffn_hidden
    return spec.dtype_bytes * b * max(2 * f - d, f)
