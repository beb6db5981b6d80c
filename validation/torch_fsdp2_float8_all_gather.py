"""What torchao's float8 all-gather under FSDP2 holds, on the CPU: a Llama-like block's linears
converted by `convert_to_float8_training` (tensorwise, `enable_fsdp_float8_all_gather=True`,
emulated GEMMs), `fully_shard`ed over a fake process group of WORLD ranks with torchtitan's
MixedPrecisionPolicy (param_dtype bfloat16, reduce_dtype float32); then one forward and
backward with the scales precomputed (`precompute_float8_dynamic_scale_for_fsdp`). Prints JSON:
each parameter's unsharded type, dtype and bytes after the forward's all-gather, whether it is
a view of FSDP2's all-gather output (no copy), against bf16 without the key; and the
high-precision tensors of a converted weight's shape that any op makes in the forward and
backward (a bf16 or fp32 copy of an unsharded weight would be one).

Needs torch (2.13 was run) and torchao (0.18 was run: `pip install torchao`). The fake process
group moves no data, so the values gathered are garbage; the sizes and dtypes are FSDP2's.
ckplan's counterpart: ckplan.model.frameworks `fsdp2_gathered_bytes`.

    python validation/torch_fsdp2_float8_all_gather.py
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORLD = 8
HIDDEN, FFN, KV = 256, 768, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(HIDDEN)
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = nn.Linear(HIDDEN, KV, bias=False)
        self.wv = nn.Linear(HIDDEN, KV, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.ffn_norm = nn.RMSNorm(HIDDEN)
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w3 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        h = self.attention_norm(x)
        x = x + self.wo(self.wq(h) + (self.wk(h) + self.wv(h)).repeat(1, HIDDEN // KV))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class WeightShapedOutputs:
    """A dispatch mode counting, by op and dtype, the outputs shaped like a linear's unsharded
    weight (or its transpose)."""

    def __init__(self, shapes) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self.seen: dict[str, int] = {}
        wanted = set(shapes) | {shape[::-1] for shape in shapes}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and tuple(t.shape) in wanted:
                        key = f"{func.__name__} {t.dtype}"
                        outer.seen[key] = outer.seen.get(key, 0) + 1
                return out

        self.mode = Mode()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def storage_bytes(tensor) -> int:
    inner = getattr(tensor, "_local_tensor", tensor)
    inner = getattr(inner, "_data", inner)  # a Float8Tensor's float8 bytes
    return inner.numel() * inner.element_size()


def measure(float8_all_gather: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    block = Block()
    if float8_all_gather:
        from torchao.float8 import (
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        convert_to_float8_training(block, config=config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(block, mp_policy=policy, reshard_after_forward=False)
    if float8_all_gather:
        precompute_float8_dynamic_scale_for_fsdp(block)
    x = torch.randn(2, 16, HIDDEN).flatten(0, 1)
    shapes = {tuple(m.weight.shape) for m in block.modules() if isinstance(m, nn.Linear)}
    copies = WeightShapedOutputs(shapes)
    with copies:
        out = block(x)
    state = block._get_fsdp_state()._fsdp_param_group
    params = {}
    for fsdp_param in state.fsdp_params:
        unsharded = fsdp_param._unsharded_param
        inner = getattr(unsharded, "_local_tensor", unsharded)
        params[fsdp_param._param_fqn] = {
            "type": type(inner).__name__,
            "dtype": str(getattr(inner, "_data", inner).dtype),
            "unsharded_bytes": storage_bytes(unsharded),
            "all_gather_output_bytes": sum(
                t.numel() * t.element_size() for t in fsdp_param.all_gather_outputs
            ),
            "views_the_all_gather_output": any(
                getattr(inner, "_data", inner).untyped_storage().data_ptr()
                == t.untyped_storage().data_ptr()
                for t in fsdp_param.all_gather_outputs
            ),
        }
    with copies:
        out.float().sum().backward()
    return {"params": params, "weight_shaped_outputs": copies.seen}


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    result = {"world": WORLD, "bf16": measure(False), "float8_all_gather": measure(True)}
    for case in ("bf16", "float8_all_gather"):
        result[case + "_total_unsharded_bytes"] = sum(
            p["unsharded_bytes"] for p in result[case]["params"].values()
        )
    print(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
