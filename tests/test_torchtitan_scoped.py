"""Scoped policies on torchtitan 0.3.0's own DeepSeek-V3 block (torchtitan/models/deepseek_v3/
model.py and __init__.py `build_mla_moe_layers`, models/common/moe.py, in the wheel
torchtitan-0.3.0-py3-none-any.whl), run on the CPU in bf16 by `export --to torch`'s snippet:
`scope_layer` wraps each region's submodule in `torch.utils.checkpoint` with PyTorch's default
early stop, torchtitan's own activation checkpointing off.

What is checked is what the scoped policy decides: the GEMMs each region's replay runs again
(early stop: to the last tensor the region's backward reads, not to the region's end, which
torchtitan's own wrapper would replay to), what each region's selective checkpoint caches, and
the plain step's gradients. The whole layer's tape is not: on the CPU nn.RMSNorm runs its
composite (fp32 copies of its input and of the normalised tensor, where CUDA's fused kernel
keeps the input and the rstd) and the router's float32 autocast is off ("CPU Autocast only
supports dtypes of torch.bfloat16, torch.float16"), so the norms and the routing save other
tensors than on a GPU, the layout ckplan models.
"""

import copy

import pytest
from export_snippet import cached_storages, recording_snippet
from needs_frameworks import framework_or_skip
from needs_torch import torch_or_skip
from test_op_policy_moe_mla import BASE, MLA

from ckplan.model.op_policy import (
    kept_mask,
    parse_policy,
    policy_spans,
    rerun_mask,
    rerun_units,
    unit_ops,
)
from ckplan.model.spec import spec_from_mapping

# ckplan's small DeepSeek-style layer (tests/test_op_policy_moe_mla.py), bf16, one layer
SPEC = {**BASE, **MLA, "dtype_bytes": 2, "layers": 1, "vocab": 128}


def _dsv3_block(torch, spec):
    """torchtitan 0.3.0's DeepSeek-V3 MoE block for `spec` (no dense layer), bf16 parameters,
    its inner attention torchtitan's SDPA (the CPU flash kernel: Q/K and V head dims equal)."""
    framework_or_skip("torchtitan", "torchtitan 0.3.0's DeepSeek-V3 block not run")
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import _build_dsv3_layers

    (config,) = _build_dsv3_layers(
        n_layers=1,
        n_dense_layers=0,
        dim=spec.hidden,
        n_heads=spec.heads,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        mscale=1.0,
        dense_hidden_dim=spec.ffn_hidden,
        moe_hidden_dim=spec.moe_ffn_hidden,
        num_experts=spec.experts,
        num_shared_experts=1,
        router_top_k=spec.top_k,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=spec.qk_rope_head_dim, max_seq_len=spec.seq, theta=10000.0, scaling="none"
        ),
    )
    config.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    block = config.build()
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
        parameter.data = parameter.data.to(torch.bfloat16)  # RoPE's complex buffer stays
    return block


def _replayed_gemms(torch):
    """A dispatch mode counting the aten.mm and aten._grouped_mm calls that run with grad
    enabled: during the backward those are the checkpoints' replays (the gradients' GEMMs run
    with grad disabled); below the selective checkpoint's mode, so cached outputs are not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gemms = (torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default)

    class Counting(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.is_grad_enabled() and func in gemms:
                Counting.count += 1
            return func(*args, **(kwargs or {}))

    return Counting


SCOPED = [
    "sac@attention=attention",
    "sac@experts=expert_gate",
    "sac@attention=attention/moe=router",
    "sac@attention=q_down,kv_down/moe=router,expert_gate",
    "sac@attention/router/experts=expert_up/shared_experts=shared_gate_proj",
]


@pytest.mark.parametrize("text", SCOPED)
def test_exported_regions_replay_with_early_stop_on_torchtitans_block(text):
    """The snippet's regions on torchtitan's block re-run the GEMMs ckplan's early-stop replay
    predicts (`rerun_units`), fewer than a replay to each region's end; each region's cache
    holds its kept outputs, byte for byte; the gradients are the plain step's."""
    torch = torch_or_skip()
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.strategies import parse_strategy

    spec = spec_from_mapping(SPEC)
    block = _dsv3_block(torch, spec)
    plain = copy.deepcopy(block)
    namespace, modes = recording_snippet(evaluate(spec, parse_strategy(text, spec)))
    layer = namespace["scope_layer"](block)
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, dtype=torch.bfloat16)
    weights = torch.randn_like(x)
    x.requires_grad_()
    out = layer(x, None)
    cached = cached_storages(torch, modes)
    policy = parse_policy(text)
    units = unit_ops(spec)
    kept = kept_mask(spec, policy)
    assert sum(cached.values()) == sum(u.kept_bytes for u, k in zip(units, kept, strict=True) if k)

    counting = _replayed_gemms(torch)
    with counting():
        (out * weights).sum().backward()

    again = rerun_units(spec, policy)
    assert counting.count == sum(unit.matmul or unit.grouped for unit in again)
    whole = rerun_mask(units, kept_mask(spec, policy), "whole", policy_spans(spec, policy))
    to_the_end = sum(
        unit.matmul or unit.grouped for unit, run in zip(units, whole, strict=True) if run
    )
    assert counting.count < to_the_end

    hidden = x.detach().requires_grad_()
    (plain(hidden, None) * weights).sum().backward()
    for got, want in zip([*block.parameters(), x], [*plain.parameters(), hidden], strict=True):
        torch.testing.assert_close(got.grad, want.grad)
