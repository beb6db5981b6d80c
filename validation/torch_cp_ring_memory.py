"""What PyTorch's ring attention holds in its backward, counted on the CPU: the check behind
ckplan's context-parallel attention transient (ckplan.model.context_parallel, docs/memory.md).

Runs PyTorch's own `_templated_ring_attention` and `_templated_ring_attention_backward`
(torch/distributed/tensor/experimental/_context_parallel/_attention.py, PyTorch v2.13.0; the
loops read the same in the late-2024 text torchtitan 9dec370 ran) with their defaults: the
ALL_GATHER rotate method (torchtitan 9dec370's `context_parallel_rotate_method` default,
torchtitan 0.3.0 leaves PyTorch's), load balancing on, fp32 accumulation. The process group is
PyTorch's fake one (torch.testing._internal.distributed.fake_pg.FakeStore): one process plays
rank r of cp, every collective returns a buffer of the right size. The kernel is the CPU flash
pair `_scaled_dot_product_flash_attention_for_cpu(_backward)` (the CUDA kernel's arguments and
outputs less its RNG and length outputs); Q, K, V and the output gradient are bf16 (b, s, a, d)
tensors transposed to (b, a, s, d), as torchtitan 9dec370's Attention hands them to SDPA.

A TorchDispatchMode counts the bytes of every storage an op allocates inside the ring function,
alive while any tensor on it is (the inputs are not counted), and records the live bytes when
each kernel call starts. Printed per cp and rank, in units of one bf16 Q (= K = V) tensor, E:
the backward's live set at the kernel calls (the most of any call) beside ckplan's
`ring_backward_live_at_call_bytes`, and the largest set outside the calls beside the call's
peak as ckplan counts it (live + the step's gradients B·(q + kv) + the CUDA kernel's fp32 dQ
accumulator 4·q; the CPU kernel's own buffers are not seen).

Usage: python validation/torch_cp_ring_memory.py [--check]
"""

from __future__ import annotations

import sys
import weakref

SHAPE = {"b": 1, "a": 4, "s": 16, "d": 32}  # 2,048 values a tensor, 4,096 bytes in bf16
CPS = (2, 3, 4, 8)


def _live_tracker():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        """Bytes of the storages the ops allocate, alive while any tensor on them is."""

        def __init__(self, excluded: set[int]):
            super().__init__()
            self.excluded, self.storages, self.refs = excluded, {}, []
            self.live = self.peak = 0

        def track(self, tensor) -> None:
            if type(tensor) is not torch.Tensor:  # AsyncCollectiveTensor wraps a tracked one
                return
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer in self.excluded or storage.nbytes() == 0:
                return
            if pointer not in self.storages:
                self.storages[pointer] = [storage.nbytes(), 0]
                self.live += storage.nbytes()
            self.storages[pointer][1] += 1

            def release(_ref, pointer=pointer):
                entry = self.storages[pointer]
                entry[1] -= 1
                if entry[1] == 0:
                    self.live -= entry[0]
                    del self.storages[pointer]

            self.refs.append(weakref.ref(tensor, release))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.track(leaf)
            self.peak = max(self.peak, self.live)
            return out

    return LiveBytes


def measure(cp: int, rank: int) -> dict[str, float]:
    """The backward's live bytes at its kernel calls (the most) and its peak, in E."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.testing._internal.distributed.fake_pg import FakeStore

    aten = torch.ops.aten
    b, a, s, d = (SHAPE[k] for k in "basd")
    unit = b * a * s * d * 2
    at_calls: list[int] = []
    tracker: list = []

    def forward_op(q, k, v, is_causal, dropout_p=0.0, scale=None, **_):
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, scale=scale
        )

    def backward_op(query, key, value, out, logsumexp, is_causal, grad_out, **kwargs):
        at_calls.append(tracker[0].live)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=None
        )

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        group = dist.group.WORLD

        def bshd():
            return torch.randn(b, s, a, d, dtype=torch.bfloat16).transpose(1, 2)

        q, k, v, grad_out = bshd(), bshd(), bshd(), bshd()
        out, lse, *_ = ring._templated_ring_attention(group, 2, forward_op, q, k, v, True)
        inputs = (q, k, v, out, lse, grad_out)
        live_bytes = _live_tracker()({t.untyped_storage().data_ptr() for t in inputs})
        tracker.append(live_bytes)
        with live_bytes:
            grads = ring._templated_ring_attention_backward(
                group, 2, backward_op, grad_out, "grad_out", q, k, v, out, lse, True
            )
        del grads
    finally:
        dist.destroy_process_group()
    return {"at_calls": max(at_calls) / unit, "peak": live_bytes.peak / unit}


def main(check: bool) -> int:
    from ckplan.model.context_parallel import FP32_BYTES, ring_backward_live_at_call_bytes

    values = SHAPE["b"] * SHAPE["a"] * SHAPE["s"] * SHAPE["d"]
    unit = 2 * values
    failures = 0
    for cp in CPS:
        seen = [measure(cp, rank) for rank in range(cp)]
        at_calls = max(r["at_calls"] for r in seen)
        outside = max(r["peak"] for r in seen)
        live = ring_backward_live_at_call_bytes(cp, values, values, 2)
        # the call's peak on CUDA: live + dQ and half-length dK, dV (the `i <= rank` branch) +
        # the flash kernel's fp32 dQ accumulator
        call_peak = live + 2 * (values + values) + FP32_BYTES * values
        print(
            f"cp {cp}: live at the calls {at_calls:g} E (ckplan {live / unit:g} E); largest "
            f"outside the calls {outside:g} E, the call's peak {call_peak / unit:g} E"
        )
        # the live set may exceed ckplan's by the fp32 logsumexp chunk of the `i > rank` branch
        failures += not 0 <= at_calls - live / unit <= 0.25
        failures += outside > call_peak / unit
    return 1 if check and failures else 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
