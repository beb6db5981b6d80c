"""MLA's attention under Transformer Engine's point-to-point context parallelism
(ckplan.model.context_parallel `TE_CP_MLA_MOVED`, `te_p2p_mla_backward_live_bytes`): K and V
of different head sizes, v2.5 on; its own ops' bytes and buffers by hand, as counted on TE's
own text, and where the attention core holds and times them."""

from __future__ import annotations

import pytest
from test_te_context_parallel import wheel_source

from ckplan.inputs.presets import load_spec
from ckplan.model.context_parallel import (
    TE_CP_MLA_MOVED,
    TE_MLA_CP_FIRST_RELEASE,
    te_hierarchical_a2a_moved_bytes,
    te_hierarchical_backward_workspace_bytes,
    te_p2p_mla_backward_live_bytes,
    te_p2p_mla_moved_bytes,
)
from ckplan.model.frameworks import TRANSFORMER_ENGINE_RELEASES
from ckplan.model.ops import layer_ops
from ckplan.model.spec import SpecError

# DeepSeek-V3 at TP 8 (16 heads a rank), cp 4, 32,768 tokens: 8,192 a rank, Q and K at
# 128 + 64, V and the output at 128, bf16
TOKENS, HEADS = 8192, 16
Q = K = 2 * TOKENS * HEADS * 192
V = OUT = 2 * TOKENS * HEADS * 128
LSE = 4 * TOKENS * HEADS


def deepseek(**changes):
    values = {"tp": 8, "sp": True, "cp": 4, "dp": 1, "ep": 8, "etp": 1, "seq": 32768}
    return load_spec("deepseek-v3", values | changes)


def core(spec):
    return next(op for op in layer_ops(spec.chain) if op.name == "attention_core")


def test_the_count_by_hand():
    """(4.5·cp - 0.5)·L + 2·Q + (2.75·cp + 1.25)·V forward and (1 - 1/cp)·L
    + (4.5·cp + 1.5)·Q + (2.25·cp + 1.75)·V backward, for Q's, V's and the logsumexp's bytes."""
    assert TE_CP_MLA_MOVED[0] == ((0, 8, 0), (11, 5, 0), (18, -2, 0))
    forward, backward = te_p2p_mla_moved_bytes(4, Q // 2, V // 2, LSE // 4)
    assert forward == 2 * Q + 12.25 * V + 17.5 * LSE
    assert backward == 19.5 * Q + 10.75 * V + 0.75 * LSE
    # cp 3: thirds round up to a whole byte
    assert te_p2p_mla_moved_bytes(3, 0, 0, 1)[1] == 3  # (1 - 1/3)·4 = 2.67 bytes


def test_the_buffers_by_hand():
    """Two received K‖V buffers, two dK‖dV ones and the dQ buffer: q + 4·(k + v), which is
    v2.8's q + 8·kv where K and V are one size."""
    assert te_p2p_mla_backward_live_bytes(Q, K, V) == Q + 4 * (K + V)
    assert te_p2p_mla_backward_live_bytes(1024, 256, 256) == 1024 + 8 * 256


def test_the_attention_core_times_and_holds_them():
    """The ring at cp 4 moves `te_p2p_mla_moved_bytes` beside the kernel and holds its
    buffers beside the kernel's workspace, the larger of the two after the loops; nothing at
    cp 1."""
    spec = deepseek()
    assert core(spec).side_bytes == te_p2p_mla_moved_bytes(4, Q // 2, V // 2, LSE // 4)
    alone = core(deepseek(cp=1, seq=8192)).grad_workspace_bytes
    live = te_p2p_mla_backward_live_bytes(Q, K, V)
    assert core(spec).grad_workspace_bytes == max(live + alone, live)
    assert core(deepseek(cp=1, seq=8192)).side_bytes == (0, 0)


def test_under_a2a_plus_p2p_the_ring_is_mlas_at_its_size():
    """a2a+p2p at cp 4 (all-to-alls over 2, a ring over 2): the ring's loops over the same
    bytes a rank, MLA's count at 2, and the all-to-alls' bytes beside them; its backward
    holds MLA's ring buffers inside the all-to-alls' own."""
    spec = deepseek(cp_attention="a2a+p2p", cp_a2a_size=2)
    ring = te_p2p_mla_moved_bytes(2, Q // 2, V // 2, LSE // 4)
    a2a = te_hierarchical_a2a_moved_bytes("te2.16", Q, K, V, OUT)
    assert core(spec).side_bytes == (ring[0] + a2a[0], ring[1] + a2a[1])
    live = te_p2p_mla_backward_live_bytes(Q, K, V)
    alone = core(deepseek(cp=1, seq=8192)).grad_workspace_bytes
    expected = te_hierarchical_backward_workspace_bytes("te2.16", Q, K, V, OUT, live + alone, live)
    assert core(spec).grad_workspace_bytes == expected


def test_releases_before_2_5_give_mla_no_kernel_under_context_parallelism():
    assert TE_MLA_CP_FIRST_RELEASE == "te2.5"
    for release in TRANSFORMER_ENGINE_RELEASES[: TRANSFORMER_ENGINE_RELEASES.index("te2.5")]:
        with pytest.raises(SpecError, match=r"runs MLA under context parallelism from te2\.5"):
            deepseek(framework_version=release)
        assert deepseek(framework_version=release, cp=1, seq=8192).cp == 1
    assert deepseek(framework_version="te2.5").cp == 4


@pytest.mark.parametrize("release", ("2.9.0", "2.16.0"))
def test_transformer_engines_own_mla_path_moves_and_holds_what_is_counted(release):
    """TE's own `AttnFuncWithCPAndKVP2P` from the release's wheel on MLA's shapes (Q and K at
    head size 48, V at 32), run by validation/te_cp_p2p_traffic.py: the mean over the ranks
    at cp 2 and 3 is `te_p2p_mla_moved_bytes` (a whole byte's rounding), the busiest rank's
    backward holds its buffers, on the ring and under a2a+p2p at cp 4 (2 x 2)."""
    harness, source, ours = wheel_source(release)
    shape = harness.MLA_SHAPES[0]
    a, s, d, dv = shape["a"], shape["s"], shape["d"], shape["dv"]
    for cp in (2, 3):
        seen = [harness.measure(source, cp, rank, shape, a) for rank in range(cp)]
        mean = (sum(f for f, _ in seen) / cp, sum(g for _, g in seen) / cp)
        counted = te_p2p_mla_moved_bytes(cp, s * a * d, s * a * dv, s * a)
        assert mean == pytest.approx(counted, abs=1)
        assert not harness._check_p2p_memory(source, ours, cp, shape, a)
    assert not harness._check_hierarchical_memory(source, ours, 4, shape, a)
    seen = [harness.measure(source, 4, rank, shape, a, "a2a+p2p") for rank in range(2)]
    mean = (sum(f for f, _ in seen) / 2, sum(g for _, g in seen) / 2)
    ring = te_p2p_mla_moved_bytes(2, s * a * d, s * a * dv, s * a)
    a2a = te_hierarchical_a2a_moved_bytes(ours, *harness._a2a_tensors(shape, a))
    assert mean == pytest.approx((ring[0] + a2a[0], ring[1] + a2a[1]), abs=1)
