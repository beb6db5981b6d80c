"""Megatron-Core's hierarchical context parallelism (`cp_attention: a2a+p2p` with
`cp_a2a_size`, Megatron's `--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes`):
Transformer Engine's point-to-point class behind all-to-alls over groups of `cp_a2a_size`
ranks. Its rules, the tensors its all-to-alls send, its own ops' bytes and its backward's
transient by hand and as counted on TE's own text, the step's collectives and the export."""

from __future__ import annotations

import pytest
from megatron_args import MegatronArgError, parse, validate
from test_te_context_parallel import SMALL, wheel_source

from ckplan import exports
from ckplan.hardware import communication as comm
from ckplan.hardware.step_time import context_parallel_comm
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.context_parallel import (
    cp_moved_bytes,
    hierarchical_sizes,
    node_a2a_size,
    te_hierarchical_a2a_moved_bytes,
    te_hierarchical_a2a_sent_bytes,
    te_hierarchical_backward_workspace_bytes,
    te_p2p_moved_bytes,
)
from ckplan.model.ops import layer_ops
from ckplan.model.spec import SpecError
from ckplan.plan import evaluate, parse_strategy


def llama_8b(**changes):
    """Llama 3 8B under Megatron-Core at CP 8 (all-to-alls over 2, a ring over 4) on TP 2
    (16 query, 4 K/V heads a rank), 65,536 tokens."""
    values = {
        "framework": "megatron",
        "tp": 2,
        "sp": True,
        "cp": 8,
        "dp": 1,
        "seq": 65536,
        "micro_batch": 1,
        "attention": "flash",
        "cp_attention": "a2a+p2p",
        "cp_a2a_size": 2,
        **changes,
    }
    return load_spec("llama3-8b", values)


def core(spec):
    return next(op for op in layer_ops(spec.chain) if op.name == "attention_core")


# 8,192 tokens a rank before the all-to-alls, bf16, head size 128
Q = OUT = 8192 * 16 * 128 * 2
KV = 8192 * 4 * 128 * 2


def test_the_groups():
    assert hierarchical_sizes(llama_8b()) == (2, 4)
    assert hierarchical_sizes(llama_8b(cp=4, cp_attention="a2a", cp_a2a_size=None)) == (4, 1)
    assert hierarchical_sizes(llama_8b(cp_attention="ring", cp_a2a_size=None)) == (1, 8)


def test_the_tensors_its_all_to_alls_send_by_release():
    """Q, K, V before the ring and O after it; backward O and dO before it up to v2.14, dO
    alone from v2.15, then dQ, dK, dV."""
    forward, backward = te_hierarchical_a2a_sent_bytes("te2.9", Q, KV, KV, OUT)
    assert forward == (Q, KV, KV, OUT)
    assert backward == (OUT, OUT, Q, KV, KV)
    assert te_hierarchical_a2a_sent_bytes("te2.15", Q, KV, KV, OUT)[1] == (OUT, Q, KV, KV)
    assert te_hierarchical_a2a_moved_bytes("te2.16", Q, KV, KV, OUT) == (
        4 * (2 * Q + 2 * KV),
        4 * (2 * Q + 2 * KV),
    )


def test_its_own_ops_are_the_rings_over_fewer_ranks_and_the_all_to_alls():
    """The ring's loops see the rank's values at the ring's size (4 of 8): the same Q, K/V
    and logsumexp counts, s·2/cp tokens at half the heads."""
    spec = llama_8b()
    q_values, kv_values, lse = 8192 * 16 * 128, 8192 * 4 * 128, 8192 * 16
    ring = te_p2p_moved_bytes("te2.16", 4, q_values, kv_values, lse)
    a2a = te_hierarchical_a2a_moved_bytes("te2.16", Q, KV, KV, OUT)
    assert cp_moved_bytes(spec, 16, 4) == (ring[0] + a2a[0], ring[1] + a2a[1])
    assert core(spec).side_bytes == cp_moved_bytes(spec, 16, 4)


def test_what_the_attention_core_saves_and_holds():
    """From v2.15 the kernel's output is saved beside the one returned; the backward keeps
    dO (and O up to v2.14) after their all-to-alls and sends dQ, dK, dV back one by one."""
    ring = core(llama_8b(cp_attention="ring", cp_a2a_size=None))
    assert core(llama_8b()).saved_bytes - ring.saved_bytes == OUT
    assert core(llama_8b(framework_version="te2.14")).saved_bytes == ring.saved_bytes
    sent = max(3 * Q + 2 * KV + KV, 2 * Q + 3 * KV + 2 * KV, 2 * Q + 2 * KV + 3 * KV)
    hold = te_hierarchical_backward_workspace_bytes
    assert hold("te2.14", Q, KV, KV, OUT, 0, 0) == 2 * OUT + sent
    assert hold("te2.16", Q, KV, KV, OUT, 0, 0) == OUT + sent
    big = 10 * sent
    assert hold("te2.16", Q, KV, KV, OUT, big, 0) == OUT + big
    # the ring's buffers after its loops stay beside the sends
    assert hold("te2.16", Q, KV, KV, OUT, 0, Q + 8 * KV) == OUT + Q + 8 * KV + sent
    # the attention core: the ring over 4 ranks at v2.16 (q + 8·kv at a call and after)
    ring = Q + 8 * KV
    workspace = core(llama_8b()).grad_workspace_bytes
    kernel = core(llama_8b(cp_attention="ring", cp_a2a_size=None)).grad_workspace_bytes - ring
    assert workspace == OUT + max(ring + kernel, ring + sent)


def test_the_step_exposes_the_all_to_alls_and_hides_a_shorter_ring():
    """The all-to-alls run over 2 ranks 2 apart, none hidden; the ring's three sends of
    the rank's K‖V run over 4 ranks 4 apart (two nodes of 8: the network), behind the core."""
    spec, gpu = llama_8b(), load_gpu("h100-sxm")
    each = [comm.hierarchical_all_to_all_seconds(size, 2, 2, gpu) for size in (Q, KV, KV, OUT)]
    forward, _ = context_parallel_comm(spec, gpu, _Seconds(0.0), _Seconds(0.0))
    ring = 3 * comm.p2p_seconds(2 * KV, comm.group_bandwidth(gpu, 4, 4))
    assert forward == pytest.approx(sum(each) + ring)
    hidden, _ = context_parallel_comm(spec, gpu, _Seconds(1.0), _Seconds(1.0))
    assert hidden == pytest.approx(sum(each))


class _Seconds:
    def __init__(self, total):
        self.total = total


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cp_a2a_size": None}, "key 'cp_a2a_size': cp_attention a2a+p2p needs"),
        ({"cp_a2a_size": 3}, "key 'cp_a2a_size' (3) must divide cp (8)"),
        ({"cp_a2a_size": 8}, "is the ring or a2a"),
        ({"framework_version": "te1.11"}, "te1.11 has no a2a+p2p context parallelism"),
        ({"tp": 8, "cp": 4}, "cp_a2a_size (2) must divide the query heads (4) and K/V heads (1)"),
        ({"cp_attention": "ring"}, "sizes the all-to-all groups of cp_attention a2a+p2p"),
    ],
)
def test_what_it_cannot_run(changes, message):
    with pytest.raises(SpecError) as error:
        llama_8b(**changes)
    assert message in str(error.value)


def test_mla_runs_on_it_and_a_window_does_not():
    values = {"framework": "megatron", "cp": 4, "dp": 2, "seq": 4096}
    values |= {"cp_attention": "a2a+p2p", "cp_a2a_size": 2}
    assert load_spec("deepseek-v3", values).cp == 4
    with pytest.raises(SpecError, match="sliding-window attention under context parallelism"):
        load_spec("mistral-7b", values)


def test_the_export_gives_both_sizes_and_megatron_takes_them():
    spec = llama_8b()
    text = exports.export(evaluate(spec, parse_strategy("none", spec)), "megatron").text
    args = validate(parse(text, 16))
    assert args.cp_comm_type == ["a2a+p2p"]
    assert args.hierarchical_context_parallel_sizes == [2, 4]
    without = text.replace("--hierarchical-context-parallel-sizes 2 4", "")
    with pytest.raises(MegatronArgError, match="hierarchical-context-parallel-sizes must be set"):
        validate(parse(without, 16))


@pytest.mark.parametrize("release", ("1.13.0", "2.4.0", "2.9.0", "2.16.0"))
def test_transformer_engines_own_class_moves_and_holds_what_is_counted(release):
    """TE's own `AttnFuncWithCPAndKVP2P` from the release's wheel with a list of two groups,
    run by validation/te_cp_p2p_traffic.py at cp 4 (2 x 2): the mean over the ring's ranks
    moves the ring's `te_p2p_moved_bytes` at 2 and the all-to-alls' bytes (a whole byte's
    rounding); its backward holds beyond the ring alone what ckplan counts (at most, up to
    v2.7, where the ring's own peak comes before its end)."""
    harness, source, ours = wheel_source(release)
    a, s, d = SMALL["a"], SMALL["s"], SMALL["d"]
    for kv_heads in (4, 2):
        seen = [harness.measure(source, 4, r, SMALL, kv_heads, "a2a+p2p") for r in range(2)]
        mean = (sum(f for f, _ in seen) / 2, sum(g for _, g in seen) / 2)
        ring = te_p2p_moved_bytes(ours, 2, s * a * d, s * kv_heads * d, s * a)
        tensors = (2 * s * a * d, 2 * s * kv_heads * d, 2 * s * kv_heads * d, 2 * s * a * d)
        a2a = te_hierarchical_a2a_moved_bytes(ours, *tensors)
        assert mean == pytest.approx((ring[0] + a2a[0], ring[1] + a2a[1]), abs=1)
        assert not harness._check_hierarchical_memory(source, ours, 4, SMALL, kv_heads)


def test_plan_puts_each_all_to_all_group_inside_a_node():
    """The groups' size `plan` tries where the cp group spans nodes: the largest that divides
    cp, stays below it, fits a node with tp and splits the rank's heads (Llama 3 8B: 8 K/V
    heads)."""
    spec = llama_8b(cp_attention=None, cp_a2a_size=None, tp=1, sp=False, cp=1)
    assert node_a2a_size(spec, 1, 16, 8) == 8
    assert node_a2a_size(spec, 2, 16, 8) == 4
    assert node_a2a_size(spec, 4, 8, 8) == 2
    assert node_a2a_size(spec, 1, 12, 8) == 4  # 6 does not split 8 K/V heads
    assert node_a2a_size(spec, 1, 8, 8) is None  # the cp group is one node's
    assert node_a2a_size(spec, 8, 4, 8) is None  # one K/V head a rank
    assert node_a2a_size(spec, 1, 2, 8) is None  # two levels need cp > the group


def test_plan_tries_it_and_says_its_levels():
    """Under Megatron-Core with no cp_attention given, each cp > 1 layout is also tried with
    a2a+p2p at `node_a2a_size`; the table shows both levels, the JSON the groups' size, and
    the layout's keys rebuild it."""
    from ckplan.plan.layout.search import search_layouts
    from ckplan.plan.layout.space import SearchSpace, cp_attentions, layouts
    from ckplan.render.layouts import layout_text

    spec = llama_8b(cp_attention=None, cp_a2a_size=None, tp=1, sp=False, cp=1, seq=262144)
    assert ("a2a+p2p", 4) in cp_attentions(spec, 2, 16, 8)
    assert ("a2a+p2p", 8) not in cp_attentions(spec, 2, 16, 8)
    hierarchical = [
        lay for lay in layouts(SearchSpace(spec, 64, 8, 8, {})) if lay.cp_attention == "a2a+p2p"
    ]
    assert hierarchical and all(
        lay.cp_a2a_size == node_a2a_size(spec, lay.tp, lay.cp, 8) for lay in hierarchical
    )
    layout = next(lay for lay in hierarchical if (lay.tp, lay.cp) == (2, 16))
    assert "cp 16 a2a 4+p2p 4" in layout_text(layout)
    keys = layout.keys(False)
    assert keys["cp_attention"] == "a2a+p2p" and keys["cp_a2a_size"] == 4
    assert "cp_a2a_size" not in next(
        lay for lay in layouts(SearchSpace(spec, 64, 8, 8, {})) if lay.cp_attention == "ring"
    ).keys(False)
    result = search_layouts(spec, 64, load_gpu("h100-sxm"), 8, 80 * 2**30, top=40)
    assert any(e.layout.cp_attention == "a2a+p2p" for e in result.layouts)
