"""Megatron-Core's --recompute-modules as strategy terms (ckplan.model.modules): hand-computed
bytes per module on small layers, the backward walk's consistency, the strategy grammar, the
sweep's candidates and the Megatron export."""

import pytest

from ckplan.exports.megatron import strategy_from_flags
from ckplan.inputs.presets import load_spec, spec_from_values
from ckplan.model import flops, memory
from ckplan.model.layers import layer_kinds
from ckplan.model.modules import LAYERNORM, MLA_UP_PROJ, MOE_ACT
from ckplan.model.moe import SHARED_EXPERTS
from ckplan.model.op import ATTENTION_CORE, DENSE_MLP
from ckplan.model.ops import layer_ops
from ckplan.plan.layout import bounds
from ckplan.plan.search import candidate_strategies
from ckplan.plan.strategies import StrategyError, parse_strategy

S, BATCH, H, A, G, F_FFN = 64, 2, 32, 4, 2, 96
T = S * BATCH  # tokens
B = 2


def small(**keys):
    values = {
        "name": "small",
        "kind": "transformer",
        "layers": 2,
        "hidden": H,
        "heads": A,
        "kv_heads": G,
        "ffn_hidden": F_FFN,
        "vocab": 128,
        "seq": S,
        "micro_batch": BATCH,
        "dtype_bytes": B,
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "attention": "flash",
        "positions": "rope",
        "bias": False,
        "dropout": 0.0,
    }
    return spec_from_values(values | keys)


def moe_small(**keys):
    return small(
        experts=4, top_k=2, moe_ffn_hidden=48, shared_experts=1, shared_ffn_hidden=64, **keys
    )


def mla_small(**keys):
    mla = {
        "kv_heads": A,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
    }
    return small(**(mla | keys))


def tape(spec, groups=()):
    return memory.selective_activation_bytes_per_layer(spec, tuple(groups))


# ---- hand-computed bytes ----------------------------------------------------------------


def test_layernorm_drops_both_norm_outputs():
    spec = small()
    # norm1's output (saved by qkv_proj) and norm2's (saved by fc1): B·s·b·h each
    assert tape(spec) - tape(spec, [LAYERNORM]) == 2 * B * T * H
    # with the dense MLP recomputed its kept input is norm2's output: still dropped once
    mlp_only = tape(spec, [DENSE_MLP])
    assert mlp_only - tape(spec, [DENSE_MLP, LAYERNORM]) == 2 * B * T * H


def test_layernorm_under_sequence_parallelism_and_fp8():
    spec = small(tp=2, sp=True)
    assert tape(spec) - tape(spec, [LAYERNORM]) == 2 * B * T * H // 2
    fp8 = small(precision="fp8")
    # TE's FP8 linears save a 1-byte copy; Megatron then saves the discarded original instead
    assert tape(fp8) - tape(fp8, [LAYERNORM]) == 2 * T * H


def test_layernorm_in_a_moe_layer():
    spec = moe_small()
    # norm2's output is saved once (the router; the shared experts read the same storage)
    assert tape(spec) - tape(spec, [LAYERNORM]) == 2 * B * T * H
    assert tape(spec, ["moe"]) - tape(spec, ["moe", LAYERNORM]) == 2 * B * T * H


def test_moe_act_drops_the_activation_output():
    spec = moe_small()
    rows = T * 2  # dropless, top-2
    assert tape(spec) - tape(spec, [MOE_ACT]) == B * rows * 48
    eager = moe_small(fused_swiglu=False)
    # eager silu(gate)·up keeps silu(gate) too; the checkpoint keeps only its inputs
    assert tape(eager) - tape(eager, [MOE_ACT]) == B * rows * 48 + B * rows * 48


def test_shared_experts_drop_their_tape_and_keep_nothing():
    spec = moe_small()
    # fc1 saves nothing (the router's input), the SwiGLU its input (2F), fc2 its input (F)
    assert tape(spec) - tape(spec, [SHARED_EXPERTS]) == B * T * (2 * 64 + 64)


def test_mla_up_proj_drops_q_k_v_and_the_normalised_latents():
    spec = mla_small()
    qkv = B * T * A * (2 * (8 + 4) + 8)
    latents = B * T * (24 + 16)  # q_up's and kv_up's saved (normalised) inputs
    rope_key = B * T * 4  # k_pos_emb, kept by the checkpoint
    assert tape(spec) - tape(spec, [MLA_UP_PROJ]) == qkv + latents - rope_key
    # with the attention core recomputed its kept input is Q, K, V: dropped as well
    core = tape(spec, [ATTENTION_CORE])
    assert core - tape(spec, [ATTENTION_CORE, MLA_UP_PROJ]) == qkv + latents - rope_key


def test_re_run_forward_flops():
    spec = mla_small()
    ops = {op.name: op for op in layer_ops(spec)}
    assert flops.group_forward_flops(spec, (LAYERNORM,)) == 0  # element-wise
    up = ops["q_up"].forward_flops + ops["kv_up"].forward_flops
    assert flops.group_forward_flops(spec, (MLA_UP_PROJ,)) == up
    # a module and a group that share no op add up
    core = flops.group_forward_flops(spec, (ATTENTION_CORE,))
    assert flops.group_forward_flops(spec, (ATTENTION_CORE, MLA_UP_PROJ)) == core + up


# ---- the backward walk ------------------------------------------------------------------

SPECS = {
    "dense": small,
    "dense-dropout-standard": lambda: small(dropout=0.1, attention="standard"),
    "dense-sp": lambda: small(tp=2, sp=True),
    "parallel-residual": lambda: small(parallel_residual=True, norm="layernorm", mlp="gelu"),
    "post-norms": lambda: small(post_norms=True),
    "moe": moe_small,
    "moe-gated-shared": lambda: moe_small(shared_expert_gate=True),
    "mla": mla_small,
    "mla-no-q-latent": lambda: mla_small(q_lora_rank=0),
    "mla-standard": lambda: mla_small(attention="standard"),
    "fp8": lambda: moe_small(precision="fp8"),
}


def _combinations(spec):
    modules = [LAYERNORM]
    if spec.experts:
        modules += [MOE_ACT, SHARED_EXPERTS]
    if spec.mla:
        modules += [MLA_UP_PROJ]
    bases = [(), (ATTENTION_CORE,), (DENSE_MLP,), ("moe",), ("moe/experts",)]
    for base in bases:
        for mask in range(1, 2 ** len(modules)):
            extra = tuple(m for i, m in enumerate(modules) if mask >> i & 1)
            if set(base) & {"moe", "moe/experts"} and {MOE_ACT, SHARED_EXPERTS} & set(extra):
                continue
            yield base + extra


@pytest.mark.parametrize("name", sorted(SPECS))
def test_walk_balances_and_tape_between_full_and_none(name):
    spec = SPECS[name]()
    for kind in dict.fromkeys(layer_kinds(spec)):
        none = memory.selective_activation_bytes_per_layer(spec, (), kind)
        full = memory.layer_input_bytes(spec)
        for groups in _combinations(spec):
            stored = memory.selective_activation_bytes_per_layer(spec, groups, kind)
            assert full <= stored <= none, groups
            walk = memory.layer_backward_walk(spec, groups, kind)  # raises if unbalanced
            # the walk starts from that tape (plus the residual gradient)
            assert walk[0].saved_bytes >= stored, groups
            # every module lowers the tape by what it drops, alone or beside others
            base = tuple(g for g in groups if g in (ATTENTION_CORE, DENSE_MLP, "moe"))
            assert stored <= memory.selective_activation_bytes_per_layer(spec, base, kind)


def test_walk_rebuilds_norm_outputs_before_the_consumer_blocks():
    """Megatron's re-run restores the discarded storage and keeps its own output for the norm's
    backward: two copies from the consumer block's last op until the consumer's backward."""
    spec = small()
    X = B * T * H
    plain = {p.op: p.saved_bytes for p in memory.layer_backward_walk(spec)}
    walk = {p.op: p.saved_bytes for p in memory.layer_backward_walk(spec, (LAYERNORM,))}
    # at fc2 and until norm2's backward: norm2's output restored and its re-run copy, norm1's
    # still dropped
    assert walk["fc2"] - plain["fc2"] == X - X
    assert walk["norm2"] - plain["norm2"] == X - X
    # from out_proj: norm1's output restored and its re-run copy
    assert walk["out_proj"] - plain["out_proj"] == X
    assert walk["qkv_proj"] - plain["qkv_proj"] == X  # norm1's copy, freed with norm1
    assert walk["norm1"] - plain["norm1"] == X
    assert memory.layer_backward_walk(spec, (LAYERNORM,))[-1].op == "norm1"


def test_moe_act_walk_holds_two_copies_at_fc2():
    spec = moe_small()
    plain = memory.layer_backward_walk(spec)
    walk = memory.layer_backward_walk(spec, (MOE_ACT,))
    assert [p.op for p in plain] == [p.op for p in walk]
    at = {p.op: (p.saved_bytes, q.saved_bytes) for p, q in zip(plain, walk, strict=True)}
    act_out = B * T * 2 * 48  # the activation output, R = T·k rows of F_e
    # stored: without it, until fc2's backward; then restored beside the re-run copy
    assert at["unpermute"][0] - at["unpermute"][1] == act_out
    assert at["expert_fc2"][1] - at["expert_fc2"][0] == act_out
    assert at["expert_act"][1] - at["expert_act"][0] == act_out  # the copy, until act's backward
    assert at["expert_fc1"][1] == at["expert_fc1"][0]


# ---- the grammar ----------------------------------------------------------------------


def test_grammar_names_and_groups():
    spec = moe_small()
    s = parse_strategy("layernorm+selective+block:1", spec)
    assert s.name == "selective+layernorm+block:1"
    assert s.groups == (ATTENTION_CORE, LAYERNORM)
    s = parse_strategy("shared_experts+moe_act+layernorm", spec)
    assert s.name == "layernorm+moe_act+shared_experts"
    assert s.groups == (LAYERNORM, MOE_ACT, SHARED_EXPERTS)
    assert parse_strategy("layernorm+full", spec).name == "uniform:1"
    assert parse_strategy("mla_up_proj", mla_small()).groups == (MLA_UP_PROJ,)


@pytest.mark.parametrize(
    ("text", "model", "fragment"),
    [
        ("mla_up_proj", "dense", "this model has none (attention is not MLA)"),
        ("moe_act", "dense", "moe_act recomputes part of MoE layers; this model has none"),
        ("shared_experts", "dense", "this model has none (experts: 0)"),
        ("moe+moe_act", "moe", "moe already recomputes what moe_act does"),
        ("experts+shared_experts", "moe", "experts already recomputes what shared_experts"),
        ("layernorm+layernorm", "dense", "layernorm cannot combine with itself"),
        ("layernrm", "dense", "did you mean 'layernorm'?"),
    ],
)
def test_grammar_refusals(text, model, fragment):
    spec = {"dense": small, "moe": moe_small}[model]()
    with pytest.raises(StrategyError, match=None) as error:
        parse_strategy(text, spec)
    assert fragment in str(error.value)


def test_shared_experts_need_shared_experts():
    spec = small(experts=4, top_k=2, moe_ffn_hidden=48)
    with pytest.raises(StrategyError, match=r"shared_ffn_hidden: 0"):
        parse_strategy("shared_experts", spec)


# ---- search, bounds, export -----------------------------------------------------------


def test_bounds_list_every_combination_a_strategy_runs():
    spec = mla_small(experts=4, top_k=2, moe_ffn_hidden=48, shared_experts=1, shared_ffn_hidden=64)
    for strategy in candidate_strategies(spec):
        if not strategy.policy:
            assert strategy.groups in bounds._GROUPS, strategy.name


def test_sweep_candidates_with_modules():
    names = {s.name for s in candidate_strategies(load_spec("llama3-8b"))}
    assert {"layernorm", "selective+layernorm", "selective+mlp+layernorm"} <= names
    assert not any("moe_act" in n or "mla_up_proj" in n for n in names)
    names = {s.name for s in candidate_strategies(load_spec("deepseek-v3"))}
    assert {"selective+mla_up_proj", "layernorm+moe_act+mla_up_proj+shared_experts"} <= names


def test_megatron_flags_read_back():
    flags = {
        "--recompute-granularity": ["selective"],
        "--recompute-modules": ["core_attn", "layernorm", "moe_act"],
    }
    assert strategy_from_flags(flags) == "selective+layernorm+moe_act"


@pytest.mark.parametrize(
    ("model", "name", "expected"),
    [
        ("llama3-8b", "layernorm+selective", ["core_attn", "layernorm"]),
        ("mixtral-8x7b", "moe_act+layernorm", ["layernorm", "moe_act"]),
        (
            "deepseek-v3",
            "selective+layernorm+moe_act+mla_up_proj+shared_experts",
            ["core_attn", "layernorm", "moe_act", "mla_up_proj", "shared_experts"],
        ),
    ],
)
def test_megatron_export_passes_the_mirror_and_reads_back(model, name, expected):
    """--recompute-modules as Megatron-Core core_v0.19.0's parser, validate_args and
    TransformerConfig's checks accept them (tests/megatron_args.py), read back to the plan."""
    from megatron_args import parse, validate

    from ckplan import exports
    from ckplan.exports import megatron
    from ckplan.plan import evaluate

    spec = load_spec(model)
    plan = evaluate(spec, parse_strategy(name, spec))
    text = exports.export(plan, "megatron").text
    args = validate(parse(text, 1))
    assert args.recompute_granularity == "selective"
    assert args.recompute_modules == expected
    assert megatron.strategy_from_flags(megatron.parse_flags(text)) == plan.strategy
    for target in ("torch", "deepspeed", "torchtitan"):
        assert "Megatron-Core's" in exports.why_not(plan, target)


def test_megatron_mirror_refuses_what_transformer_config_refuses():
    from megatron_args import MegatronArgError, parse, validate

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    base += "--max-position-embeddings 32 --micro-batch-size 1 --recompute-granularity selective "
    with pytest.raises(MegatronArgError, match="moe_grouped_gemm"):
        validate(parse(base + "--num-experts 4 --recompute-modules moe_act", 1))
    with pytest.raises(MegatronArgError, match="multi_latent_attention"):
        validate(parse(base + "--recompute-modules mla_up_proj", 1))


def test_megatron_mirror_refuses_delayed_fp8_with_discarding_modules():
    from megatron_args import MegatronArgError, parse, validate

    text = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 1 --bf16 --fp8-format hybrid "
        "--recompute-granularity selective --recompute-modules layernorm"
    )
    with pytest.raises(MegatronArgError, match="Delayed scaling"):
        validate(parse(text, 1))
    assert validate(parse(text + " --fp8-recipe tensorwise", 1)).recompute_modules == ["layernorm"]
