"""Scoped per-op policies (`sac@REGION=UNIT,...`): checkpointed regions at module boundaries,
their tape by brute force and against PyTorch's checkpoint, and the frontier over region layouts
and kept units against brute force."""

from itertools import combinations

import pytest
from test_op_policy import SMALL, _strictly_better, _torch_block, small

from ckplan.model.memory import activation_bytes_per_layer
from ckplan.model.mla import latent_view_bytes, value_view_bytes
from ckplan.model.op import LayerShapes
from ckplan.model.op_policy import (
    PolicyError,
    kept_mask,
    parse_policy,
    policy_spans,
    policy_tape_bytes,
    policy_text,
    region_spans,
    replays,
    rerun_mask,
    scoped_tape_bytes,
    unit_ops,
)
from ckplan.model.spec import spec_from_mapping
from ckplan.plan.strategies import StrategyError, parse_strategy

MOE = {**SMALL, "experts": 4, "top_k": 2, "moe_ffn_hidden": 32, "bias": False}
# DeepSeek-V3's shape, small (tests/test_op_policy_moe_mla.py): latents, one shared expert
MLA = {**MOE, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
       "qk_rope_head_dim": 8, "v_head_dim": 16, "shared_experts": 1, "kv_heads": 4}  # fmt: skip


def test_scoped_grammar_round_trips():
    policy = parse_policy("sac@mlp=w3/attention=wv,sdpa")
    assert policy.scopes == (
        ("attention", frozenset({"v_proj", "attention"})),
        ("mlp", frozenset({"up_proj"})),
    )
    assert policy_text(policy) == "sac@attention=v_proj,attention/mlp=up_proj"
    assert parse_policy(policy_text(policy)) == policy
    assert policy_text(parse_policy("sac@norm1/mlp_act")) == "sac@norm1/mlp_act"


def test_scoped_all_to_all_names_dispatch_and_combine():
    """`all_to_all` is a group as in `sac:`: the expert-parallel dispatch and combine both."""
    policy = parse_policy("sac@moe=all_to_all,router")
    assert policy.scopes == (("moe", frozenset({"dispatch", "combine", "router"})),)
    assert parse_policy(policy_text(policy)) == policy


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("sac@", "name at least one region"),
        ("sac@ffn", "unknown region 'ffn'"),
        ("sac@mlp/mlp", "region 'mlp' named twice"),
        ("sac@mlp=wq7", "unknown op 'wq7'"),
        ("sac@attention=", "region 'attention' has '=' and no op after it"),
        ("sac@attention=/mlp", "region 'attention' has '=' and no op after it"),
        ("sac@mlp=gate_proj,,up_proj", "unknown op ''"),
        ("sac@=", "unknown region ''"),
        ("sac@mlp/", "unknown region ''"),
    ],
)
def test_bad_scoped_policies_are_one_line_errors(text, fragment):
    with pytest.raises(PolicyError, match=fragment):
        parse_policy(text)


@pytest.mark.parametrize(
    ("text", "changes", "fragment"),
    [
        ("sac@attention/core_attn", {}, "regions attention and core_attn overlap"),
        ("sac@mlp=q_proj", {}, "region mlp does not hold q_proj"),
        ("sac@experts", {}, "the model's layers have no region experts"),
        ("sac@mlp", {"kernels": "compiled"}, "modelled for eager layers"),
    ],
)
def test_scoped_policies_that_do_not_fit_say_why(text, changes, fragment):
    with pytest.raises(StrategyError, match=fragment):
        parse_strategy(text, small(**changes))


@pytest.mark.parametrize("changes", [{}, {"tp": 2, "sp": True}])
def test_no_region_is_the_plain_tape_and_one_region_the_layer_policy(changes):
    """Un-checkpointed, the units hold what the op table saves (a dense Llama layer); the whole
    layer as one region holds the input and the kept outputs, as a layer-level policy."""
    spec = small(**changes)
    units = unit_ops(spec)
    nothing = (False,) * len(units)
    assert scoped_tape_bytes(spec, units, (), nothing) == activation_bytes_per_layer(spec)
    policy = parse_policy("sac:wq,wo,w2,attention,norm2")
    whole = ((0, len(units)),)
    kept = kept_mask(spec, policy)
    assert scoped_tape_bytes(spec, units, whole, kept) == policy_tape_bytes(spec, policy)


@pytest.mark.parametrize(
    "changes",
    [{}, {"tp": 2, "sp": True, "ep": 2, "dp": 2}, {"moe_imbalance": "worst"}],
)
@pytest.mark.parametrize("base", [MOE, MLA], ids=["moe", "mla"])
def test_no_region_in_moe_and_mla_layers(base, changes):
    """MoE and MLA layers un-checkpointed hold the op table's tape (the experts' input
    all-gathered over etp, or on the worst-case rows: `EXPERT_INPUT`). With MLA that includes
    the storages views keep whole in torchtitan: V splits wkv_b's output, which SDPA's saved V
    holds with K's no-RoPE part (T·a/t·nope values), and kv_norm's input splits wkv_a's, held
    with the RoPE key (T/t·rope under sequence parallelism), as the torch block of
    tests/test_op_policy_moe_mla.py holds them (`mla.value_view_bytes`,
    `mla.latent_view_bytes`, by hand here)."""
    spec = spec_from_mapping({**base, **changes})
    units = unit_ops(spec)
    nothing = (False,) * len(units)
    if spec.mla:
        tp = spec.tp
        tokens = spec.seq * spec.micro_batch
        shapes = LayerShapes.of(spec.chain)
        assert value_view_bytes(spec, shapes) == 4 * tokens * (spec.heads // tp) * 8
        assert latent_view_bytes(spec, shapes) == 4 * tokens // (tp if spec.sp else 1) * 8
    plain = activation_bytes_per_layer(spec)
    assert scoped_tape_bytes(spec, units, (), nothing) == plain


def test_scoped_tape_by_hand():
    """sac@attention=v_proj,attention/mlp_act on the small layer (fp32, s·b = 32 tokens,
    nn.RMSNorm saving only its input in fp32): the attention region holds its input (norm1's
    output, 32·64·4 bytes), v (32·32·4), the attention output and fp32 logsumexp
    (32·64·4 + 4·32·4); un-checkpointed: the layer input (norm1's), norm2's input and output
    (read by gate and up), the gate and up outputs (the activation region's input, 32·96·4
    each), the activation's output (the region's, read by fc2)."""
    spec = small()
    assert {u.internal for u in unit_ops(spec)} == {0}
    policy = parse_policy("sac@attention=v_proj,attention/mlp_act")
    X, F = 32 * 64 * 4, 32 * 96 * 4
    expected = X  # the layer input
    expected += X + 32 * 32 * 4 + X + 4 * 32 * 4  # region input, v, attention output
    expected += 2 * X  # norm2's input and output
    expected += 2 * F + F  # gate, up, the activation's output
    assert policy_tape_bytes(spec, policy) == expected


def _brute_frontier(spec, layout, gpu):
    """Every subset of `layout`'s region units kept, by `kept_mask` and `policy_tape_bytes`
    on the parsed policy, and `rerun_mask` per region."""
    from ckplan.plan.policy_search import unit_cost

    units = unit_ops(spec)
    costs = [unit_cost(spec, u, gpu) for u in units]
    members = [(name, units[i].name) for name, (a, b) in layout for i in range(a, b)]
    best = {}
    for size in range(len(members) + 1):
        for chosen in combinations(members, size):
            kept = {name: ",".join(u for r, u in chosen if r == name) for name, _ in layout}
            # a region keeping nothing is written alone (`REGION=` is refused)
            scopes = "/".join(f"{name}={kept[name]}" if kept[name] else name for name in kept)
            policy = parse_policy("sac@" + scopes)
            tape = policy_tape_bytes(spec, policy)
            spans = policy_spans(spec, policy)
            again = rerun_mask(units, kept_mask(spec, policy), replays(spec, True), spans)
            cost = sum(c for c, a in zip(costs, again, strict=True) if a)
            best[tape] = min(best.get(tape, cost), cost)
    return _strictly_better(sorted(best.items()))


@pytest.mark.parametrize("framework", ["torchtitan", "hf"])
@pytest.mark.parametrize("base", [SMALL, MOE, MLA], ids=["dense", "moe", "mla"])
def test_layout_frontier_is_the_brute_force_pareto_set(base, framework):
    """Per layout of regions holding at most 10 units (13: every layout of the dense layer), the
    knapsack's frontier is the brute-force one; and the frontier over all layouts is the Pareto
    set of theirs, each point a policy with its tape."""
    from ckplan.plan.policy_search import layout_frontier, region_layouts, scoped_frontier

    spec = spec_from_mapping({**base, "framework": framework})
    assert replays(spec) == ("whole" if framework == "torchtitan" else "early_stop")
    layouts = region_layouts(spec)
    checked = 0
    union = []
    for layout in layouts:
        points = layout_frontier(spec, layout)
        union += [(p.tape_bytes, p.cost) for p in points]
        if sum(b - a for _, (a, b) in layout) > (13 if base is SMALL else 10):
            continue
        frontier = _strictly_better([(p.tape_bytes, p.cost) for p in points])
        brute = _brute_frontier(spec, layout, None)
        assert [t for t, _ in frontier] == [t for t, _ in brute], layout
        for (_, got), (_, want) in zip(frontier, brute, strict=True):
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
        checked += 1
    assert checked >= (len(layouts) if base is SMALL else 20)
    points = scoped_frontier(spec)
    for point in points:
        assert policy_tape_bytes(spec, parse_policy(point.strategy)) == point.tape_bytes
    best = _strictly_better(sorted(union, key=lambda p: (p[0], p[1])))
    assert _strictly_better([(p.tape_bytes, p.cost) for p in points]) == best


# ---- against PyTorch: each region its own checkpoint ---------------------------------------------


def _scoped_block(torch, spec):
    """`test_op_policy._torch_block`'s layer with its forward split at the regions' module
    boundaries; `run(region, fn, *args)` checkpoints `fn` when the policy names `region`.
    RoPE's angles are buffers (a real model computes them once for all layers)."""
    F = torch.nn.functional
    base = _torch_block(torch, spec)
    a, g, d = spec.heads, spec.kv_heads, spec.head_dim
    angles = torch.arange(spec.seq)[:, None] * (10000.0 ** (-torch.arange(d // 2) / (d // 2)))
    base.register_buffer("cos", angles.cos()[None, :, None, :])
    base.register_buffer("sin", angles.sin()[None, :, None, :])

    def rope(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * base.cos - x2 * base.sin, x1 * base.sin + x2 * base.cos], dim=-1)

    def forward(x, run):
        b, s, _ = x.shape

        def core(q, k, v):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True,
            )  # fmt: skip
            return out.transpose(1, 2).reshape(b, s, a * d)

        def attention(y):
            q = rope(base.wq(y).view(b, s, a, d))
            k = rope(base.wk(y).view(b, s, g, d))
            v = base.wv(y).view(b, s, g, d)
            return base.wo(run("core_attn", core, q, k, v))

        def act(gate, up):
            return F.silu(gate) * up

        def mlp(z):
            return base.w2(run("mlp_act", act, base.w1(z), base.w3(z)))

        def first(x):
            return run("attention", attention, run("norm1", base.attention_norm, x))

        def second(hidden):
            return run("mlp", mlp, run("norm2", base.ffn_norm, hidden))

        hidden = x + run("norm1_attention", first, x)
        return hidden + run("norm2_mlp", second, hidden)

    return base, forward


@pytest.mark.parametrize(
    "text",
    [
        "sac@attention=v_proj,attention/mlp=up_proj",
        "sac@norm1_attention=q_proj,k_proj,v_proj,attention/mlp_act",
        "sac@core_attn/norm2_mlp=gate_proj,fc2",
        "sac@norm1/attention/norm2/mlp",
        "sac@norm1_attention=out_proj/norm2_mlp=gate_proj,up_proj",
    ],
)
def test_torch_regions_hold_the_predicted_bytes(text):
    """Each region of the policy its own `torch.utils.checkpoint` with a selective policy
    keeping its named matmuls (by their count in the region) and the SDPA kernel: the storages
    alive between forward and backward (the checkpoints' inputs, their caches, what autograd
    saves outside them, the layer input; parameters and RoPE's angles apart) are ckplan's tape,
    and the gradients are the plain step's."""
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    from ckplan.inputs.presets import spec_from_values

    # eager nn.RMSNorm (its fp32 rstd and normalised input) and SwiGLU (silu(gate) kept)
    spec = spec_from_values({**SMALL, "profile": "torch-sdpa"})
    assert {u.name for u in unit_ops(spec) if u.internal} == {"norm1", "norm2"}
    policy = parse_policy(text)
    units = unit_ops(spec)
    spans = region_spans(spec)
    scopes = dict(policy.scopes)
    aten = torch.ops.aten
    attention_ops = {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    torch.manual_seed(0)
    block, forward = _scoped_block(torch, spec)
    held, modes = {}, []

    def note(tensor):
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            held[storage.data_ptr()] = storage.nbytes()

    def run(region, fn, *args):
        if region not in scopes:
            return fn(*args)
        matmuls = [u.name for u in units[slice(*spans[region])] if u.matmul]
        kept = scopes[region]

        def context_fn():
            counts = {}

            def policy_fn(ctx, func, *a, **k):
                mode = "recompute" if ctx.is_recompute else "forward"
                save = False
                if func == aten.mm.default:
                    counts[mode] = counts.get(mode, 0) + 1
                    save = matmuls[counts[mode] - 1] in kept
                elif func in attention_ops:
                    save = "attention" in kept
                return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

            pair = create_selective_checkpoint_contexts(policy_fn)
            modes.append(pair[0])
            return pair

        for arg in args:
            note(arg)  # the checkpoint holds its inputs
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)

    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, requires_grad=True)
    weights = torch.randn(spec.micro_batch, spec.seq, spec.hidden)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (note(t), t)[1], lambda t: t):
        out = forward(x, run)
    for mode in modes:
        for entries in mode.storage.values():
            for wrapped in entries.values():
                for value in wrapped if isinstance(wrapped, tuple) else (wrapped,):
                    note(getattr(value, "val", None))
    note(x)
    for tensor in (*block.parameters(), *block.buffers()):
        held.pop(tensor.untyped_storage().data_ptr(), None)
    assert sum(held.values()) == policy_tape_bytes(spec, policy)
    (out * weights).sum().backward()
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    (forward(x, lambda region, fn, *args: fn(*args)) * weights).sum().backward()
    for got, want in zip(grads, [p.grad for p in block.parameters()] + [x.grad], strict=True):
        torch.testing.assert_close(got, want)


# ---- the torch export: a checkpoint around each region's submodule ------------------------------


def _held(torch, run, namespace, modes, constants):
    """The storages alive between `run()`'s forward and its backward: what autograd saves,
    the inputs of the snippet's checkpoints (saved for backward, or, passed by keyword, held
    by the re-forward's closure), what the selective-checkpoint contexts cache; the
    `constants` (parameters, RoPE's angles) apart. Returns (output, bytes)."""
    held = {}

    def note(tensor):
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            held[storage.data_ptr()] = storage.nbytes()
        return tensor

    checkpoint = namespace["checkpoint"]

    def recording(function, *args, **kwargs):
        for value in (*args, *kwargs.values()):
            note(value)
        return checkpoint(function, *args, **kwargs)

    namespace["checkpoint"] = recording
    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
        out = run()
    for mode in modes:
        for entries in mode.storage.values():
            for wrapped in entries.values():
                for value in wrapped if isinstance(wrapped, tuple) else (wrapped,):
                    note(getattr(value, "val", None))
    for tensor in constants:
        held.pop(tensor.untyped_storage().data_ptr(), None)
    return out, sum(held.values())


def _modular_block(torch, spec):
    """`test_op_policy._torch_block` as torchtitan's modules (torchtitan/models/llama3/model/
    model.py at v0.2.2): `attention_norm`, `attention` (wq, wk, wv, RoPE, SDPA, wo),
    `ffn_norm`, `feed_forward` (w2(silu(w1 x) · w3 x)); RoPE's angles are buffers."""
    nn, F = torch.nn, torch.nn.functional
    h, a, g, d, ffn = spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.ffn_hidden
    angles = torch.arange(spec.seq)[:, None] * (10000.0 ** (-torch.arange(d // 2) / (d // 2)))

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk = nn.Linear(h, a * d, bias=False), nn.Linear(h, g * d, bias=False)
            self.wv, self.wo = nn.Linear(h, g * d, bias=False), nn.Linear(a * d, h, bias=False)
            self.register_buffer("cos", angles.cos()[None, :, None, :])
            self.register_buffer("sin", angles.sin()[None, :, None, :])

        def rope(self, x):
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]
            return torch.cat([x1 * self.cos - x2 * self.sin, x1 * self.sin + x2 * self.cos], dim=-1)

        def forward(self, y):
            b, s, _ = y.shape
            q = self.rope(self.wq(y).view(b, s, a, d))
            k = self.rope(self.wk(y).view(b, s, g, d))
            v = self.wv(y).view(b, s, g, d)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True,
            )  # fmt: skip
            return self.wo(out.transpose(1, 2).reshape(b, s, a * d))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
            self.w2 = nn.Linear(ffn, h, bias=False)

        def forward(self, z):
            return self.w2(F.silu(self.w1(z)) * self.w3(z))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(h), nn.RMSNorm(h)
            self.attention, self.feed_forward = Attention(), FeedForward()

        def forward(self, x):
            hidden = x + self.attention(self.attention_norm(x))
            return hidden + self.feed_forward(self.ffn_norm(hidden))

    return Block()


EXPORTED = [
    "sac@attention=v_proj,attention/mlp=up_proj",
    "sac@norm1/attention/norm2/mlp",
    "sac@attention=q_proj,k_proj,v_proj,out_proj/mlp=gate_proj,up_proj,fc2",
    "sac@mlp",
    "sac@attention=attention",
]


@pytest.mark.parametrize("text", EXPORTED)
def test_exported_regions_on_torchtitan_style_blocks(text):
    """`export --to torch` of a scoped policy on two torchtitan-style blocks: `forward_layers`
    wraps each region's submodule; what is alive between forward and backward is ckplan's tape
    per layer, and the gradients are the plain step's."""
    import copy

    from export_snippet import recording_snippet
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    from ckplan.inputs.presets import spec_from_values
    from ckplan.plan.evaluate import evaluate

    # the blocks' separate wq, wk and wv, as torchtitan's before 0.3.0 (whose Llama fuses them)
    spec = spec_from_values({**SMALL, "profile": "torch-sdpa", "framework_version": "2024.12"})
    plan = evaluate(spec, parse_strategy(text, spec))
    namespace, modes = recording_snippet(plan)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_modular_block(torch, spec) for _ in range(spec.layers))
    plain = copy.deepcopy(layers)
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, requires_grad=True)
    weights = torch.randn(spec.micro_batch, spec.seq, spec.hidden)
    constants = (*layers.parameters(), *layers.buffers())
    out, held = _held(
        torch, lambda: namespace["forward_layers"](layers, x), namespace, modes, constants
    )
    assert held == spec.layers * policy_tape_bytes(spec, parse_policy(text))
    (out * weights).sum().backward()
    hidden = x.detach().requires_grad_()
    want = hidden
    for layer in plain:
        want = layer(want)
    (want * weights).sum().backward()
    for got, expected in zip([*layers.parameters(), x], [*plain.parameters(), hidden], strict=True):
        torch.testing.assert_close(got.grad, expected.grad)


@pytest.mark.parametrize("text", EXPORTED)
def test_exported_regions_on_hugging_face_llama_layers(text):
    """The same on Hugging Face transformers' LlamaDecoderLayer (`scope_layer` on each layer,
    the layers called as the model calls them, with RoPE's cos and sin)."""
    import copy

    from export_snippet import recording_snippet
    from needs_torch import torch_or_skip
    from test_op_policy_hf import TINY, _layers

    torch = torch_or_skip()
    transformers = pytest.importorskip("transformers")
    from ckplan.inputs.presets import spec_from_values
    from ckplan.plan.evaluate import evaluate

    spec = spec_from_values(TINY)  # framework hf: the torch-sdpa profile (eager norms, SwiGLU)
    assert spec.profile.name == "torch-sdpa"
    plan = evaluate(spec, parse_strategy(text, spec))
    namespace, modes = recording_snippet(plan)
    layers, rotary = _layers(torch, transformers, spec)
    plain = copy.deepcopy(layers)
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, requires_grad=True)
    positions = torch.arange(spec.seq)[None].expand(spec.micro_batch, -1)
    cos_sin = rotary(x, positions)
    weights = torch.randn(spec.micro_batch, spec.seq, spec.hidden)

    def run(layers, hidden, scope):
        for layer in layers:
            hidden = (scope(layer) if scope else layer)(hidden, position_embeddings=cos_sin)
        return hidden

    constants = (*layers.parameters(), *layers.buffers(), *cos_sin)
    out, held = _held(
        torch, lambda: run(layers, x, namespace["scope_layer"]), namespace, modes, constants
    )
    assert held == spec.layers * policy_tape_bytes(spec, parse_policy(text))
    (out * weights).sum().backward()
    hidden = x.detach().requires_grad_()
    (run(plain, hidden, None) * weights).sum().backward()
    for got, expected in zip([*layers.parameters(), x], [*plain.parameters(), hidden], strict=True):
        torch.testing.assert_close(got.grad, expected.grad)


@pytest.mark.parametrize(
    ("text", "target", "fragment"),
    [
        ("sac@mlp_act", "torch", "mlp_act is code inside one"),
        ("sac@attention=rope", "torch", "not rope"),
        ("sac@mlp+uniform:1", "torch", "beside recomputed or offloaded layers"),
        ("sac@mlp", "torchtitan", "torchtitan's op-level selective AC"),
        ("sac@mlp", "megatron", "export the strategy mlp (--recompute-modules)"),
        ("sac@mlp=fc2", "megatron", "not ops chosen by a policy"),
        ("sac@mlp", "deepspeed", "sac@mlp"),
    ],
)
def test_targets_that_cannot_run_a_scoped_policy_say_why(text, target, fragment):
    from ckplan import exports
    from ckplan.plan.evaluate import evaluate

    spec = small()
    plan = evaluate(spec, parse_strategy(text, spec))
    why = exports.why_not(plan, target)
    assert fragment in why and "\n" not in why
    with pytest.raises(exports.ExportError):
        exports.export(plan, target)


@pytest.mark.parametrize(
    "changes", [{"kernels": "compiled"}, {"post_norms": True}, {"parallel_residual": True}]
)
def test_no_scoped_frontier_where_scoped_policies_are_not_modelled(changes):
    from ckplan.plan.policy_search import policy_frontier, scoped_frontier

    spec = small(**changes)
    assert scoped_frontier(spec) == ()
    assert policy_frontier(spec)  # the layer-level frontier stays
    with pytest.raises(StrategyError):
        parse_strategy("sac@mlp", spec)
