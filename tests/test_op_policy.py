"""Per-op recomputation policies (`sac`, `sac:OP,...`): the tape by hand, the grammar, the
chain, and what PyTorch's selective checkpointing keeps with the same policy."""

import pytest
from export_snippet import cached_storages, recording_snippet

from ckplan.model.op_policy import (
    TORCHTITAN_POLICY,
    kept_units,
    parse_policy,
    policy_tape_bytes,
    policy_text,
    recomputed_forward_flops,
)
from ckplan.model.spec import spec_from_mapping
from ckplan.plan.evaluate import evaluate
from ckplan.plan.strategies import StrategyError, parse_strategy

SMALL = {
    "name": "small",
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "ffn_hidden": 96,
    "seq": 16,
    "micro_batch": 2,
    "vocab": 0,
    "dtype_bytes": 4,
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention": "flash",
    "positions": "rope",
    "dropout": 0,
    "framework": "torchtitan",
}


def small(**changes):
    return spec_from_mapping({**SMALL, **changes})


def test_torchtitan_policy_keeps_wq_wv_w1_w2_and_attention():
    spec = small()
    policy = parse_policy(TORCHTITAN_POLICY)
    assert kept_units(spec, policy) == ("q_proj", "v_proj", "attention", "gate_proj", "fc2")


def test_torchtitan_tape_by_hand():
    # s·b = 32 tokens, fp32: input x 32·64·4; wq 32·64·4; wv 32·(2·16)·4; SDPA output 32·64·4
    # and logsumexp 32·4·4; w1 32·96·4; w2 32·64·4
    tokens = 32
    expected = 4 * tokens * (64 + 64 + 32 + 64 + 4 + 96 + 64)
    assert policy_tape_bytes(small(), parse_policy("sac")) == expected == 49_664


def test_recomputed_flops_by_hand():
    # wk 2·32·32·64, wo 2·32·64·64, w3 2·32·96·64; the attention kernel is kept
    expected = 2 * 32 * 64 * (32 + 64 + 96)
    assert recomputed_forward_flops(small(), parse_policy("sac")) == expected
    # every matmul kept: the attention kernel's QKᵀ and AV (2·b·a·s²·d each) are re-run
    assert recomputed_forward_flops(small(), parse_policy("sac:matmuls")) == (
        2 * (2 * 2 * 4 * 16 * 16 * 16)
    )


def test_tensor_parallel_sequence_parallel_keeps_the_reduce_scatters():
    spec = small(tp=2, sp=True)
    kept = kept_units(spec, parse_policy("sac"))
    assert kept.count("reduce_scatter") == 2
    tokens = 32
    # input x and the two reduce-scattered outputs: the stream /2; wq 2 heads, wv 1 head; the
    # attention output at 2 heads and its logsumexp; w1 48 wide; w2's partial sums (32, 64)
    expected = 4 * (3 * tokens * 32 + tokens * 32 + tokens * 16 + tokens * 32 + tokens * 2)
    expected += 4 * (tokens * 48 + tokens * 64)
    assert policy_tape_bytes(spec, parse_policy("sac")) == expected


def test_torchao_float8_matmuls_are_counted_transformer_engine_fp8_ones_are_not():
    # torchao's Float8Linear reaches the policy as aten.mm (validation/torch_float8_sac.py):
    # torchtitan's rule keeps wq, wv, w1, w2 as in bf16, the same bytes (bf16 GEMM outputs)
    spec = small(precision="float8")
    assert kept_units(spec, parse_policy("sac")) == (
        "q_proj", "v_proj", "attention", "gate_proj", "fc2"
    )  # fmt: skip
    assert policy_tape_bytes(spec, parse_policy("sac")) == 49_664
    # Transformer Engine's GEMMs are not aten.mm: only what is named is kept
    spec = small(precision="fp8")
    assert kept_units(spec, parse_policy("sac")) == ("attention",)
    assert kept_units(spec, parse_policy("sac:q_proj,attention")) == ("q_proj", "attention")


def test_policy_grammar_round_trips():
    assert policy_text(parse_policy("sac:wo,matmuls%3,sdpa")) == "sac:matmuls%3,attention,out_proj"
    assert policy_text(parse_policy(TORCHTITAN_POLICY)) == TORCHTITAN_POLICY


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("sac:nothing", "unknown op 'nothing'"),
        ("sac:matmuls%0", "K in 1..1000"),
        ("sac+sac", "per-op policy"),
        ("sac+selective", "already decides"),
        ("sac+mlp+block:1", "combines only with one"),
    ],
)
def test_bad_policies_are_one_line_errors(text, fragment):
    with pytest.raises(StrategyError, match=fragment):
        parse_strategy(text, small())


def test_policy_needs_a_dense_flash_layer():
    with pytest.raises(StrategyError, match="attention: flash"):
        parse_strategy("sac", small(attention="standard"))


def test_strategy_names_and_full():
    spec = small()
    assert parse_strategy("sac", spec).name == "sac"
    assert parse_strategy("sac+block:1", spec).name == "sac+block:1"
    assert parse_strategy("sac:attention", spec).name == "sac:attention"
    assert parse_strategy("sac+full", spec).name == "uniform:1"


def test_chain_memory_and_recompute_order():
    """The policy sits between no recomputation and full recomputation in memory, and keeping
    more outputs never costs more recompute."""
    spec = spec_from_mapping({**SMALL, "layers": 4})
    plans = {name: evaluate(spec, parse_strategy(name, spec)) for name in ("none", "sac", "full")}
    memory = {name: plan.activation_bytes for name, plan in plans.items()}
    assert memory["full"] < memory["sac"] < memory["none"]
    keep_all = evaluate(spec, parse_strategy("sac:matmuls,attention", spec))
    assert keep_all.flops.recompute == 0
    assert 0 < plans["sac"].flops.recompute < plans["full"].flops.recompute


# ---- PyTorch's selective checkpointing with the same policy ------------------------------------


def _torch_block(torch, spec):
    """A torchtitan-style Llama block (torchtitan/models/llama3/model/model.py at v0.1.0): RMSNorm,
    wq, wk, wv, RoPE, SDPA (causal, GQA), wo, residual, RMSNorm, w2(silu(w1(x)) * w3(x))."""
    nn, F = torch.nn, torch.nn.functional
    h, a, g, d, ffn = spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.ffn_hidden

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk = nn.Linear(h, a * d, bias=False), nn.Linear(h, g * d, bias=False)
            self.wv, self.wo = nn.Linear(h, g * d, bias=False), nn.Linear(a * d, h, bias=False)
            self.w1, self.w3 = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
            self.w2 = nn.Linear(ffn, h, bias=False)
            self.attention_norm, self.ffn_norm = nn.RMSNorm(h), nn.RMSNorm(h)

        def rope(self, x):  # (b, s, heads, d): rotate pairs by position-dependent angles
            s = x.shape[1]
            angles = torch.arange(s)[:, None] * (10000.0 ** (-torch.arange(d // 2) / (d // 2)))
            cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]
            return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

        def forward(self, x):
            b, s, _ = x.shape
            y = self.attention_norm(x)
            q = self.wq(y).view(b, s, a, d)
            k = self.wk(y).view(b, s, g, d)
            v = self.wv(y).view(b, s, g, d)
            q, k = self.rope(q), self.rope(k)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            )
            hidden = x + self.wo(out.transpose(1, 2).reshape(b, s, a * d))
            z = self.ffn_norm(hidden)
            return hidden + self.w2(F.silu(self.w1(z)) * self.w3(z))

    return Block()


def _policy_fn(torch, spec, policy):
    """torchtitan's `_custom_policy` generalised to an `OpPolicy`: mm outputs by the every-K-th
    rule, the SDPA kernels' outputs when the policy keeps the attention (CPU's flash kernel is
    its own op), the linear layers by their position among the mm calls when named."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy

    from ckplan.model.op_policy import unit_ops

    matmul_names = [unit.name for unit in unit_ops(spec) if unit.matmul]
    aten = torch.ops.aten
    attention_ops = {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    # The element-wise units' outputs in `_torch_block`, by aten op and its count in a layer
    # (traced on torch 2.13 CPU, fp32: nn.RMSNorm runs pow, mean, add_, rsqrt, mul, mul; each
    # RoPE three muls for its angles and the halves, sub, add, cat; F.silu(w1 x) * w3 x runs
    # silu and mul; the residual adds are the third and fourth aten.add.Tensor, after RoPE's).
    elementwise = {
        (aten.mul.Tensor, 2): "norm1",
        (aten.cat.default, 1): "rope",
        (aten.cat.default, 2): "rope",
        (aten.add.Tensor, 3): "out_proj_add",
        (aten.mul.Tensor, 14): "norm2",
        (aten.mul.Tensor, 15): "act",
        (aten.add.Tensor, 4): "fc2_add",
    }
    meta = defaultdict(int)

    def policy_fn(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        save = False
        if func == aten.mm.default:
            meta[mode] += 1
            index = meta[mode]
            unit = type("U", (), {"name": matmul_names[index - 1], "matmul": True})()
            save = policy.keeps(unit, index)
        elif func in attention_ops:
            save = "attention" in policy.names
        elif func in (aten.mul.Tensor, aten.cat.default, aten.add.Tensor):
            meta[mode, func] += 1
            save = elementwise.get((func, meta[mode, func])) in policy.names
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


@pytest.mark.parametrize(
    "policy_text_",
    [
        TORCHTITAN_POLICY,
        "sac:matmuls",
        "sac:attention",
        "sac:wq,wo,w2,attention",
        # the element-wise units: norms, RoPE, residual adds, the SwiGLU product
        "sac:norm1,rope,v_proj,attention,out_proj_add,norm2,gate_proj,up_proj,act",
        "sac:v_proj,rope,attention,out_proj_add,gate_proj,up_proj,act",
        "sac:norm1,norm2,fc2_add",
        "sac:matmuls,act,out_proj_add",
    ],
)
def test_torch_selective_checkpoint_keeps_the_predicted_bytes(policy_text_):
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    spec = small()
    policy = parse_policy(policy_text_)
    torch.manual_seed(0)
    block = _torch_block(torch, spec)
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, requires_grad=True)
    modes = []

    def context_fn():
        pair = create_selective_checkpoint_contexts(_policy_fn(torch, spec, policy))
        modes.append(pair[0])
        return pair

    out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    storages = {}
    for entries in modes[0].storage.values():
        for wrapped in entries.values():
            values = wrapped if isinstance(wrapped, tuple) else (wrapped,)
            for value in values:
                tensor = getattr(value, "val", None)
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    layer_input = x.numel() * x.element_size()
    assert sum(storages.values()) + layer_input == policy_tape_bytes(spec, policy)
    # and the step is the plain one
    out.sum().backward()
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    block(x).sum().backward()
    for got, want in zip(grads, [p.grad for p in block.parameters()] + [x.grad], strict=True):
        torch.testing.assert_close(got, want)


# ---- exports ------------------------------------------------------------------------------------


def test_torchtitan_exports_sac_as_op_level_ac_and_reads_it_back():
    from ckplan import exports
    from ckplan.exports.torchtitan import strategy_from_arguments, strategy_from_toml

    spec = spec_from_mapping({**SMALL, "layers": 4, "vocab": 128})
    plan = evaluate(spec, parse_strategy("sac", spec))
    text = exports.export(plan, "torchtitan", version="0.2").text
    assert 'mode = "selective"' in text and 'selective_ac_option = "op"' in text
    assert strategy_from_toml(text) == "sac"
    # 0.3.0's SelectiveAC keeps more on its fused-wqkv, FlexAttention Llama 3 block
    plan = evaluate(unbiased := spec.replace(bias=False), parse_strategy("sac", unbiased))
    assert "fused wqkv" in exports.why_not(plan, "torchtitan")
    assert strategy_from_arguments("--x 1 activation-checkpoint:selective") == "sac-fused"
    # sac-fused is 0.3.0's SelectiveAC: written as its subcommand, refused for 0.2.x
    plan = evaluate(unbiased, parse_strategy("sac-fused", unbiased))
    assert plan.strategy == "sac-fused"
    text = exports.export(plan, "torchtitan").text
    assert text.split()[-1] == "activation-checkpoint:selective"
    assert strategy_from_arguments(text) == "sac-fused"
    assert "--torchtitan-version 0.3" in exports.why_not(plan, "torchtitan", version="0.2")
    biased = evaluate(spec, parse_strategy("sac-fused", spec))
    assert "aten.addmm" in exports.why_not(biased, "torchtitan")


def test_sac_fused_counts_the_fused_qkv_once_and_keeps_flex_attention_whole():
    from ckplan.model.op import LayerShapes
    from ckplan.model.op_policy import (
        TORCHTITAN_03_POLICY,
        flex_region_copy_bytes,
        policy_fit_reason,
        rerun_units,
    )

    spec = spec_from_mapping({**SMALL, "bias": False})
    fused = parse_policy("sac-fused")
    assert policy_text(fused) == TORCHTITAN_03_POLICY
    assert parse_policy(TORCHTITAN_03_POLICY) == fused
    # wqkv (1st mm) kept whole, wo (2nd) re-run, w1 kept, w3 re-run, w2 kept
    assert kept_units(spec, fused) == (
        "q_proj", "k_proj", "v_proj", "rope", "attention", "gate_proj", "fc2"
    )  # fmt: skip
    # without the fused count the same rule keeps wq and wv (1st, 3rd) and re-runs wk
    assert "k_proj" not in kept_units(spec, parse_policy("sac:matmuls%2,flex_attention"))
    shapes = LayerShapes.of(spec)
    v_bytes = shapes.B * shapes.tokens * spec.kv_heads * spec.head_dim
    assert flex_region_copy_bytes(spec, fused) == v_bytes
    assert flex_region_copy_bytes(spec, parse_policy("sac")) == 0
    assert policy_fit_reason(spec, parse_policy("sac")) is None
    # compiled (tests/test_torchtitan_sac.py): the flex_attention operator's outputs kept, the
    # rotated Q and K re-run, no copy of V
    compiled = spec.replace(kernels="compiled")
    assert policy_fit_reason(compiled, fused) is None
    assert kept_units(compiled, fused) == (
        "q_proj", "k_proj", "v_proj", "attention", "gate_proj", "fc2"
    )  # fmt: skip
    assert flex_region_copy_bytes(compiled, fused) == 0
    assert "rope" in {unit.name for unit in rerun_units(compiled, fused)}
    mla = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
           "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_heads": 4}  # fmt: skip
    assert "not MLA" in policy_fit_reason(small(**mla, bias=False), fused)


@pytest.mark.parametrize(
    ("strategy", "target", "fragment"),
    [
        ("sac", "megatron", "not ops chosen by a policy"),
        ("sac", "deepspeed", "no DeepSpeed option"),
        ("sac:attention", "torchtitan", "is the policy sac (0.2.x) or sac-fused (0.3.0) only"),
        ("sac+block:1", "torchtitan", "one activation-checkpoint mode"),
        ("sac-fused+block:1", "torchtitan", "one activation-checkpoint mode"),
        ("sac-fused", "torch", "not torchtitan 0.3.0's fused wqkv"),
    ],
)
def test_targets_that_cannot_run_a_policy_say_why(strategy, target, fragment):
    from ckplan import exports

    spec = spec_from_mapping({**SMALL, "layers": 4, "vocab": 128})
    plan = evaluate(spec, parse_strategy(strategy, spec))
    assert fragment in exports.why_not(plan, target)


@pytest.mark.parametrize("strategy", ["sac", "sac+block:1", "sac:wo,w2,attention"])
def test_exported_policy_fn_keeps_the_predicted_bytes(strategy):
    """The torch export's policy_fn, run on two torchtitan-style blocks: what its selective
    checkpoints keep is ckplan's tape, layer by layer, and the gradients are the plain step's."""
    from needs_torch import torch_or_skip

    torch = torch_or_skip()

    from ckplan.model import memory

    spec = small()
    plan = evaluate(spec, parse_strategy(strategy, spec))
    namespace, modes = recording_snippet(plan)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([_torch_block(torch, spec) for _ in range(spec.layers)])
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, requires_grad=True)
    out = namespace["forward_layers"](layers, x)
    forward_modes = list(modes)  # a re-forward adds its own contexts
    kept = sum(
        tensor.untyped_storage().nbytes()
        for mode in forward_modes
        for entries in mode.storage.values()
        for wrapped in entries.values()
        for value in (wrapped if isinstance(wrapped, tuple) else (wrapped,))
        if isinstance(tensor := getattr(value, "val", None), torch.Tensor)
    )
    stored_layers = sum(
        end - start for start, end, recompute in plan_segments(plan) if not recompute
    )
    assert len(forward_modes) == stored_layers
    X = memory.layer_input_bytes(spec)
    assert kept == stored_layers * (
        memory.selective_activation_bytes_per_layer(spec, plan.recompute_groups) - X
    )
    out.sum().backward()
    grads = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    layers.zero_grad()
    x.grad = None
    hidden = x
    for layer in layers:
        hidden = layer(hidden)
    hidden.sum().backward()
    for got, want in zip(grads, [p.grad for p in layers.parameters()] + [x.grad], strict=True):
        torch.testing.assert_close(got, want)


def plan_segments(plan):
    from ckplan.exports.segments import layer_segments

    return layer_segments(plan).segments


# ---- the best per-op policy ---------------------------------------------------------------------


def _strictly_better(points):
    """The (tape, cost) points, by tape, each cheaper than the last kept by more than 1e-12."""
    kept = []
    for tape, cost in points:
        if not kept or cost < kept[-1][1] - 1e-12 * max(1.0, abs(kept[-1][1])):
            kept.append((tape, cost))
    return kept


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
@pytest.mark.parametrize("changes", [{}, {"tp": 2, "sp": True}])
def test_frontier_is_the_brute_force_pareto_set(changes, kernels):
    """Every subset of unit names kept, its tape and its re-run (`rerun_mask`, eager replay or
    the compiled graph's) by brute force: the frontier holds exactly the non-dominated ones."""
    from itertools import combinations

    from ckplan.inputs.gpus import load_gpu
    from ckplan.model.op_policy import OpPolicy, replays, rerun_mask, unit_ops
    from ckplan.plan.policy_search import policy_frontier, rerun_cost

    for gpu in (None, load_gpu("h100-sxm")):
        spec = small(**changes, kernels=kernels)
        units = unit_ops(spec)
        names = list(dict.fromkeys(u.name for u in units))
        best = {}
        for size in range(len(names) + 1):
            for chosen in combinations(names, size):
                kept = tuple(u.name in chosen for u in units)
                tape = policy_tape_bytes(spec, OpPolicy(frozenset(chosen)))
                again = rerun_mask(units, kept, replays(spec))
                cost = rerun_cost(
                    spec, tuple(u for u, a in zip(units, again, strict=True) if a), gpu
                )
                best[tape] = min(best.get(tape, cost), cost)
        brute = _strictly_better(sorted(best.items()))
        # sums in another order differ in the last bits: ties within 1e-12 are ties
        frontier = _strictly_better([(p.tape_bytes, p.cost) for p in policy_frontier(spec, gpu)])
        assert [t for t, _ in frontier] == [t for t, _ in brute]
        for (_, got), (_, want) in zip(frontier, brute, strict=True):
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_frontier_points_are_policies_with_their_tape():
    from ckplan.plan.policy_search import policy_frontier

    spec = small()
    for point in policy_frontier(spec):
        if point.kept:
            assert policy_tape_bytes(spec, parse_policy(point.strategy)) == point.tape_bytes
            strategy = parse_strategy(point.strategy, spec)
            assert strategy.policy == policy_text(parse_policy(point.strategy))


def test_best_policy_within_a_budget():
    from ckplan.plan.policy_search import best_policy, policy_frontier

    spec = small()
    frontier = policy_frontier(spec)
    assert frontier[0].kept == () and frontier[-1].cost == 0
    everything = frontier[-1].tape_bytes
    assert best_policy(spec, everything).cost == 0
    assert best_policy(spec, frontier[0].tape_bytes - 1) is None
    middle = frontier[len(frontier) // 2]
    assert best_policy(spec, middle.tape_bytes).cost == middle.cost


def test_sweep_offers_the_best_policy_that_fits(spec_of):
    """Llama-3-8B, two 8,192-token sequences per H100, ZeRO-3 over 8 under DeepSpeed (its
    layers take any policy, through the torch export): the frontier's best fitting policy is in
    the sweep, fits, and is no slower than torchtitan 0.2's sac. Under torchtitan the sweep
    offers only the policy its 0.3.0 release runs, sac-fused, in every layer: no frontier
    policy, no sac, no sac-fused beside other layers."""
    from ckplan.inputs.gpus import load_gpu
    from ckplan.plan.search import sweep

    spec = spec_of("llama3-8b", micro_batch=2, dp=8, zero=3, framework="deepspeed")
    gpu = load_gpu("h100-sxm")
    result = sweep(spec, gpu.memory_bytes, gpu=gpu)
    by_name = {c.plan.strategy: c for c in result.candidates}
    policies = [c for name, c in by_name.items() if name.startswith("sac:")]
    assert len(policies) == 1 and policies[0].fits
    assert policies[0].time.step_seconds <= by_name["sac"].time.step_seconds
    assert result.best.time.step_seconds <= policies[0].time.step_seconds
    titan = sweep(spec.replace(framework="torchtitan"), gpu.memory_bytes, gpu=gpu)
    names = {c.plan.strategy for c in titan.candidates}
    # sac-fused alone: beside other layers (+block:N, +mixed) no export writes it
    assert "sac-fused" in names
    assert not any(name.startswith("sac-fused+") for name in names)
    assert not any(name == "sac" or name.startswith(("sac+", "sac:")) for name in names)


def test_plan_tries_policies_where_the_framework_runs_pytorch_modules(cli):
    """`ckplan plan` evaluates `sac`, `sac+block:N` and the best per-op policy on layouts of
    torchtitan (PyTorch modules), never on Megatron-LM's (which has no per-op policies)."""
    import json

    argv = ["plan", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--seq", "32768",
            "--global-batch", "8", "--top", "8", "--json"]  # fmt: skip
    code, out, _ = cli(*argv, "--set", "framework=torchtitan")
    assert code == 0
    plans = [layout["strategy"] for layout in json.loads(out)["layouts"]]
    assert any(plan.startswith("sac") for plan in plans)
    code, out, _ = cli(*argv)
    assert code == 0
    assert not any(layout["strategy"].startswith("sac") for layout in json.loads(out)["layouts"])


def test_compiled_layer_does_not_save_what_no_backward_reads():
    # eager: 49,664 bytes (test_torchtitan_tape_by_hand); compiled, w2's output (32·64·4) is
    # not saved: it feeds only the closing residual add (validation/torch_float8_sac.py)
    policy = parse_policy("sac")
    assert policy_tape_bytes(small(kernels="compiled"), policy) == 49_664 - 32 * 64 * 4 == 41_472
    # tp 2 with SP: w2's partial sums (32·64·4) and its reduce-scattered output (16·64·4) too;
    # the attention's reduce-scatter is read (norm2's input is rebuilt from it)
    spec = small(tp=2, sp=True)
    eager = policy_tape_bytes(spec, policy)
    compiled = policy_tape_bytes(small(tp=2, sp=True, kernels="compiled"), policy)
    assert eager - compiled == 4 * (32 * 64 + 16 * 64) == 12_288
    # a policy that does not keep w2 saves the same bytes either way
    q_only = parse_policy("sac:q_proj")
    compiled = small(kernels="compiled")
    assert policy_tape_bytes(compiled, q_only) == policy_tape_bytes(small(), q_only)


def _mixed_plan():
    """A `sac+mixed` plan of six small layers that stores the full tape in some layers and
    torchtitan's policy's in others (the FLOPs DP, the smallest budget that gives one)."""
    from ckplan.exports.segments import LayerSegments, layer_segments

    spec = spec_from_mapping({**SMALL, "layers": 6, "vocab": 128})
    full = evaluate(spec, parse_strategy("none", spec)).activation_bytes
    for step in range(1, 41):
        plan = evaluate(spec, parse_strategy("sac+mixed", spec), budget=full * step // 40)
        if plan is None:
            continue
        layers = layer_segments(plan)
        if isinstance(layers, LayerSegments) and layers.policy_layers:
            stored = [i for s, e, again in layers.segments if not again for i in range(s, e)]
            if set(layers.policy_layers) < set(stored):
                return spec, plan, layers
    raise AssertionError("no budget mixes the two tapes")


def test_mixed_plan_exports_a_wrapper_per_layer():
    """The torch export of a `sac+mixed` plan, run on ckplan's torch blocks: the layers the plan
    stores under the policy run under selective checkpointing and keep its tape (beside their
    input), the other stored layers run plain, the recomputed segments keep only their input;
    the gradients are the plain step's."""
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    import torch.utils.checkpoint as checkpoint_module

    spec, plan, layers = _mixed_plan()
    namespace, modes = recording_snippet(plan)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_torch_block(torch, spec) for _ in range(spec.layers)])
    wrapped = []

    def checkpoint(fn, *args, **kwargs):
        if "context_fn" in kwargs:
            wrapped.append(next(i for i, block in enumerate(blocks) if block is fn))
        return checkpoint_module.checkpoint(fn, *args, **kwargs)

    namespace["checkpoint"] = checkpoint
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, requires_grad=True)
    out = namespace["forward_layers"](blocks, x)
    forward_modes = list(modes)
    assert wrapped == list(layers.policy_layers)
    X = x.numel() * x.element_size()
    policy = parse_policy(plan.recompute_groups[0])
    for mode in forward_modes:
        kept = cached_storages(torch, [mode])
        assert sum(kept.values()) + X == policy_tape_bytes(spec, policy)
    out.sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad()
    x.grad = None
    hidden = x
    for block in blocks:
        hidden = block(hidden)
    hidden.sum().backward()
    for got, want in zip(grads, [p.grad for p in blocks.parameters()] + [x.grad], strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("target", ["torchtitan", "megatron", "deepspeed"])
def test_mixed_plan_other_targets_say_why(target):
    from ckplan import exports

    _, plan, _ = _mixed_plan()
    because = exports.why_not(plan, target)
    assert because is not None and "full tape in some layers" in because


def test_rope_unit_moves_q_and_k_twice_and_eager_code_more():
    """RoPE's re-run is timed by its bytes (`rope_moved_bytes`): it reads Q and K and writes
    them rotated; eager code moves code_path's eager_rope_bytes per element of Q and K instead."""
    from ckplan.hardware.code_path import eager_rope_bytes, spec_code_path
    from ckplan.hardware.roofline import memory_seconds
    from ckplan.inputs.gpus import load_gpu
    from ckplan.model.op import LayerShapes
    from ckplan.model.op_policy import rope_moved_bytes, unit_ops

    gpu = load_gpu("h100-sxm")
    for kernels in ("eager", "compiled"):
        spec = small(kernels=kernels)
        (rope,) = [unit for unit in unit_ops(spec) if unit.name == "rope"]
        # 32 tokens, Q 4 heads and K 2 of 16 dims, 4 bytes: read 32·6·16·4, written as much
        assert rope.op.forward_bytes == rope_moved_bytes(spec, LayerShapes.of(spec)) == 24_576
        assert rope.op.forward_flops == 0 and rope.op.matmul is None
        elements = 32 * 6 * 16
        eager = eager_rope_bytes(spec.dtype_bytes)[0] * elements
        moved = eager if kernels == "eager" else 24_576
        timed = spec_code_path(spec, gpu).forward(rope.op, spec.dtype_bytes)
        assert timed.total == pytest.approx(memory_seconds(gpu, moved), rel=1e-12)
    # tensor parallel: a rank rotates its own heads (2 of Q's, 1 of K's)
    spec = small(tp=2, sp=True)
    assert rope_moved_bytes(spec, LayerShapes.of(spec)) == 2 * 4 * 32 * 3 * 16


def test_a_policy_that_reruns_rope_costs_its_time():
    """On a GPU a policy re-running RoPE costs that unit's forward time more than one keeping
    it (the rest of the layer alike)."""
    from ckplan.hardware.code_path import spec_code_path
    from ckplan.inputs.gpus import load_gpu
    from ckplan.model.op_policy import rerun_units, unit_ops
    from ckplan.plan.policy_search import unit_cost

    gpu = load_gpu("h100-sxm")
    spec = small(kernels="compiled")
    (rope,) = [unit for unit in unit_ops(spec) if unit.name == "rope"]
    cost = unit_cost(spec, rope, gpu)
    assert cost == spec_code_path(spec, gpu).forward(rope.op, spec.dtype_bytes).total > 0
    kept = parse_policy("sac:q_proj,k_proj,v_proj,rope,attention")
    again = parse_policy("sac:q_proj,k_proj,v_proj,attention")
    assert "rope" in {u.name for u in rerun_units(spec, again)}
    assert "rope" not in {u.name for u in rerun_units(spec, kept)}
