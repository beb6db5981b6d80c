"""Transformer Engine's all-to-all and all-gather context parallelism under Megatron-Core
(`cp_attention: a2a` and `allgather`, Megatron's `--cp-comm-type a2a` and `all_gather`): the
tensors they send, their own ops' bytes and their backward's transient by hand and as counted
on TE's own text, what the attention core saves, the step's exposed collectives, the key's
rules and the export."""

from __future__ import annotations

import pytest
from megatron_args import parse, validate
from test_te_context_parallel import SMALL, wheel_source

from ckplan import exports
from ckplan.hardware import communication as comm
from ckplan.hardware.step_time import context_parallel_comm, step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.context_parallel import (
    a2a_tensor_bytes,
    cp_moved_bytes,
    te_a2a_backward_workspace_bytes,
    te_a2a_moved_bytes,
    te_a2a_sent_bytes,
    te_allgather_backward_live_bytes,
    te_allgather_backward_workspace_bytes,
    te_allgather_moved_bytes,
)
from ckplan.model.ops import layer_ops
from ckplan.model.spec import SpecError
from ckplan.plan import evaluate, parse_strategy


def a2a_values(**changes):
    """Llama 3 8B under Megatron-Core at CP 4 on TP 2 (16 query, 4 K/V heads a rank), 32,768
    tokens, the all-to-all context parallelism."""
    return {
        "framework": "megatron",
        "tp": 2,
        "sp": True,
        "cp": 4,
        "dp": 1,
        "seq": 32768,
        "micro_batch": 1,
        "attention": "flash",
        "cp_attention": "a2a",
        **changes,
    }


def megatron_8b(**changes):
    return load_spec("llama3-8b", a2a_values(**changes))


def plan_of(spec):
    return evaluate(spec, parse_strategy("none", spec))


def core(spec):
    return next(op for op in layer_ops(spec.chain) if op.name == "attention_core")


# 8,192 tokens a rank before the all-to-alls, bf16, head size 128
Q = OUT = 8192 * 16 * 128 * 2
KV = 8192 * 4 * 128 * 2


def test_the_tensors_it_sends():
    assert a2a_tensor_bytes(megatron_8b(), 16, 4) == (Q, KV, KV, OUT)
    # forward Q, K, V, then the output; backward dO (and the output again up to v2.7), dQ, dK, dV
    assert te_a2a_sent_bytes("te2.9", Q, KV, KV, OUT) == ((Q, KV, KV, OUT), (OUT, Q, KV, KV))
    assert te_a2a_sent_bytes("te2.8", Q, KV, KV, OUT)[1] == (OUT, Q, KV, KV)
    assert te_a2a_sent_bytes("te2.7", Q, KV, KV, OUT)[1] == (OUT, OUT, Q, KV, KV)
    assert te_a2a_sent_bytes("te1.11", Q, KV, KV, OUT)[1] == (OUT, OUT, Q, KV, KV)


def test_its_own_ops_by_hand():
    """Each tensor is copied once (`.contiguous()`) and reordered once (`index_select`), each
    reading and writing it: 4 x its bytes, whatever cp."""
    assert te_a2a_moved_bytes("te2.9", Q, KV, KV, OUT) == (4 * (2 * Q + 2 * KV),) * 2
    assert te_a2a_moved_bytes("te2.3", Q, KV, KV, OUT) == (
        4 * (2 * Q + 2 * KV),
        4 * (3 * Q + 2 * KV),
    )
    assert cp_moved_bytes(megatron_8b(), 16, 4) == te_a2a_moved_bytes("te2.16", Q, KV, KV, OUT)
    assert core(megatron_8b()).side_bytes == te_a2a_moved_bytes("te2.16", Q, KV, KV, OUT)


def test_the_backward_transient_by_hand():
    """dO after its all-to-all beside the kernel; after it, the three gradients reordered,
    the one being received and copied, and the copies made: at Q = K = V = 1, 3 + 1 + 1 + 2 = 7
    at the second or third, 1 more for dO (2 up to v2.7, the output's own all-to-all)."""
    assert te_a2a_backward_workspace_bytes("te2.9", 1, 1, 1, 1, 0) == 1 + 7
    assert te_a2a_backward_workspace_bytes("te2.3", 1, 1, 1, 1, 0) == 2 + 7
    # K, V at half: max(3 + 1 + 0.5, 2 + 1.5 + 1, 2 + 1 + 1.5) = 4.5
    assert te_a2a_backward_workspace_bytes("te2.9", 2, 1, 1, 2, 0) == 2 + 9
    # the kernel's own workspace counts where it is the larger
    assert te_a2a_backward_workspace_bytes("te2.9", 1, 1, 1, 1, 20) == 1 + 20


def test_the_attention_core_saves_the_kernels_output_from_v2_8():
    ring, a2a = core(megatron_8b(cp_attention="ring")), core(megatron_8b())
    assert a2a.saved_bytes - ring.saved_bytes == OUT
    assert core(megatron_8b(framework_version="te2.7")).saved_bytes == ring.saved_bytes
    # the ring holds its buffers (q + 8·kv at v2.16) where a2a holds dO and its sends
    kernel = ring.grad_workspace_bytes - (Q + 8 * KV)
    assert a2a.grad_workspace_bytes == te_a2a_backward_workspace_bytes(
        "te2.16", Q, KV, KV, OUT, kernel
    )


def test_the_step_exposes_its_all_to_alls():
    """Four all-to-alls each way over the cp group (cp 4 ranks tp 2 apart: one node), none
    hidden behind the kernel."""
    spec, gpu = megatron_8b(), load_gpu("h100-sxm")
    each = [comm.hierarchical_all_to_all_seconds(size, 4, 2, gpu) for size in (Q, KV, KV, OUT)]
    forward, backward = context_parallel_comm(spec, gpu, None, None)
    assert forward == pytest.approx(sum(each))
    assert backward == pytest.approx(sum(each))
    assert comm.hierarchical_all_to_all_seconds(Q, 4, 2, gpu) == pytest.approx(
        3 / 4 * Q / (gpu.link_bytes_per_s * gpu.link_efficiency)
    )
    # the step: the ring hides its exchange behind the kernel, the all-to-alls add theirs
    ring = step_time(plan_of(megatron_8b(cp_attention="ring")), gpu)
    a2a = step_time(plan_of(spec), gpu)
    assert a2a.communication_seconds > ring.communication_seconds


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"tp": 8, "cp": 2, "sp": True},
            "cp (2) must divide the query heads (4) and K/V heads (1)",
        ),
        ({"framework_version": "te1.10"}, "te1.10 has no a2a context parallelism"),
        ({"framework": "torchtitan", "zero": 3, "sp": False, "tp": 1}, "one of ring, allgather"),
        ({"cp_attention": "allgather", "framework_version": "te1.9"}, "no all_gather context"),
        (
            {"framework": "deepspeed", "tp": 1, "sp": False, "cp": 1, "dp": 8},
            "the key is for frameworks",
        ),
    ],
)
def test_what_it_cannot_run(changes, message):
    with pytest.raises(SpecError, match="cp_attention") as error:
        megatron_8b(**changes)
    assert message in str(error.value)


def test_the_export_says_a2a_and_megatron_takes_it():
    plan = plan_of(megatron_8b())
    text = exports.export(plan, "megatron").text
    args = validate(parse(text, 8))
    assert args.cp_comm_type == ["a2a"]
    ring = exports.export(plan_of(megatron_8b(cp_attention=None)), "megatron")
    assert "--cp-comm-type" not in ring.text


A2A_WHEELS = ("1.13.0", "2.4.0", "2.9.0", "2.16.0")


@pytest.mark.parametrize("release", A2A_WHEELS)
def test_transformer_engines_own_all_to_alls_move_and_hold_what_is_counted(release):
    """TE's own `AttnFuncWithCPAndQKVOA2A` from the release's wheel, run by validation/
    te_cp_p2p_traffic.py: every rank moves `te_a2a_moved_bytes`, and its backward holds at most
    `te_a2a_backward_workspace_bytes` beyond the kernel's gradients (and the reorders'
    int32 chunk ids), at cp 2 and 4, K/V at the query heads and at half."""
    harness, source, ours = wheel_source(release)
    shape = SMALL
    for cp in (2, 4):
        for kv_heads in (4, 2):
            if kv_heads % cp:
                continue
            tensors = (2 * 8 * 4 * 16, 2 * 8 * kv_heads * 16, 2 * 8 * kv_heads * 16, 2 * 8 * 4 * 16)
            for rank in range(cp):
                moved = harness.measure(source, cp, rank, shape, kv_heads, "a2a")
                assert moved == te_a2a_moved_bytes(ours, *tensors)
            peak, _ = harness.backward_live(source, cp, shape, kv_heads)
            held = te_a2a_backward_workspace_bytes(ours, *tensors, 0) + sum(tensors[:3])
            assert 0 <= peak - held <= 2 * 4 * 2 * cp


def test_plan_offers_only_the_cp_its_all_to_alls_can_split():
    """Llama 3 8B's 32 query and 8 K/V heads: under a2a cp divides 8/tp, so no cp 16 and, at
    tp 8 (one K/V head a rank), no cp at all; on the ring every cp the GPUs allow."""
    from ckplan.plan.layout.space import SearchSpace, layouts

    def shapes(cp_attention):
        spec = megatron_8b(tp=1, sp=False, cp=1, dp=16, cp_attention=cp_attention)
        return {(lay.tp, lay.cp) for lay in layouts(SearchSpace(spec, 16, 8, 64, {}))}

    a2a, ring = shapes("a2a"), shapes(None)
    assert (1, 16) in ring and (1, 16) not in a2a
    assert (8, 2) in ring and (8, 2) not in a2a
    assert (2, 4) in a2a and (1, 8) in a2a
    assert a2a == {(tp, cp) for tp, cp in ring if (8 // tp) % cp == 0 and tp <= 8}


# ---- the all-gather ----------------------------------------------------------------------


def test_the_all_gathers_own_ops_by_hand():
    """From v1.11, forward: the gathered K and V reordered (4·cp·kv) and the two chunks'
    outputs copied into place (2·q). Backward: the reorder again (4·cp·kv), dK and dV zeroed
    (2·cp·kv), each call's dK, dV added into them over 2·cp + 1 half-chunks of keys (3 x:
    (6·cp + 3)·kv), dK and dV reordered (4·cp·kv), the dQ chunks copied (2·q)."""
    cp = 4
    assert te_allgather_moved_bytes("te2.9", cp, Q, KV) == (
        4 * cp * KV + 2 * Q,
        (4 * cp + 2 * cp + 6 * cp + 3 + 4 * cp) * KV + 2 * Q,
    )
    # v1.10 picks each call's keys out of the gathered K and V
    assert te_allgather_moved_bytes("te1.10", cp, Q, KV) == (
        2 * Q + (6 * cp + 1) * KV,
        2 * Q + (18 * cp + 2) * KV,
    )
    spec = megatron_8b(cp_attention="allgather")
    assert cp_moved_bytes(spec, 16, 4) == te_allgather_moved_bytes("te2.16", 4, Q, KV)
    assert core(spec).side_bytes == cp_moved_bytes(spec, 16, 4)


def test_the_all_gathers_backward_transient_by_hand():
    """From v1.11, on the last rank at its second call: dQ (q), the zeroed dK, dV (2·cp·kv),
    the gathered K and V reordered (2·cp·kv), the first call's dQ half (q/2) and its dK, dV
    over cp half-chunks (cp·kv): 1.5·q + 5·cp·kv. At most 2·q + (7·cp + 1)·kv. The op returns
    dQ, dK, dV (q + 2·kv), so the transient is the larger of the call's (with half the
    kernel's own workspace) and the most, less them."""
    assert te_allgather_backward_live_bytes("te2.9", 4, 2, 1) == (3 + 20, 4 + 29)
    assert te_allgather_backward_workspace_bytes("te2.9", 4, 2, 1, 0) == 33 - 4
    assert te_allgather_backward_workspace_bytes("te2.9", 4, 2, 1, 40) == 23 + 20 - 4
    assert te_allgather_backward_live_bytes("te1.10", 4, 2, 1) == (4 + 33, 5 + 41)


def test_the_all_gather_saves_each_chunks_output():
    ring, gathered = (
        core(megatron_8b(cp_attention="ring")),
        core(megatron_8b(cp_attention="allgather")),
    )
    assert gathered.saved_bytes - ring.saved_bytes == OUT
    workspace = te_allgather_backward_workspace_bytes(
        "te2.16", 4, Q, KV, 4 * (8192 * 16 * 128 + 8192 * 16)
    )
    assert gathered.grad_workspace_bytes == workspace


def test_the_all_gathers_collectives_are_exposed():
    """K and V gathered (cp x the rank's, bf16) before the forward's kernels; again in the
    backward, and dK, dV reduce-scattered after its kernels."""
    spec, gpu = megatron_8b(cp_attention="allgather"), load_gpu("h100-sxm")
    bandwidth = comm.group_bandwidth(gpu, 4, 2)
    gather = comm.all_gather_seconds(4 * KV, 4, bandwidth) + comm.all_gather_latency(gpu, 4)
    forward, backward = context_parallel_comm(spec, gpu, None, None)
    assert forward == pytest.approx(2 * gather)
    assert backward == pytest.approx(4 * gather)


def test_the_export_says_all_gather():
    plan = plan_of(megatron_8b(cp_attention="allgather"))
    args = validate(parse(exports.export(plan, "megatron").text, 8))
    assert args.cp_comm_type == ["all_gather"]


def test_mla_runs_on_the_ring_only():
    values = {"framework": "megatron", "cp": 2, "dp": 4, "seq": 4096}
    with pytest.raises(
        SpecError, match=r"runs MLA under context parallelism on the ring \(or a2a\+p2p\) only"
    ):
        load_spec("deepseek-v3", {**values, "cp_attention": "a2a"})
    assert load_spec("deepseek-v3", {**values, "cp_attention": "ring"}).cp == 2


@pytest.mark.parametrize("release", ("1.10.0", "1.13.0", "2.9.0", "2.16.0"))
def test_transformer_engines_own_all_gather_moves_and_holds_what_is_counted(release):
    """TE's own `AttnFuncWithCPAndKVAllGather` from the release's wheel, run by validation/
    te_cp_p2p_traffic.py: every rank moves `te_allgather_moved_bytes`; the busiest rank's
    backward holds `te_allgather_backward_live_bytes` (and the reorders' int32 chunk ids), at
    cp 2 and 3, K/V at the query heads and at half."""
    harness, source, ours = wheel_source(release)
    shape = SMALL
    for cp in (2, 3):
        for kv_heads in (4, 2):
            q, kv = 2 * 8 * 4 * 16, 2 * 8 * kv_heads * 16
            seen = []
            for rank in range(cp):
                moved = harness.measure(source, cp, rank, shape, kv_heads, "allgather")
                assert moved == te_allgather_moved_bytes(ours, cp, q, kv)
                seen.append(harness.backward_live(source, cp, shape, kv_heads, "allgather", rank))
            at_call, most = te_allgather_backward_live_bytes(ours, cp, q, kv)
            assert 0 <= max(p for p, _ in seen) - most <= 2 * 4 * 2 * cp
            assert 0 <= max(c for _, c in seen) - at_call <= 2 * 4 * 2 * cp


def test_a_sliding_window_needs_a2a_or_allgather():
    """Transformer Engine runs a window under context parallelism with a2a and all_gather only;
    `plan` offers Mistral 7B's window cp > 1 only under them."""
    from ckplan.plan.layout.space import SearchSpace, layouts

    values = {"framework": "megatron", "cp": 2, "dp": 4}
    with pytest.raises(SpecError, match="sliding-window attention under context parallelism"):
        load_spec("mistral-7b", values)
    for cp_attention in ("a2a", "allgather"):
        assert load_spec("mistral-7b", {**values, "cp_attention": cp_attention}).cp == 2
    assert load_spec("mistral-7b", {**values, "sliding_window_layers": "none"}).cp == 2

    def exchanges(cp_attention):
        spec = load_spec(
            "mistral-7b", {"framework": "megatron", "dp": 8, "cp_attention": cp_attention}
        )
        return {(lay.cp, lay.cp_attention) for lay in layouts(SearchSpace(spec, 8, 8, 16, {}))}

    assert exchanges("allgather") == {(1, "allgather")} | {(cp, "allgather") for cp in (2, 4, 8)}
    # none given: each exchange TE runs with the window (a2a where the heads split)
    found = exchanges(None)
    assert (1, None) in found and not any(name == "ring" for _, name in found)
    assert {(2, "allgather"), (8, "allgather"), (2, "a2a"), (8, "a2a")} <= found


def test_plan_tries_each_exchange_and_keeps_the_fastest():
    """Megatron-Core with no `cp_attention` given: the search runs each of TE's exchanges at
    cp > 1 (a2a where the heads split) and lists a layout once, with its fastest; the table
    and the JSON say which."""
    from ckplan.plan.layout.space import SearchSpace, layouts

    spec = load_spec("llama3-8b", {"framework": "megatron"})
    found = {
        (lay.tp, lay.cp, lay.cp_attention) for lay in layouts(SearchSpace(spec, 16, 8, 64, {}))
    }
    assert {(1, 2, "ring"), (1, 2, "allgather"), (1, 2, "a2a")} <= found
    assert (1, 16, "ring") in found and (1, 16, "a2a") not in found  # 8 K/V heads
    assert (1, 1, None) in found


def test_plan_json_names_the_exchange(cli):
    import json

    code, out, _ = cli(
        "plan", "mistral-7b", "--gpus", "16", "--gpu", "h100-sxm", "--seq", "131072",
        "--global-batch", "16", "--json",
    )  # fmt: skip
    assert code == 0
    layouts = json.loads(out)["layouts"]
    keys = ("tp", "pp", "cp", "dp", "sp", "virtual_stages", "micro_batch")
    arrangements = [tuple(lay[key] for key in keys) for lay in layouts]
    assert len(set(arrangements)) == len(arrangements)  # one entry a layout
    for lay in layouts:
        assert (lay["cp"] > 1) == (lay["cp_attention"] is not None)
        assert lay["cp_attention"] != "ring"  # the window needs a2a or allgather


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"framework_version": "te1.9", "cp_attention": None}, "te1.9 runs no kernel for a"),
        (
            {
                "framework_version": "te1.12",
                "cp_attention": "allgather",
                "attention_kernel": "cudnn",
            },
            "te1.12 runs a window's all-gather without the cuDNN kernel only",
        ),
    ],
)
def test_a_window_on_older_releases(changes, message):
    values = {"framework": "megatron", "cp": 2, "dp": 4, **changes}
    with pytest.raises(SpecError, match="cp_attention") as error:
        load_spec("mistral-7b", values)
    assert message in str(error.value)


def test_te_1_10_runs_a_window_through_the_all_gather():
    """TE v1.10's `attn_forward_func_with_cp` sends a window to `AttnFuncWithCPAndKVAllGather`
    whatever the exchange; from v1.11 the all-gather takes it without cuDNN, from v2.0 with."""
    values = {"framework": "megatron", "cp": 2, "dp": 4, "framework_version": "te1.10"}
    ring = core(load_spec("mistral-7b", values))
    gathered = core(load_spec("mistral-7b", {**values, "cp_attention": "allgather"}))
    assert ring == gathered
    assert ring.side_bytes == te_allgather_moved_bytes("te1.10", 2, *ring_sizes("mistral-7b"))
    for release in ("te1.12", "te2.0"):
        flash = {**values, "framework_version": release, "cp_attention": "allgather"}
        assert load_spec("mistral-7b", flash).cp == 2
    cudnn = {**values, "framework_version": "te2.0", "attention_kernel": "cudnn"}
    assert load_spec("mistral-7b", {**cudnn, "cp_attention": "allgather"}).cp == 2


def ring_sizes(preset: str) -> tuple[int, int]:
    """(Q's, one of K's and V's) bf16 bytes of a rank at cp 2, TP 1, 8,192 tokens."""
    spec = load_spec(preset)
    tokens = spec.seq // 2
    return 2 * tokens * spec.heads * spec.head_dim, 2 * tokens * spec.kv_heads * spec.head_dim
