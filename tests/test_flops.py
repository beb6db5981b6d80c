"""FLOPs against Korthikanti et al. 2022 App. A."""

import pytest

from ckplan.model.flops import (
    attention_core_fraction,
    group_forward_flops,
    layer_backward_flops,
    layer_forward_flops,
    logits_forward_flops,
    model_flops_per_iteration,
)
from ckplan.model.op import ATTENTION_CORE

GPT_PRESETS = [
    "gpt2",
    "gpt2-xl",
    "gpt3-175b",
    "megatron-22b",
    "megatron-175b",
    "megatron-530b",
    "megatron-1t",
]


@pytest.mark.parametrize("name", GPT_PRESETS)
def test_model_flops_72_bslh2(spec_of, name):
    """72·B·s·l·h²·(1 + s/6h + V/12hl) = 72Bslh² + 12Bs²lh + 6BshV, exactly, B = 4 sequences."""
    spec = spec_of(name)
    B, s, L, h, V = 4, spec.seq, spec.layers, spec.hidden, spec.vocab
    expected = 72 * B * s * L * h**2 + 12 * B * s**2 * L * h + 6 * B * s * h * V
    assert model_flops_per_iteration(spec, B) == expected


def test_layer_flops_mha_and_gqa_swiglu(spec_of):
    gpt = spec_of("gpt3-175b")
    s, b, h = gpt.seq, gpt.micro_batch, gpt.hidden
    assert layer_forward_flops(gpt) == 24 * s * b * h**2 + 4 * b * s**2 * h
    assert layer_backward_flops(gpt) == 2 * layer_forward_flops(gpt)
    llama = spec_of("llama3-8b", attention="standard")
    s, b, h, F, gd = llama.seq, llama.micro_batch, llama.hidden, llama.ffn_hidden, 8 * 128
    expected = (
        2 * s * b * h * (h + 2 * gd) + 4 * b * s**2 * h + 2 * s * b * h**2 + 6 * s * b * h * F
    )
    assert layer_forward_flops(llama) == expected


def test_flash_backward_recomputes_scores(spec_of):
    """Flash attention's backward recomputes QKᵀ: 2 x forward + 2bs²h (Dao et al. 2022, Alg. 4)."""
    flash = spec_of("llama3-8b")
    standard = spec_of("llama3-8b", attention="standard")
    s, b, h = flash.seq, flash.micro_batch, flash.hidden
    assert layer_forward_flops(flash) == layer_forward_flops(standard)
    assert layer_backward_flops(flash) == 2 * layer_forward_flops(flash) + 2 * b * s**2 * h


def test_attention_core_fraction_is_s_over_6h_plus_s(spec_of):
    spec = spec_of("seed")  # s = h = 8192, F = 4h
    assert (
        group_forward_flops(spec, ATTENTION_CORE)
        == 4 * spec.micro_batch * spec.seq**2 * spec.hidden
    )
    assert attention_core_fraction(spec) == pytest.approx(spec.seq / (6 * spec.hidden + spec.seq))
    assert attention_core_fraction(spec) == pytest.approx(1 / 7)


def test_tensor_parallel_divides_flops(spec_of):
    spec = spec_of("megatron-22b")
    whole = spec.replace(tp=1, sp=False)
    assert layer_forward_flops(spec) * spec.tp == layer_forward_flops(whole)
    assert logits_forward_flops(spec) * spec.tp == logits_forward_flops(whole)
