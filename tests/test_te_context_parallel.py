"""Transformer Engine's point-to-point context parallelism under Megatron-Core
(ckplan.model.context_parallel `TE_CP_MOVED`): its own ops' bytes by hand and as counted on
TE's own text, and where the attention core times them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from needs_torch import torch_or_skip
from test_context_parallel import validation_script

from ckplan.inputs.presets import load_spec
from ckplan.model.context_parallel import (
    TE_CP_MOVED,
    TE_P2P_LIVE,
    cp_moved_bytes,
    te_p2p_backward_live_bytes,
    te_p2p_moved_bytes,
    torchtitan_ring_moved_bytes,
)
from ckplan.model.frameworks import TRANSFORMER_ENGINE_RELEASES
from ckplan.model.ops import layer_ops


def test_every_release_has_a_count():
    assert set(TE_CP_MOVED) == set(TRANSFORMER_ENGINE_RELEASES)
    assert TRANSFORMER_ENGINE_RELEASES[0] == "te1.8"


def test_te_1_8_at_cp_2_by_hand():
    """TE v1.8's `AttnFuncWithCP` (transformer_engine/pytorch/attention.py), causal sbhd, cuDNN
    fused attention, the mean of ranks 0 and 1, in bytes of Q (bf16), of one of K and V, and of
    the fp32 logsumexp L. Forward: cat(K, V) reads and writes 2 each (4 KV); rank 1's step 1
    takes the first half of the received K‖V with `.contiguous()` (2 KV, mean 1), rank 0's
    `q[1].contiguous()` is already contiguous (nothing); `empty_like(q).zero_()` writes Q; the
    logsumexp cloned (2 L) and cast to float64 (L read, 2 L written); the compiled
    logsumexp correction reads the float64 sum (2 L) and the step's L and writes the sum back
    (2 L): 5 L on rank 1, half on rank 0 (mean 3.75 L); the cast back to fp32 (3 L); the
    compiled output correction reads O and the step's output and writes O (3 Q) and reads both
    logsumexps (2 L) for step 0 on both ranks and step 1 on rank 1, on rank 0 half of it but
    the float64 half-view of the sum (1.5 Q + L + L/2), mean 2.25 Q + 1.75 L.
    Forward: 6.25 Q + 5 KV + 15.5 L."""
    forward = {"Q": 1 + 3 + 2.25, "KV": 4 + 1, "L": 5 + 3.75 + 3 + 2 + 1.75}
    assert forward == {"Q": 6.25, "KV": 5, "L": 15.5}
    # one value of each alone: bf16 Q and K/V, fp32 logsumexp
    assert te_p2p_moved_bytes("te1.8", 2, 4, 0, 0)[0] == 6.25 * 2 * 4
    assert te_p2p_moved_bytes("te1.8", 2, 0, 4, 0)[0] == 5 * 2 * 4
    assert te_p2p_moved_bytes("te1.8", 2, 0, 0, 1)[0] == 15.5 * 4


def test_te_1_8_backward_at_cp_2_by_hand():
    """The backward, the mean of ranks 0 and 1 (D = 2 KV, the dK‖dV ring buffer): the saved
    K‖V copied into the first ring buffer (4 KV); rank 1's step 0 takes the first half of K‖V
    with `.contiguous()` (2 KV, mean 1), rank 0's `q[1]`, `out[1]`, `dout[1]` are already
    contiguous; the second half of the logsumexp copied (L).
    dQ: rank 0 copies step 0's half-length dQ into the second half (Q), then copies the first
    half of step 1's and adds its second half (Q + 1.5 Q); rank 1 copies step 0's whole
    (2 Q) and adds step 1's (3 Q): mean 4.25 Q.
    dK‖dV concatenated each step (4 KV whole, 2 KV for rank 1's half step 0): mean 7 KV; and
    accumulated into the ring buffer: rank 0 copies step 0's (2 D) and at the last step adds
    the first half and copies the second (1.5 D + D); rank 1 copies its half step (D) and adds
    the last whole (3 D): mean 4.25 D = 8.5 KV.
    Backward: 4.25 Q + 20.5 KV + L."""
    backward = {"Q": ((1 + 2.5) + (2 + 3)) / 2, "KV": 4 + 1 + 7 + 8.5, "L": 1}
    assert backward == {"Q": 4.25, "KV": 20.5, "L": 1}
    assert te_p2p_moved_bytes("te1.8", 2, 4, 0, 0)[1] == 4.25 * 2 * 4
    assert te_p2p_moved_bytes("te1.8", 2, 0, 4, 0)[1] == 20.5 * 2 * 4
    assert te_p2p_moved_bytes("te1.8", 2, 0, 0, 4)[1] == 1 * 4 * 4


# Counted by validation/te_cp_p2p_traffic.py on each release's own text (the --check runs,
# one line of each): d 32, 8 query heads, 4 K/V heads, 16 tokens a rank, cp 3, the mean over
# the ranks (forward, backward); where the mean is not whole, ckplan rounds up.
COUNTED = {
    "te1.8": (104_960, 172_544),
    # v1.10-v2.1 zero the output with `zeros_like(q)`, which reads nothing of Q
    "te1.13": (96_768, 164_352),
    "te2.0": (96_768, 164_181 + 1 / 3),
    "te2.2": (89_600, 164_181 + 1 / 3),
    "te2.3": (89_600, 123_221 + 1 / 3),
    "te2.9": (84_480, 123_221 + 1 / 3),
    "te2.16": (84_480, 123_221 + 1 / 3),
}


@pytest.mark.parametrize("release", sorted(COUNTED))
def test_releases_move_what_their_text_was_counted_moving(release):
    forward, backward = te_p2p_moved_bytes(release, 3, 16 * 8 * 32, 16 * 4 * 32, 16 * 8)
    assert forward == COUNTED[release][0]
    assert 0 <= backward - COUNTED[release][1] < 1


# A stand-in for TE's class: the counting rules of validation/te_cp_p2p_traffic.py on known ops
FAKE_TE = """
@jit_fuser
def flash_attn_fwd_softmax_lse_correction(softmax_lse, softmax_lse_per_step):
    softmax_lse.copy_(torch.max(softmax_lse, softmax_lse_per_step))


class AttnFuncWithCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, is_training, q, k, v, cp_group, cp_global_ranks, cp_stream):
        kv = torch.cat((k.unsqueeze(0), v.unsqueeze(0)), dim=0)
        flash_attn_p2p_communicate(0, kv, 1, torch.empty_like(kv), 1, cp_group, True)
        out, (lse, rng) = fused_attn_fwd(is_training, q, kv[0], kv[1])
        total = torch.empty_like(q).zero_()
        zeroed = torch.zeros_like(q)
        running = lse.clone()
        flash_attn_fwd_softmax_lse_correction(running, lse)
        ctx.save_for_backward(q, kv)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv = ctx.saved_tensors
        dq_, dk_, dv_, _ = fused_attn_bwd(q, kv[0], kv[1], dout, dout)
        dq = torch.empty_like(q)
        dq.copy_(dq_)
        dq.add_(dq_)
        return dq
"""


def test_the_counting_rules_on_known_ops():
    """Forward: cat 4 KV; the exchange, the kernel and `empty_like` nothing; `zero_` writes Q;
    `zeros_like` writes Q and reads nothing; `clone` 2 L; the compiled correction reads both
    logsumexps and writes one (3 L).
    Backward: the kernel nothing, `copy_` 2 Q (not the destination's old values), `add_` 3 Q."""
    torch_or_skip()
    harness = validation_script("te_cp_p2p_traffic")
    shape = {"b": 1, "a": 8, "s": 16, "d": 32}
    q_bytes, kv_bytes, lse_bytes = 2 * 16 * 8 * 32, 2 * 16 * 4 * 32, 4 * 16 * 8
    forward, backward = harness.measure(FAKE_TE, 2, 0, shape, 4)
    assert forward == 4 * kv_bytes + 2 * q_bytes + 2 * lse_bytes + 3 * lse_bytes
    assert backward == 2 * q_bytes + 3 * q_bytes


# PyPI's pure-Python transformer_engine wheels (v1.10 on; v1.9's holds no PyTorch code), which
# .ci/run downloads into CKPLAN_TE_WHEELS: one release of each set of loops but v1.8-1.9's
WHEELS = os.environ.get("CKPLAN_TE_WHEELS")
WHEEL_RELEASES = ("1.10.0", "1.13.0", "2.1.0", "2.2.0", "2.3.0", "2.4.0", "2.9.0", "2.16.0")


# the harness's rank: b 1, 4 query heads, 8 tokens, head size 16
SMALL = {"b": 1, "a": 4, "s": 8, "d": 16}


def wheel_source(release: str) -> tuple:
    """The harness (validation/te_cp_p2p_traffic.py), TE's context-parallel module's text
    from the release's wheel (.ci/run downloads them into CKPLAN_TE_WHEELS) and ckplan's name
    of the release; skipped without torch or the wheel (a failure under
    CKPLAN_REQUIRE_FRAMEWORKS=1)."""
    torch_or_skip()
    wheel = Path(WHEELS or "") / f"transformer_engine-{release}-py3-none-any.whl"
    if not WHEELS or not wheel.is_file():
        if os.environ.get("CKPLAN_REQUIRE_FRAMEWORKS") == "1":
            pytest.fail(f"CKPLAN_REQUIRE_FRAMEWORKS=1 but {wheel} is missing", pytrace=False)
        pytest.skip("no transformer_engine wheel (CKPLAN_TE_WHEELS, set by .ci/run)")
    harness = validation_script("te_cp_p2p_traffic")
    return harness, harness.source_from_wheel(str(wheel)), "te" + release.rsplit(".", 1)[0]


@pytest.mark.parametrize("release", WHEEL_RELEASES)
def test_transformer_engines_own_loops_move_what_is_counted(release):
    """TE's own `AttnFuncWithCP(AndKVP2P)` text from the release's wheel, run by
    validation/te_cp_p2p_traffic.py: the mean over the ranks is `te_p2p_moved_bytes` of
    the release at cp 2 and 3 (a whole byte's rounding), K/V at the query heads and at half."""
    harness, source, ours = wheel_source(release)
    shape = SMALL
    for cp in (2, 3):
        for kv_heads in (4, 2):
            seen = [harness.measure(source, cp, rank, shape, kv_heads) for rank in range(cp)]
            mean = (sum(f for f, _ in seen) / cp, sum(g for _, g in seen) / cp)
            counted = te_p2p_moved_bytes(ours, cp, 8 * 4 * 16, 8 * kv_heads * 16, 8 * 4)
            assert 0 <= counted[0] - mean[0] < 1
            assert 0 <= counted[1] - mean[1] < 1


def megatron_8b(**changes):
    """Llama 3 8B under Megatron-Core at CP 2, 8,192 tokens, one sequence a micro-batch."""
    values = {"cp": 2, "dp": 4, "seq": 8192, "micro_batch": 1, "attention": "flash", **changes}
    return load_spec("llama3-8b").replace(**values)


def core(spec):
    return next(op for op in layer_ops(spec.chain) if op.name == "attention_core")


@pytest.mark.parametrize("release", ["te1.8", "te1.13", "te2.1", "te2.9"])
def test_the_attention_core_runs_te_loops_beside_its_kernel(release):
    spec = megatron_8b(framework_version=release)
    # 4,096 tokens a rank, 32 query heads and 8 K/V heads of 128
    tokens = 4096
    expected = te_p2p_moved_bytes(release, 2, tokens * 32 * 128, tokens * 8 * 128, tokens * 32)
    assert core(spec).side_bytes == cp_moved_bytes(spec, 32, 8) == expected
    assert core(megatron_8b(cp=1, dp=8, framework_version=release)).side_bytes == (0, 0)


def test_the_newest_release_is_the_default():
    assert (
        core(megatron_8b()).side_bytes == core(megatron_8b(framework_version="te2.16")).side_bytes
    )
    # and the releases differ: v1.8 copies halves of K‖V that later releases do not
    assert (
        core(megatron_8b(framework_version="te1.8")).side_bytes[1]
        > (core(megatron_8b()).side_bytes[1])
    )


def test_torchtitan_keeps_pytorchs_ring():
    spec = megatron_8b(framework="torchtitan", framework_version="0.3", zero=3)
    assert cp_moved_bytes(spec, 32, 8) == torchtitan_ring_moved_bytes(spec, 32, 8)


# ---- the point-to-point backward's own buffers ---------------------------------------------


def test_every_release_has_its_backward_live_bytes():
    assert set(TE_P2P_LIVE) == set(TRANSFORMER_ENGINE_RELEASES)


def test_the_backward_buffers_by_hand():
    """From v2.8: q + 8·kv at a call and after the loops (two received K‖V buffers, two
    dK‖dV ones, the dQ buffer); v2.3-v2.7 hold 4·kv more after them; v1.12-v1.13's busiest
    rank is the first at the query heads and another where K and V are few; v1.8-v1.9's
    middle ranks (cp >= 3) hold one more K/V at a call."""
    q, kv = 1024, 256
    assert te_p2p_backward_live_bytes("te2.16", 4, q, kv) == (q + 8 * kv,) * 2
    assert te_p2p_backward_live_bytes("te2.8", 2, q, kv) == (q + 8 * kv,) * 2
    assert te_p2p_backward_live_bytes("te2.7", 2, q, kv) == (q + 10 * kv, q + 12 * kv)
    assert te_p2p_backward_live_bytes("te1.12", 2, q, q) == (q * 23 // 2, 13 * q)
    assert te_p2p_backward_live_bytes("te1.12", 2, q, kv) == (2 * q + 9 * kv, 2 * q + 9 * kv)
    assert te_p2p_backward_live_bytes("te1.8", 2, q, kv)[0] == 3 * q // 2 + 12 * kv
    assert te_p2p_backward_live_bytes("te1.8", 3, q, kv)[0] == 3 * q // 2 + 13 * kv


def test_the_attention_core_holds_the_rings_buffers_beside_its_kernel():
    """Megatron-Core's ring at cp 2 (Llama 3 8B, 4,096 tokens a rank): the kernel's
    workspace and the buffers at a call, or the buffers after the loops, the larger; none at
    cp 1 or under torchtitan (PyTorch's ring has its own count)."""
    q, kv = 2 * 4096 * 32 * 128, 2 * 4096 * 8 * 128
    plain = core(megatron_8b(cp=1, dp=8, seq=4096)).grad_workspace_bytes
    at_call, at_end = te_p2p_backward_live_bytes("te2.16", 2, q, kv)
    assert core(megatron_8b()).grad_workspace_bytes == max(at_call + plain, at_end)
    older = core(megatron_8b(framework_version="te2.3")).grad_workspace_bytes
    assert older == max(q + 10 * kv + plain, q + 12 * kv)


@pytest.mark.parametrize("release", WHEEL_RELEASES)
def test_transformer_engines_own_backward_holds_what_is_counted(release):
    """TE's own point-to-point backward from the release's wheel, run by validation/
    te_cp_p2p_traffic.py --memory: on its busiest rank the live bytes at a kernel call and
    at all are `te_p2p_backward_live_bytes` (with the dQ, dK, dV it returns), up to the int32
    sequence lengths, at cp 2 and 3, K/V at the query heads and at half."""
    harness, source, ours = wheel_source(release)
    for cp in (2, 3):
        for kv_heads in (4, 2):
            assert not harness._check_p2p_memory(source, ours, cp, SMALL, kv_heads)
