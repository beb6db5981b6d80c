"""What a layer's backward holds beyond its tape: the walk over the ops, by hand.

Notation: S = sbh and A = as²b (values), B = 2, so one (s, b, h) bf16 tensor is X = 2S bytes.
In the walk, live(op) = saved tensors not yet freed (the op's own included) + residual-stream
gradients (δ_out; after norm2 also the mid-layer gradient that becomes δ_in) + gradients waiting
for an earlier op (the op's output gradient among them) + the op's input gradients + its
temporaries.
"""

import pytest

from ckplan.model.loss import (
    output_backward_peak_bytes,
    output_backward_workspace_bytes,
    output_saved_bytes,
)
from ckplan.model.memory import (
    activation_bytes_per_layer,
    layer_backward_peak_bytes,
    layer_backward_walk,
    layer_backward_workspace_bytes,
    layer_input_bytes,
    selective_activation_bytes_per_layer,
)
from ckplan.model.op import ATTENTION_CORE
from ckplan.model.spec import spec_from_mapping
from ckplan.plan import layer_chain
from ckplan.simple import mlp as numpy_mlp


def korthikanti(spec_of, **overrides):
    """Korthikanti's GPT layer on one GPU: B = 2, F = 4h, dropout, standard attention, a = g."""
    return spec_of("megatron-22b", tp=1, sp=False, pp=1, **overrides)


def korthikanti_walk(spec):
    """The walk written out, in backward order, T = 34S + 5A (each line: saved, then grads)."""
    s, b, h, a = spec.seq, spec.micro_batch, spec.hidden, spec.heads
    S, A = s * b * h, a * s * s * b
    T = 34 * S + 5 * A
    return {
        # everything saved; δ_out; dropout's input gradient
        "mlp_dropout": T + 2 * S + 2 * S,
        # its 1-byte mask freed; δ_out; waiting: mlp_dropout's; fc2's input gradient (s, b, 4h)
        "fc2": (T - S) + 2 * S + 2 * S + 8 * S,
        # fc2's input freed; δ_out; waiting: fc2's; GELU's input gradient
        "act": (T - 9 * S) + 2 * S + 8 * S + 8 * S,
        # GELU's input freed; δ_out; waiting: GELU's; fc1's input gradient
        "fc1": (T - 17 * S) + 2 * S + 8 * S + 2 * S,
        # fc1's input freed; δ_out; waiting: fc1's; norm2's input gradient
        "norm2": (T - 19 * S) + 2 * S + 2 * S + 2 * S,
        # norm2's input freed, its gradient added to δ_out into a new residual gradient
        "out_dropout": (T - 21 * S) + 4 * S + 2 * S,
        # out_dropout's mask freed; waiting: out_dropout's; the context gradient
        "out_proj": (T - 22 * S) + 4 * S + 2 * S + 2 * S,
        # out_proj's input freed; waiting: the context gradient; dP (b, a, s, s) and dV
        "attn_values": (T - 24 * S) + 4 * S + 2 * S + (2 * A + 2 * S),
        # the dropout output and V freed; waiting: dV, dP'; the dropout's input gradient
        "attn_dropout": (T - 26 * S - 2 * A) + 4 * S + (2 * S + 2 * A) + 2 * A,
        # the mask freed; waiting: dV, dP; the scores' gradient (torch's out-of-place softmax)
        "softmax": (T - 26 * S - 3 * A) + 4 * S + (2 * S + 2 * A) + 2 * A,
        # left: norm1's and qkv's inputs, Q and K; waiting: dV, dS; dQ and dK
        "attn_scores": 8 * S + 4 * S + (2 * S + 2 * A) + 4 * S,
        # left: norm1's and qkv's inputs; waiting: dQ, dK, dV; its input gradient; the
        # concatenated QKV-output gradient (workspace)
        "qkv_proj": 4 * S + 4 * S + 6 * S + 2 * S + 6 * S,
        # left: the layer input; waiting: qkv's input gradient; norm1's input gradient
        "norm1": 2 * S + 4 * S + 2 * S + 2 * S,
    }


@pytest.mark.parametrize("seq", [512, 2048])
def test_korthikanti_layer_walk(spec_of, seq):
    """as/h = 64·512/6144 = 5.3: the MLP peaks, at fc2's backward, T + 11S; as/h = 21.3 (the
    paper's s = 2048): the attention does, at attn_values', T - 16S + 2A (above T + 11S once
    as/h > 13.5). The chain counts T + 2X = T + 4S; the workspace is the rest."""
    spec = korthikanti(spec_of, seq=seq)
    expected = korthikanti_walk(spec)
    walk = layer_backward_walk(spec)
    assert [point.op for point in walk] == list(expected)
    assert {point.op: point.live_bytes for point in walk} == expected
    s, b, h, a = spec.seq, spec.micro_batch, spec.hidden, spec.heads
    S, A = s * b * h, a * s * s * b
    T = 34 * S + 5 * A
    assert activation_bytes_per_layer(spec) == T
    peak = max(T + 11 * S, T - 16 * S + 2 * A)
    assert peak == (T + 11 * S if seq == 512 else T - 16 * S + 2 * A)
    assert layer_backward_peak_bytes(spec) == peak
    assert layer_backward_workspace_bytes(spec) == peak - (T + 4 * S)


def test_korthikanti_selective_walk(spec_of):
    """Selective (T = 34S): the attention core is re-forwarded from its kept Q, K, V (6S) just
    before attn_values' backward. fc2: T + 11S as before; attn_values: 34S - 24S (left: norm1's
    and qkv's inputs, Q, K, V kept) + 6S + 5A (rebuilt) + 4S + 2S + 2A + 2S = 24S + 7A."""
    spec = korthikanti(spec_of)  # as/h = 21.3
    s, b, h, a = spec.seq, spec.micro_batch, spec.hidden, spec.heads
    S, A = s * b * h, a * s * s * b
    T = selective_activation_bytes_per_layer(spec, ATTENTION_CORE)
    assert T == 34 * S
    live = {p.op: p.live_bytes for p in layer_backward_walk(spec, ATTENTION_CORE)}
    assert live["fc2"] == T + 11 * S
    assert live["attn_values"] == 24 * S + 7 * A
    assert layer_backward_peak_bytes(spec, ATTENTION_CORE) == 24 * S + 7 * A
    assert layer_backward_workspace_bytes(spec, ATTENTION_CORE) == 24 * S + 7 * A - (T + 4 * S)


def test_llama_layer_walk(spec_of):
    """Llama-3-8B (flash attention, GQA g = a/4, fused SwiGLU, no dropout), one GPU. With
    F' = sbF and c = sb: tape T = 13S + 4ca (fp32 logsumexp) + 6F' (act 4F', fc2 2F').
    fc2: T + 2S (δ_out, its output gradient too) + 2F'; act: T - 2F' + 2S + 2F' (waiting) +
    4F' ([d gate | d up]) = T + 2S + 4F', the peak. attention_core: saved 9S + 4ca (norm1,
    qkv inputs, Q, K, V at 3S, logsumexp, O kept until here), grads 4S + 2S (dO) + 3S (dQ, dK,
    dV), workspace 4S (fp32 dQ accumulator) + 4ca (fp32 softmax_d) + 4S (dK, dV at a heads)."""
    spec = spec_of("llama3-8b", tp=1, pp=1)
    s, b, h, a, F = spec.seq, spec.micro_batch, spec.hidden, spec.heads, spec.ffn_hidden
    S, Fp, c = s * b * h, s * b * F, s * b
    assert spec.kv_heads * 4 == a and spec.fused_swiglu and spec.attention == "flash"
    T = 13 * S + 4 * c * a + 6 * Fp
    assert activation_bytes_per_layer(spec) == T
    expected = {
        "fc2": T + 2 * S + 2 * Fp,
        "act": T + 2 * S + 4 * Fp,
        "fc1": (T - 6 * Fp) + 2 * S + 4 * Fp + 2 * S,
        "norm2": (T - 6 * Fp - 2 * S) + 2 * S + 2 * S + 2 * S,
        "out_proj": (T - 6 * Fp - 4 * S) + 4 * S + 2 * S,
        "attention_core": (9 * S + 4 * c * a) + 9 * S + (4 * S + 4 * c * a + 4 * S),
        "qkv_proj": 4 * S + 4 * S + 3 * S + 2 * S + 3 * S,
        "norm1": 2 * S + 4 * S + 2 * S + 2 * S,
    }
    assert {p.op: p.live_bytes for p in layer_backward_walk(spec)} == expected
    assert layer_backward_peak_bytes(spec) == T + 2 * S + 4 * Fp
    # F = 3.5h: the workspace is 4F' - 2S = 12S, 403 MB at s = 8192.
    assert layer_backward_workspace_bytes(spec) == 4 * Fp - 2 * S == 12 * S


def test_output_stage_logits_gradient(spec_of):
    """Megatron's cross-entropy writes the logits' gradient into its saved fp32 softmax; autograd
    casts it to bf16, a new 2sbV/t, while the fp32 one is alive: tape + 2sbV/t. The chain
    counts tape + δ_in (X): the workspace is 2sbV/t - X. megatron-22b: t = 8 with SP."""
    spec = spec_of("megatron-22b")
    s, b, h, V, t = spec.seq, spec.micro_batch, spec.hidden, spec.vocab, spec.tp
    X = 2 * s * b * h // t
    tape = 2 * X + 4 * s * b * V // t
    assert output_saved_bytes(spec) == tape
    assert output_backward_peak_bytes(spec) == tape + 2 * s * b * V // t
    assert output_backward_workspace_bytes(spec) == 2 * s * b * V // t - X


def test_tensor_and_sequence_parallel_divide_every_term(spec_of):
    """Under TP + SP every tensor of the walk is split over t, so is the workspace."""
    one, eight = korthikanti(spec_of), spec_of("megatron-22b", pp=1)
    assert eight.tp == 8 and eight.sp
    assert layer_backward_workspace_bytes(eight) * 8 == layer_backward_workspace_bytes(one)


def test_chain_carries_the_workspaces(spec_of):
    """plans.layer_chain: 0 for the embedding, the layer workspace for every layer (the
    selective one with selective), the output stage's last."""
    spec = spec_of("llama3-8b")
    for selective in (False, True):
        chain = layer_chain(spec, selective)
        layer = layer_backward_workspace_bytes(spec, ATTENTION_CORE if selective else None)
        assert chain.backward_workspace_bytes == (
            0,
            *[layer] * spec.layers,
            output_backward_workspace_bytes(spec),
        )
    assert layer_backward_workspace_bytes(spec) > 0


def test_workspace_never_negative():
    """The workspace is what the walk's peak exceeds tape + 2X by, never below 0. A layer with a
    narrow MLP (F = h/2, no dropout) and short attention (as/h = 1/2), in X units: T = 8 + 1/2
    (the probabilities) + 2·1/2 = 9.5; fc2 holds T + 1 (δ_out) + 1/2 (its input gradient) =
    T + 1.5, qkv_proj 1 + 1 (inputs left) + 2 + 3 + 1 + 3 (the cat) = 11 = T + 1.5: below the
    chain's T + 2."""
    spec = spec_from_mapping(
        {
            "name": "narrow",
            "layers": 2,
            "hidden": 256,
            "heads": 2,
            "ffn_hidden": 128,
            "seq": 64,
            "micro_batch": 1,
            "vocab": 0,
        }
    )
    tape, X = activation_bytes_per_layer(spec), layer_input_bytes(spec)
    assert 2 * tape == 19 * X
    assert 2 * layer_backward_peak_bytes(spec) == 2 * tape + 3 * X
    assert layer_backward_workspace_bytes(spec) == 0


def test_seed_mlp_unchanged():
    """The NumPy MLP keeps its exact, verified workspace (ckplan verify), on every stage."""
    spec = spec_from_mapping(
        {
            "name": "m",
            "kind": "mlp",
            "layers": 4,
            "hidden": 64,
            "ffn_hidden": 256,
            "seq": 1,
            "micro_batch": 8,
            "dtype_bytes": 8,
        }
    )
    assert layer_backward_workspace_bytes(spec) == numpy_mlp.backward_workspace_bytes(spec)
    assert (
        layer_chain(spec, False).backward_workspace_bytes
        == (numpy_mlp.backward_workspace_bytes(spec),) * 4
    )
    with pytest.raises(ValueError):
        layer_backward_walk(spec)
