"""The exported PyTorch snippet, run: each layer is re-run exactly as often as ckplan's replay
says (the attention core once more under selective), the activations it holds after the forward
pass are the ones the plan keeps, and the gradients equal the plain step's.

Skipped unless torch is installed (`make validate` installs the CPU build and runs this file).
"""

import weakref

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from ckplan import exports  # noqa: E402
from ckplan.exports.segments import layer_segments  # noqa: E402
from ckplan.plan import evaluate, layer_chain, parse_strategy  # noqa: E402
from ckplan.plan.search import activation_budget  # noqa: E402
from ckplan.schedules import simulate  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, BATCH = 6, 16, 2, 8, 2


def plain_core(core, q, k, v):
    return core(q, k, v)


class Block(torch.nn.Module):
    """A GPT block without norms: attention with explicit QKᵀ, softmax, ·V (standard
    attention), then a GELU MLP; residuals around both. The core is called through
    `self.attention_core`, the hook an exported selective snippet fills."""

    attention_core = staticmethod(plain_core)

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):  # (b, s, h)
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q, k, v = (t.view(b, s, HEADS, h // HEADS).transpose(1, 2) for t in (q, k, v))
        context = self.attention_core(core, q, k, v)  # (b, a, s, d)
        x = x + self.out(context.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def core(q, k, v):  # (b, a, s, d) each
    scores = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return scores @ v


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run and keeps a weak reference to every tensor they make, so
    what is still alive after the forward pass can be summed."""

    def __init__(self):
        super().__init__()
        self.counts = {}
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.outputs.append((weakref.ref(tensor), storage.data_ptr(), storage.nbytes()))
        return out

    def alive_bytes(self, excluded):
        alive = {ptr: size for ref, ptr, size in self.outputs if ref() is not None}
        return sum(size for ptr, size in alive.items() if ptr not in excluded)


def step(forward_layers, layers, x):
    """Gradients, op counts, and the activation bytes alive between forward and backward."""
    for p in layers.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    weights = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    with OpCounter() as counter:
        y = forward_layers(layers, x.clone())  # the clone: the input counted like any value
        held = counter.alive_bytes(weights)
        y.square().sum().backward()
    grads = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    return grads, counter.counts, held


def plain(layers, hidden):
    for layer in layers:
        hidden = layer(hidden)
    return hidden


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Block() for _ in range(LAYERS)).double()
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    return layers, x, step(plain, layers, x)


def _plan(spec_of, name):
    spec = spec_of("gpt2", layers=LAYERS)
    if name.endswith("optimal"):
        none = evaluate(spec, parse_strategy("none", spec))
        budget = none.activation_bytes * 3 // 5
        assert budget < activation_budget(spec, 10**12)
        return evaluate(spec, parse_strategy(name, spec), budget=budget)
    return evaluate(spec, parse_strategy(name, spec))


@pytest.mark.parametrize(
    "name",
    [
        "none",
        "full",
        "uniform:2",
        "uniform:4",
        "sequential:3",
        "sequential:4",
        "block:2",
        "selective",
        "selective+uniform:3",
        "selective+block:2",
        "optimal",
    ],
)
def test_snippet_runs_the_plan(spec_of, model, name):
    layers, x, (reference, base_counts, base_held) = model
    plan = _plan(spec_of, name)
    export = exports.export(plan, "torch")
    namespace = {}
    exec(compile(export.text, f"<ckplan export {name}>", "exec"), namespace)
    selective = plan.strategy.startswith("selective")
    Block.attention_core = staticmethod(namespace["attention_core"] if selective else plain_core)
    try:
        grads, counts, held = step(namespace["forward_layers"], layers, x)
    finally:
        Block.attention_core = staticmethod(plain_core)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
    # layer forwards of ckplan's replay (the layers only, not embedding and output)
    chain = layer_chain(plan.spec, plan.strategy.startswith("selective"))
    forwards = simulate(chain, plan.steps).layer_forwards[1:-1]
    gelu, softmax = torch.ops.aten.gelu.default, torch.ops.aten._softmax.default
    assert counts[gelu] == sum(forwards), export.text
    assert counts[softmax] == sum(forwards) + (LAYERS if selective else 0)
    assert base_counts[gelu] == base_counts[softmax] == LAYERS
    # Held after the forward pass: the output, each recomputed segment's input, each stored
    # layer's whole tape (less the softmax output, 8·b·a·s² bytes, under selective).
    stream = 8 * BATCH * SEQ * HIDDEN
    tape, remainder = divmod(base_held - stream, LAYERS)
    assert remainder == 0 and tape > 4 * stream
    if selective:
        tape -= 8 * BATCH * HEADS * SEQ * SEQ
    expected = stream + sum(
        stream if recompute else (end - start) * tape
        for start, end, recompute in layer_segments(plan).segments
    )
    assert held == expected
    if "sequential:3" in name:
        assert "checkpoint_sequential" in export.text


@pytest.mark.parametrize(
    "name",
    ["offload", "selective+offload", "full+offload", "block:2+offload", "uniform:2+offload"],
)
def test_offload_snippet_saves_the_offloaded_layers_on_cpu(spec_of, model, name):
    """Every offloaded layer runs under save_on_cpu (counted as its contexts open and its saved
    tensors are packed); the gradients equal the plain step's. On a CPU build save_on_cpu makes
    no copy, so the device memory is not measured here (ckplan verify measures it on NumPy)."""
    layers, x, (reference, _, _) = model
    plan = _plan(spec_of, name)
    export = exports.export(plan, "torch")
    namespace = {}
    exec(compile(export.text, f"<ckplan export {name}>", "exec"), namespace)
    opened, packed = [], []
    real = namespace["save_on_cpu"]

    class Counting(real):
        def __init__(self, pin_memory=False):
            super().__init__(pin_memory=pin_memory)
            pack = self.pack_hook

            def counting_pack(tensor):
                packed.append(tensor.untyped_storage().nbytes())
                return pack(tensor)

            self.pack_hook = counting_pack

        def __enter__(self):
            opened.append(1)
            return super().__enter__()

    namespace["save_on_cpu"] = Counting
    selective = plan.strategy.startswith("selective")
    Block.attention_core = staticmethod(namespace["attention_core"] if selective else plain_core)
    try:
        grads, _, _ = step(namespace["forward_layers"], layers, x)
    finally:
        Block.attention_core = staticmethod(plain_core)
    # equal to float64 rounding: save_on_cpu's host copies may sit at another alignment, and
    # the CPU kernels then sum in another order (seen on AVX-512 builds, ~3e-14)
    for a, b in zip(grads, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    segments = layer_segments(plan).segments
    starts = [start for start, _, recompute in segments if recompute]
    stored = [i for start, end, recompute in segments if not recompute for i in range(start, end)]
    offloaded = layer_segments(plan).offloaded
    assert offloaded == tuple(sorted(starts + stored)) and len(opened) == len(offloaded)
    layer_input = BATCH * SEQ * HIDDEN * 8
    # a recomputed segment packs its input alone (and the checkpoint's empty marker), a stored
    # layer its tape, several of its tensors
    saved = [size for size in packed if size]
    if not stored:  # full+offload, uniform:2+offload: exactly the segments' inputs go to host
        assert saved == [layer_input] * len(starts)
    else:
        assert saved.count(layer_input) >= len(starts)
        assert sum(saved) > layer_input * len(offloaded)


def test_layer_and_scoped_policies_run_one_policy_fn():
    """The layer-level and the scoped per-op snippets define one `_policy`; run on a stream of
    aten ops, it keeps the numbered matmuls, the attention kernel and the numbered element-wise
    outputs that `keep` names, counting the forward and the re-forward apart."""
    from collections import defaultdict

    from test_op_policy_hf import TINY
    from torch.utils.checkpoint import CheckpointPolicy

    from ckplan.model.spec import spec_from_mapping

    spec = spec_from_mapping(TINY)

    def snippet(strategy):
        return exports.export(evaluate(spec, parse_strategy(strategy, spec)), "torch").text

    def policy_source(text):
        start = text.index("def _ops(")
        return text[start : text.index("return policy_fn", start)]

    layer, scoped = snippet("sac"), snippet("sac@mlp")
    assert "scope_layer" in scoped and "scope_layer" not in layer
    assert policy_source(layer) == policy_source(scoped)
    namespace: dict = {}
    exec(compile(layer, "snippet", "exec"), namespace)
    keep = ({2}, set(), True, False, set(), {("mul", 2)})
    policy_fn = namespace["_policy"](defaultdict(int), keep)
    aten = torch.ops.aten
    ops = [
        aten.mm.default,
        aten.mm.default,
        aten.mul.Tensor,
        aten.mul.Tensor,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.add.Tensor,
    ]
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    expected = [recompute, save, recompute, save, save, recompute]
    for is_recompute in (False, True):
        ctx = type("Context", (), {"is_recompute": is_recompute})()
        assert [policy_fn(ctx, op) for op in ops] == expected
