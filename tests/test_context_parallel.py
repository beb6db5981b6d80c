"""torchtitan's context parallelism (ckplan.model.context_parallel): PyTorch's ring attention
backward transient by hand, and where the attention core counts it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from needs_torch import torch_or_skip

from ckplan.inputs.presets import load_spec
from ckplan.model.context_parallel import (
    ring_backward_live_at_call_bytes,
    ring_backward_workspace_bytes,
    ring_kv_heads,
    ring_moved_bytes,
    torchtitan_ring_exchange_bytes,
    uses_ring_attention,
)
from ckplan.model.ops import layer_ops

# Llama 3.1 405B at TP 8: 128 / 8 = 16 query heads, 8 / 8 = 1 K/V head, head_dim 128
HEADS_R, KV_HEADS_R, HEAD_DIM = 16, 1, 128


def four_oh_five_b(cp: int, **changes):
    """Llama 3.1 405B as torchtitan's December 2024 Table 6 runs it: TP 8 with sequence
    parallelism, PP 8, 32,768 tokens a rank (seq 32,768·cp), one sequence a micro-batch."""
    values = dict(
        framework="torchtitan",
        framework_version="2024.12",
        kernels="compiled",
        precision="float8",
        tp=8,
        sp=True,
        pp=8,
        cp=cp,
        dp=8 // cp,
        zero=3,
        seq=32768 * cp,
        micro_batch=1,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    )
    return load_spec("llama3-405b").replace(**{**values, **changes})


def test_the_live_set_at_a_later_steps_call_by_hand():
    # Q, K and V of 2,048 bf16 values each (4,096 bytes), cp 4 (the CPU check's 27 x 4,096):
    # fp32 accumulators 4·(2,048 + 4,096) = 24,576; all-gathered K‖V 4·2·2·2,048 = 32,768;
    # step 0's bf16 gradients 2·6,144 = 12,288; one K‖V concatenation 2·2·2,048 = 8,192; the
    # fp32 dK‖dV sent and received 2·4·2·2,048 = 32,768
    assert ring_backward_live_at_call_bytes(4, 2048, 2048, 2) == 110592 == 27 * 4096
    # cp 2: the gathered buffer halves (16,384), the rest stays: 23 x 4,096
    assert ring_backward_live_at_call_bytes(2, 2048, 2048, 2) == 94208 == 23 * 4096


def test_the_live_set_splits_query_and_key_value_terms():
    # one K/V head beside 4 query heads (K, V of 512 values, Q of 2,048), cp 8:
    # 4·(2,048 + 1,024) + 8·2·2·512 + 2·(2,048 + 1,024) + 2·2·512 + 2·4·2·512
    assert ring_backward_live_at_call_bytes(8, 2048, 512, 2) == 12288 + 16384 + 6144 + 2048 + 8192


def test_the_workspace_takes_off_the_half_of_the_keys_the_step_does_not_differentiate():
    # 405B at TP 8, 32,768 tokens a rank: Q = K = V = 32,768·16·128 = 67,108,864 values;
    # live at the call 70·q bytes (4·3q + 8·4q + 2·3q + 4q + 16q), less 2·q: 68·q
    q = 32768 * HEADS_R * HEAD_DIM
    assert ring_backward_workspace_bytes(8, q, q, 2) == 68 * q == 4563402752
    assert ring_backward_workspace_bytes(2, q, q, 2) == 44 * q
    # each cp rank more adds its K‖V to the gathered buffer: 2·2·q bytes
    assert ring_backward_workspace_bytes(4, q, q, 2) - ring_backward_workspace_bytes(
        2, q, q, 2
    ) == (2 * 4 * q)


def test_only_torchtitan_with_context_parallelism_and_a_fused_kernel_runs_the_ring():
    assert uses_ring_attention("torchtitan", 2, "flash")
    assert not uses_ring_attention("torchtitan", 1, "flash")
    assert not uses_ring_attention("torchtitan", 8, "standard")
    assert not uses_ring_attention("megatron", 8, "flash")


def test_2024_12_gathers_k_and_v_repeated_to_the_query_heads():
    assert ring_kv_heads("2024.12", HEADS_R, KV_HEADS_R) == HEADS_R
    assert ring_kv_heads("0.3", HEADS_R, KV_HEADS_R) == KV_HEADS_R


def core(spec):
    return next(op for op in layer_ops(spec.chain) if op.name == "attention_core")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_attention_core_backward_counts_the_ring(cp):
    # the same 32,768 tokens a rank as cp 1: only the ring's transient differs
    q = 32768 * HEADS_R * HEAD_DIM
    extra = (
        core(four_oh_five_b(cp)).grad_workspace_bytes - core(four_oh_five_b(1)).grad_workspace_bytes
    )
    assert extra == ring_backward_workspace_bytes(cp, q, q, 2) == (2 * 2 * cp + 36) * q
    # the saved bytes and the input gradients are a plain flash backward's
    assert core(four_oh_five_b(cp)).saved_bytes == core(four_oh_five_b(1)).saved_bytes


def test_0_3_gathers_k_and_v_at_the_key_value_heads():
    q, kv = 32768 * HEADS_R * HEAD_DIM, 32768 * KV_HEADS_R * HEAD_DIM
    extra = (
        core(four_oh_five_b(8, framework_version="0.3")).grad_workspace_bytes
        - core(four_oh_five_b(1, framework_version="0.3")).grad_workspace_bytes
    )
    assert extra == ring_backward_workspace_bytes(8, q, kv, 2)


def validation_script(name: str):
    """validation/NAME.py, imported as a module."""
    path = Path(__file__).resolve().parent.parent / "validation" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cp", [2, 4])
def test_pytorchs_own_ring_backward_holds_what_is_counted(cp):
    """PyTorch's `_templated_ring_attention_backward` on a fake process group (the CPU check,
    validation/torch_cp_ring_memory.py): the live set at its kernel calls is ckplan's (the most
    of any rank; the `i > rank` branch adds a half-length fp32 logsumexp copy, 1/32 E here)."""
    torch_or_skip()
    harness = validation_script("torch_cp_ring_memory")
    values = 1 * 4 * 16 * 32  # the script's (b, a, s, d)
    unit = 2 * values
    counted = ring_backward_live_at_call_bytes(cp, values, values, 2) / unit
    seen = [harness.measure(cp, rank) for rank in range(cp)]
    assert counted == 2 * cp + 19
    assert seen[-1]["at_calls"] == counted  # the last rank takes the `i <= rank` branch only
    assert max(r["at_calls"] for r in seen) == counted + 1 / 32


def test_ring_moved_bytes_by_hand():
    """cp 2, one value each of Q, K/V and the logsumexp alone: forward (65·2 - 41)/2 = 44.5 -> 45
    bytes a Q value, 8·2 = 16 a K/V value, 49 a logsumexp value; backward (23·2 + 17)/2 = 31.5
    -> 32, 47·2 + 33 = 127, 2 (the fp32 accumulators' `zeros_like` reads nothing of Q, K, V)."""
    assert ring_moved_bytes(2, 1, 0, 0) == (45, 32)
    assert ring_moved_bytes(2, 0, 1, 0) == (16, 127)
    assert ring_moved_bytes(2, 0, 0, 1) == (49, 2)
    # Llama 3 8B on 4 ranks of 32,768 tokens, K and V repeated to the 32 query heads (torchtitan
    # 9dec370): 4,294,967,296 values of Q and of K, 1,048,576 of the logsumexp
    q = 32768 * 32 * 128
    forward, backward = ring_moved_bytes(4, q, q, 32768 * 32)
    assert forward == 219 * q // 2 + 32 * q + 147 * 32768 * 32
    assert backward == 109 * q // 2 + 221 * q + 6 * 32768 * 32


def test_the_attention_core_runs_the_ring_beside_its_kernel():
    """The ring's bytes are separate kernels beside the flash call (`Op.side_bytes`), only where
    torchtitan runs PyTorch's ring: not at cp 1, not under cp_attention allgather."""
    ring = core(four_oh_five_b(4))
    assert ring.side_bytes == ring_moved_bytes(
        4, 32768 * HEADS_R * HEAD_DIM, 32768 * HEADS_R * HEAD_DIM, 32768 * HEADS_R
    )
    assert core(four_oh_five_b(1)).side_bytes == (0, 0)
    gathered = core(four_oh_five_b(4, cp_attention="allgather"))
    assert gathered.side_bytes == (0, 0)
    assert gathered.grad_workspace_bytes == core(four_oh_five_b(1)).grad_workspace_bytes


def test_cp_attention_is_torchtitans_and_megatrons():
    from ckplan.model.parts import SpecError

    with pytest.raises(SpecError, match="key 'cp_attention' must be one of ring, allgather, a2a"):
        four_oh_five_b(4, cp_attention="p2p")
    with pytest.raises(SpecError, match="under framework torchtitan one of ring, allgather"):
        four_oh_five_b(4, cp_attention="a2a")
    assert load_spec("llama3-8b", {"cp": 2, "dp": 4, "cp_attention": "allgather"}).cp == 2
    with pytest.raises(SpecError, match="the key is for frameworks torchtitan and megatron"):
        load_spec("llama3-8b", {"framework": "deepspeed", "cp_attention": "ring"})
    # Megatron's ring is its default
    ring = load_spec("llama3-8b", {"cp": 2, "dp": 4, "cp_attention": "ring"})
    assert core(ring).side_bytes == core(load_spec("llama3-8b", {"cp": 2, "dp": 4})).side_bytes


@pytest.mark.parametrize("cp", [2, 3])
def test_pytorchs_own_ring_moves_what_is_counted(cp):
    """PyTorch's ring loops on a fake process group (validation/torch_cp_ring_traffic.py): the
    mean over the ranks of the bytes their own ops move is `ring_moved_bytes`, exactly."""
    torch_or_skip()
    harness = validation_script("torch_cp_ring_traffic")
    shape = {"b": 1, "a": 4, "s": 8, "d": 16}
    for kv_heads in (4, 2):
        seen = [harness.measure(cp, rank, shape, kv_heads) for rank in range(cp)]
        mean = (sum(f for f, _ in seen) / cp, sum(g for _, g in seen) / cp)
        assert mean == ring_moved_bytes(cp, 8 * 4 * 16, 8 * kv_heads * 16, 8 * 4)


def test_ring_exchange_by_hand():
    """The 405B at cp 4 (16 query heads a rank, K and V repeated to them under 2024.12): the
    gathered K‖V is 4 x 2 x 32,768·16·128 bf16 values, the dK‖dV shifted 2 x that in fp32."""
    kv = 32768 * HEADS_R * HEAD_DIM
    assert torchtitan_ring_exchange_bytes(four_oh_five_b(4), HEADS_R, KV_HEADS_R) == (
        4 * 2 * kv * 2,
        2 * kv * 4,
    )
    # torchtitan 0.3 gathers the one K/V head a rank holds
    kv = 32768 * KV_HEADS_R * HEAD_DIM
    spec = four_oh_five_b(4, framework_version="0.3")
    assert torchtitan_ring_exchange_bytes(spec, HEADS_R, KV_HEADS_R) == (16 * kv, 8 * kv)
    assert torchtitan_ring_exchange_bytes(four_oh_five_b(1), HEADS_R, KV_HEADS_R) == (0, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_pytorchs_own_ring_exchanges_what_is_timed(cp):
    """PyTorch's ring loops on a fake process group: one K‖V all-gather in the forward, the
    same and cp shifts of the fp32 dK‖dV in the backward (`torchtitan_ring_exchange_bytes`)."""
    torch_or_skip()
    harness = validation_script("torch_cp_ring_traffic")
    shape = {"b": 1, "a": 4, "s": 8, "d": 16}
    forward, backward = harness.exchanged(cp, 1, shape, 2)
    kv = 8 * 2 * 16  # the rank's K values at 2 heads
    gathered, shifted = cp * 2 * kv * 2, 2 * kv * 4
    assert forward == [("all_gather_into_tensor", gathered)]
    assert (
        backward == [("all_gather_into_tensor", gathered)] + [("all_to_all_single", shifted)] * cp
    )


def test_ring_exchange_time_hides_behind_one_step_each():
    """With no compute to hide behind, the forward pays the gather and the backward the gather
    and cp shifts; with a long core only the last shift, which nothing follows."""
    from ckplan.hardware import communication as comm
    from ckplan.hardware.step_time import torchtitan_ring_comm
    from ckplan.inputs.gpus import load_gpu

    gpu, spec = load_gpu("h100-sxm"), four_oh_five_b(4)
    gathered, shifted = torchtitan_ring_exchange_bytes(spec, HEADS_R, KV_HEADS_R)
    bandwidth = comm.group_bandwidth(gpu, 4, 8)  # cp 4 at stride tp 8: across nodes
    gather = comm.all_gather_seconds(gathered, 4, bandwidth) + comm.all_gather_latency(gpu, 4)
    shift = shifted / bandwidth
    forward, backward = torchtitan_ring_comm(spec, gpu, (gathered, shifted), 0.0, 0.0)
    assert forward == pytest.approx(gather)
    assert backward == pytest.approx(gather + 4 * shift)
    assert torchtitan_ring_comm(spec, gpu, (gathered, shifted), 1e3, 1e3) == pytest.approx(
        (0.0, shift)
    )
