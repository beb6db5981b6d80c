"""torchtitan 9dec370's Llama attention on the CPU (validation/torchtitan_repeat_kv.py): what it
saves for backward and what its repeat of K and V copies, against ckplan.model.repeat_kv.

Skipped (and reported) where torch is not installed."""

import importlib.util
import sys
from pathlib import Path

import pytest
from needs_torch import torch_or_skip

torch = torch_or_skip()

SCRIPT = Path(__file__).resolve().parent.parent / "validation" / "torchtitan_repeat_kv.py"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("torchtitan_repeat_kv", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_december_2024_saves_k_and_v_repeated(harness):
    shape = harness.Shape()  # b 2, s 16, 8 heads, 2 K/V heads, head_dim 8, bf16
    m = harness.measure("2024.12", shape)
    full = 2 * 2 * 16 * 8 * 8  # one tensor at the 8 query heads: 4,096 bytes
    # Q, K and V repeated, the output (the wo input), the fp32 logsumexp; K and V at 2 heads
    # are not kept by RoPE or the repeat
    assert m.saved_bytes == 4 * full + 4 * 2 * 8 * 16 == 17_408
    assert m.saved_bytes == harness.ckplan_prediction("2024.12", shape)
    # the repeat copies: aten.clone of the expanded (b, s, g, n_rep, d) tensor, for K and V
    assert m.forward_copies == [(2, 16, 2, 4, 8)] * 2
    # the kernel returns dK and dV at the query heads; a sum folds each back to the K/V heads
    assert m.kernel_grads == [(2, 8, 16, 8)] * 3
    assert m.folded == [(2, 16, 2, 1, 8)] * 2


def test_enable_gqa_saves_k_and_v_at_their_heads(harness):
    shape = harness.Shape()
    m = harness.measure("0.3", shape)
    assert m.saved_bytes == 2 * 4_096 + 2 * 1_024 + 1_024 == 11_264
    assert m.saved_bytes == harness.ckplan_prediction("0.3", shape)
    assert m.forward_copies == [] and m.folded == []


def test_compiled_block_saves_the_same(harness):
    """torch.compile's partitioned backward reads the SDPA kernel's inputs as eager autograd
    does: the repeated K and V are saved, not rebuilt from the 2-head tensors."""
    for version in harness.VERSIONS:
        eager = harness.measure(version)
        compiled = harness.measure(version, compiled=True)
        assert compiled.saved_bytes == eager.saved_bytes == harness.ckplan_prediction(version)
