"""TiledMLP (Bekman et al. 2025, "Arctic Long Sequence Training", ALST; DeepSpeed's
`TiledMLP`, deepspeed/runtime/sequence_parallel/ulysses_sp.py, v0.19.8) on a PyTorch Llama
layer: the forward runs the MLP tile by tile without autograd and saves only its input; the
backward re-runs each tile with autograd and backpropagates it, the input gradient written into
one preallocated tensor. Measured with PyTorch's memory profiler
(validation/torch_backward_peak.py) against ckplan's backward walk with `mlp_tiles`; the
gradients match the plain layer's. Skipped without torch."""

import importlib.util
import sys
from pathlib import Path

import pytest
from needs_torch import torch_or_skip

torch = torch_or_skip()
F = torch.nn.functional

VALIDATION = Path(__file__).resolve().parent.parent / "validation"


def _load(name):
    if name in sys.modules:
        return sys.modules[name]
    if str(VALIDATION) not in sys.path:
        sys.path.insert(0, str(VALIDATION))
    spec = importlib.util.spec_from_file_location(name, VALIDATION / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _mlp(layer, x):
    from ckplan.calibrate.layers import FusedSwiGLU

    return layer.down_proj(FusedSwiGLU.apply(layer.fc1(x)))


class TiledMLP(torch.autograd.Function):
    """DeepSpeed's TiledMLP: chunks over the tokens, forward without autograd, the input saved;
    the backward re-runs and backpropagates one tile at a time into x_grad = zeros_like(x).
    The tiles ask for their input gradient only (weight gradients are model states, which the
    walk leaves out, as torch_backward_peak.py's whole-layer measure does)."""

    @staticmethod
    def forward(ctx, layer, x, tiles):
        ctx.layer, ctx.tiles = layer, tiles
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([_mlp(layer, t) for t in torch.chunk(x, tiles, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        hidden = x.shape[-1]
        flat, incoming = x.detach().reshape(-1, hidden), grad.reshape(-1, hidden)
        x_grad = torch.zeros_like(flat)
        step = -(-flat.shape[0] // ctx.tiles)
        for start in range(0, flat.shape[0], step):
            piece = flat[start : start + step].detach().requires_grad_()
            with torch.enable_grad():
                out = _mlp(ctx.layer, piece)
            (tile_grad,) = torch.autograd.grad(out, piece, incoming[start : start + step])
            x_grad[start : start + step] += tile_grad
            del out, tile_grad
        return None, x_grad.view(x.shape), None


def _tiled_forward(layer, x, tiles):
    """The Llama layer of ckplan/calibrate/layers.py (fused RMSNorm, SDPA with GQA, fused
    SwiGLU) with its MLP under TiledMLP."""
    cfg = layer.cfg
    b, s, h = x.shape
    a, g = cfg.heads, cfg.kv_heads
    d = h // a
    y = layer.input_layernorm(x)
    q = layer.q_proj(y).view(b, s, a, d).transpose(1, 2)
    k = layer.k_proj(y).view(b, s, g, d).transpose(1, 2)
    v = layer.v_proj(y).view(b, s, g, d).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    y = layer.o_proj(y.transpose(1, 2).contiguous().view(b, s, h))
    x = x + y
    y = layer.post_attention_layernorm(x)
    return x + TiledMLP.apply(layer, y, tiles)


@pytest.fixture(scope="module")
def setup():
    peak = _load("torch_backward_peak")
    harness = _load("torch_saved_bytes")
    cfg = next(c for c in peak.default_configs() if c.name == "llama-bf16-fused")
    return peak, harness, cfg


def _measure(peak, harness, cfg, tiles):
    torch.manual_seed(0)
    layer = harness.LlamaLayer(cfg).to(dtype=cfg.torch_dtype).train()
    shape = (cfg.micro_batch, cfg.seq, cfg.hidden)
    x = torch.randn(shape, dtype=cfg.torch_dtype, requires_grad=True)
    grad_out = torch.randn(shape, dtype=cfg.torch_dtype)
    baseline = x.untyped_storage().nbytes() + grad_out.untyped_storage().nbytes()
    previous = harness._FusedRMSNormFunction.weight_grads
    harness._FusedRMSNormFunction.weight_grads = False  # input gradient only
    try:
        with peak._profile("cpu") as prof:
            out = _tiled_forward(layer, x, tiles)
            out.untyped_storage().resize_(0)
            (grad_in,) = torch.autograd.grad(out, x, grad_out)
        plain_x = x.detach().requires_grad_()
        (plain,) = torch.autograd.grad(layer(plain_x), plain_x, grad_out)
    finally:
        harness._FusedRMSNormFunction.weight_grads = previous
    events, _ = peak._allocations(prof, "cpu")
    _, measured, _, _, _ = peak._replay(events, baseline, None)
    return measured, grad_in, plain


@pytest.mark.parametrize("tiles", [2, 3, 4])
def test_tiled_mlp_backward_peak_against_the_walk(setup, tiles):
    """The measured backward peak of the layer with TiledMLP against the walk's peak over the
    MLP's ops with the `mlp` group recomputed in `tiles` tiles (3: chunks of 86, 86 and 84
    tokens), within the norms' fp32 statistics (which ckplan leaves out, as
    tests/test_torch_validation.py compares the plain layer's); the layer's predicted peak is
    below the untiled re-forward's; the gradients are the plain layer's."""
    from ckplan.model.memory import layer_backward_peak_bytes, layer_backward_walk

    peak, harness, cfg = setup
    measured, grad_in, plain = _measure(peak, harness, cfg, tiles)
    spec = peak._spec(cfg).replace(mlp_tiles=tiles)
    walk = {p.op: p.live_bytes for p in layer_backward_walk(spec, ("mlp",))}
    predicted = max(walk[op] for op in ("fc2", "act", "fc1"))
    statistics = 2 * 4 * cfg.seq * cfg.micro_batch
    assert 0 <= measured - predicted <= statistics + 64, (measured, predicted)
    untiled = layer_backward_peak_bytes(spec.replace(mlp_tiles=1), ("mlp",))
    assert layer_backward_peak_bytes(spec, ("mlp",)) < untiled
    torch.testing.assert_close(grad_in, plain, rtol=2e-2, atol=2e-2)
