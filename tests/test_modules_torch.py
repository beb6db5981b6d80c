"""Megatron-Core's output-discarding checkpoints applied to PyTorch layers, measured with
saved_tensors_hooks: what the layer stores matches ckplan's `layernorm` and `moe_act` tapes.

The checkpoint is Megatron-Core's `tensor_parallel.CheckpointWithoutOutput` (core_v0.15.0,
megatron/core/tensor_parallel/random.py) in a few lines: the function runs without autograd,
its inputs are saved, and once the consumer block has run, the output's storage is resized to
0; when the gradient of the block's output is computed, the function is re-run with autograd,
its output copied back into that storage and kept for the function's backward. The gradients
match the plain layer's.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
from needs_torch import torch_or_skip

torch = torch_or_skip()

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


class _WithoutOutput(torch.autograd.Function):
    """Megatron-Core's CheckpointWithoutOutputFunction: runs the function without autograd,
    saves only its inputs; its backward runs through the re-run's outputs."""

    @staticmethod
    def forward(ctx, run, owner, *inputs):
        with torch.no_grad():
            out = run(*inputs)
        detached = []
        for t in inputs:
            d = t.detach()
            d.requires_grad_(t.requires_grad)
            detached.append(d)
        ctx.save_for_backward(*detached)  # what the recording hooks see
        # the re-run reads them from here: saved-tensor hooks unpack tensors that no longer
        # require grad
        ctx.inputs = tuple(detached)
        owner.ctx = ctx
        return out

    @staticmethod
    def backward(ctx, grad):
        inputs = ctx.inputs
        torch.autograd.backward(ctx.outputs, grad)
        ctx.outputs = ctx.inputs = None
        return (None, None, *[t.grad if t.requires_grad else None for t in inputs])


class Checkpoint:
    """Megatron-Core's CheckpointWithoutOutput: `discard` frees the output's storage and
    registers the re-run as a gradient hook of `hook_tensor`; the re-run (with autograd)
    copies its output into that storage and keeps it for the backward."""

    def __init__(self, run, *inputs):
        self.run = run
        self.ctx = None
        self.out = _WithoutOutput.apply(run, self, *inputs)

    def discard(self, hook_tensor):
        self.out.untyped_storage().resize_(0)
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad):
        with torch.enable_grad():
            again = self.run(*self.ctx.inputs)
        with torch.no_grad():
            self.out.untyped_storage().resize_(again.untyped_storage().size())
            self.out.untyped_storage().copy_(again.untyped_storage())
        self.ctx.outputs = again
        self.out = self.ctx = None


class Discards:
    """The checkpoints of one forward, each discarded once its consumer has run."""

    def __init__(self):
        self.pending = []

    def checkpoint(self, run, *inputs):
        point = Checkpoint(run, *inputs)
        self.pending.append(point)
        return point.out

    def discard(self, hook_tensor):
        """Discard every checkpoint not yet discarded; re-run them when the gradient of
        `hook_tensor` is computed."""
        for point in self.pending:
            point.discard(hook_tensor)
        self.pending = []


class Recorder:
    """Every tensor autograd saves, by storage, parameters and buffers left out."""

    def __init__(self, exclude):
        self.exclude = exclude
        self.tensors = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        # keyed by the storage itself: a discarded storage's memory may be reused
        if storage.data_ptr() not in self.exclude:
            self.tensors.setdefault(storage._cdata, tensor)
        return tensor

    def total(self):
        return sum(t.untyped_storage().nbytes() for t in self.tensors.values())


def discard_after(module, discards):
    """Megatron's discard point: once `module` (the consumer block's last op) has run."""
    module.register_forward_hook(lambda _module, _inputs, out: discards.discard(out))


class _Norm(torch.nn.Module):
    def __init__(self, norm, discards):
        super().__init__()
        self.norm = norm
        self.discards = discards

    def forward(self, x):
        return self.discards.checkpoint(self.norm, x)


def _run(layer, cfg, discards, seed=1):
    exclude = {t.untyped_storage().data_ptr() for t in layer.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in layer.buffers()}
    torch.manual_seed(seed)
    x = torch.randn(cfg.micro_batch, cfg.seq, cfg.hidden, dtype=cfg.torch_dtype)
    x.requires_grad_(True)
    recorder = Recorder(exclude)
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        out = layer(x)
    if discards is not None and discards.pending:
        discards.discard(out)
    stored = recorder.total()
    out.float().sum().backward()
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return stored, grads


def _layer(harness, cfg, module):
    torch.manual_seed(0)
    cls = {"llama": harness.LlamaLayer}.get(cfg.arch) or module.MoELayer
    return cls(cfg).to(dtype=cfg.torch_dtype).train()


def _prediction(harness, cfg, groups):
    from ckplan.inputs.presets import spec_from_values
    from ckplan.model.memory import selective_activation_bytes_per_layer

    spec = spec_from_values(harness.ckplan_mapping_for(cfg), origin=cfg.name)
    return selective_activation_bytes_per_layer(spec, groups)


@pytest.fixture(scope="module")
def harness():
    return _load("torch_saved_bytes")


@pytest.fixture(scope="module")
def moe_module(harness):
    return _load("torch_moe_mla")


def _config(harness, name):
    return next(c for c in harness.default_configs() if c.name == name)


def _same(grads, expected):
    for got, want in zip(grads, expected, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["llama-bf16-fused", "moe-bf16"])
def test_layernorm_checkpoint_matches_the_predicted_tape(harness, moe_module, name):
    """The layer with both norms under the checkpoint stores what ckplan's `layernorm` drops
    less, and the norms' fp32 statistics (ckplan leaves them out; the checkpoint runs the
    norms without autograd). The Llama layer, which ckplan models to the byte but for those
    statistics, stores exactly the predicted tape."""
    cfg = _config(harness, name)
    plain = _layer(harness, cfg, moe_module)
    stored_plain, expected = _run(plain, cfg, None)
    layer = _layer(harness, cfg, moe_module)
    discards = Discards()
    layer.input_layernorm = _Norm(layer.input_layernorm, discards)
    layer.post_attention_layernorm = _Norm(layer.post_attention_layernorm, discards)
    discard_after(layer.o_proj, discards)
    if cfg.arch == "llama":
        discard_after(layer.down_proj, discards)
    # the MoE layer: norm2's output at the layer output (Megatron: the MoE block's output, which
    # this layer's code does not expose), before any of the block's backward
    stored, grads = _run(layer, cfg, discards)
    predicted = _prediction(harness, cfg, ("layernorm",))
    statistics = 2 * 4 * cfg.seq * cfg.micro_batch  # fused RMSNorm: an fp32 rstd per token
    assert stored_plain - stored == _prediction(harness, cfg, ()) - predicted + statistics
    if cfg.arch == "llama":
        assert stored == predicted
    _same(grads, expected)


def test_moe_act_checkpoint_matches_the_predicted_saving(harness, moe_module, monkeypatch):
    """The experts' weighted SwiGLU under the checkpoint: the layer stores what ckplan's
    `moe_act` drops less than without it, to the byte."""
    cfg = _config(harness, "moe-bf16")
    plain = _layer(harness, cfg, moe_module)
    stored_plain, expected = _run(plain, cfg, None)
    discards = Discards()
    swiglu = moe_module._WeightedSwiGLU

    class Checkpointed:
        @staticmethod
        def apply(z, weights):
            return discards.checkpoint(swiglu.apply, z, weights)

    monkeypatch.setattr(moe_module, "_WeightedSwiGLU", Checkpointed)
    layer = _layer(harness, cfg, moe_module)
    for fc2 in layer.fc2:
        discard_after(fc2, discards)
    stored, grads = _run(layer, cfg, discards)
    predicted = _prediction(harness, cfg, ()) - _prediction(harness, cfg, ("moe_act",))
    assert stored_plain - stored == predicted
    _same(grads, expected)


def test_layernorm_backward_peak_against_the_walk(harness):
    """One Llama layer's forward + backward under PyTorch's memory profiler
    (validation/torch_backward_peak.py), both norms under the checkpoint: the backward peak
    against ckplan's walk with `layernorm` (the re-run output beside the restored storage)."""
    peak = _load("torch_backward_peak")
    from ckplan.model.memory import layer_backward_peak_bytes, layer_backward_walk

    cfg = next(c for c in peak.default_configs() if c.name == "llama-bf16-fused")
    torch.manual_seed(0)
    layer = harness.LlamaLayer(cfg).to(dtype=cfg.torch_dtype).train()
    discards = Discards()
    layer.input_layernorm = _Norm(layer.input_layernorm, discards)
    layer.post_attention_layernorm = _Norm(layer.post_attention_layernorm, discards)
    discard_after(layer.o_proj, discards)
    discard_after(layer.down_proj, discards)
    shape = (cfg.micro_batch, cfg.seq, cfg.hidden)
    x = torch.randn(shape, dtype=cfg.torch_dtype, requires_grad=True)
    grad_out = torch.randn(shape, dtype=cfg.torch_dtype)
    baseline = x.untyped_storage().nbytes() + grad_out.untyped_storage().nbytes()
    tagger = peak.OpTagger()
    previous = harness._FusedRMSNormFunction.weight_grads
    harness._FusedRMSNormFunction.weight_grads = False  # input gradient only
    try:
        with peak._profile("cpu") as prof:
            out = layer(x, tagger)
            out.untyped_storage().resize_(0)
            (grad_in,) = torch.autograd.grad(out, x, grad_out)
    finally:
        harness._FusedRMSNormFunction.weight_grads = previous
    assert torch.isfinite(grad_in.float()).all()
    events, _ = peak._allocations(prof, "cpu")
    _, measured, _, _, _ = peak._replay(events, baseline, tagger)
    spec = peak._spec(cfg)
    predicted = layer_backward_peak_bytes(spec, ("layernorm",))
    statistics = 2 * 4 * cfg.seq * cfg.micro_batch
    # within the norms' fp32 statistics (the re-run saves them; ckplan leaves them out) and a
    # few scalars, as tests/test_torch_validation.py compares the plain layer's
    assert 0 <= measured - predicted <= statistics + 64
    # the peak is in the MLP's backward, where norm2's restored output and the re-run's copy
    # are both alive: a walk without the copy would be one norm output short of the measure
    walk = {p.op: p.live_bytes for p in layer_backward_walk(spec, ("layernorm",))}
    assert max(walk, key=walk.get) == "act"
    norm_output = cfg.seq * cfg.micro_batch * cfg.hidden * cfg.dtype_bytes
    assert measured - (predicted - norm_output) > statistics + 64
