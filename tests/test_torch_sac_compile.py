"""torchtitan's per-op policy on a Llama block, eager and compiled, against ckplan's stored
layer (validation/torch_float8_sac.py, bf16; the float8 recipes need torchao, which the
script's own run covers: validation/results-float8-sac-torch-2.13.0.json).

Skipped where torch is not installed, failed under CKPLAN_REQUIRE_TORCH=1.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
from needs_torch import torch_or_skip

from ckplan.model.op_policy import parse_policy, policy_tape_bytes
from ckplan.model.spec import spec_from_mapping

torch = torch_or_skip()

SCRIPT = Path(__file__).resolve().parent.parent / "validation" / "torch_float8_sac.py"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("torch_float8_sac", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def block_spec(harness, **changes):
    return spec_from_mapping({
        "name": "block", "layers": 1, "hidden": harness.H, "heads": harness.HEADS,
        "kv_heads": harness.KV_HEADS, "ffn_hidden": harness.FFN, "seq": harness.SEQ,
        "micro_batch": harness.BATCH, "vocab": 0, "dtype_bytes": 2, "norm": "rmsnorm",
        "mlp": "swiglu", "attention": "flash", "positions": "rope", "dropout": 0,
        "framework": "torchtitan", **changes,
    })  # fmt: skip


def test_eager_cache_and_compiled_saves_are_ckplans_stored_layer(harness):
    policy = parse_policy("sac")
    X = 2 * harness.BATCH * harness.SEQ * harness.H  # the block input, saved as the argument
    eager = sum(harness.eager_cache("bf16", harness.SAVE_LIST_LATER).values())
    assert eager + X == policy_tape_bytes(block_spec(harness), policy)
    compiled = harness.compiled_block("bf16", harness.SAVE_LIST_LATER)["activation_bytes"]
    assert compiled + X == policy_tape_bytes(block_spec(harness, kernels="compiled"), policy)
