"""The bytes PyTorch's ring attention moves beside its kernel calls, counted on the CPU: the
check behind ckplan's `context_parallel.ring_moved_bytes` (docs/time-model.md).

Runs PyTorch's own `_templated_ring_attention` and `_templated_ring_attention_backward`
(torch/distributed/tensor/experimental/_context_parallel/_attention.py, PyTorch v2.13.0; the
loops read the same in the late-2024 text torchtitan 9dec370 ran) with their defaults (the
ALL_GATHER rotate method, load balancing, fp32 accumulation) on PyTorch's fake process group,
one process playing each rank in turn. The kernel is a stand-in that makes its outputs with
the counting off, so only the ring's own ops are counted. A TorchDispatchMode adds up the
bytes of every op's tensor inputs and outputs, except views, collectives (a collective's
bytes are the network's, timed apart) and allocations, with the rules of validation/
te_cp_p2p_traffic.py: a copy's or fill's destination is written, not read, and `zeros_like`
reads nothing of its argument. Q, K, V and the output gradient are bf16 (b, s, a, d)
tensors transposed to (b, a, s, d), as torchtitan hands them to SDPA; K and V at the query
heads and at half of them, and two head sizes, separate the Q-, K/V- and logsumexp-sized
terms. Printed per cp: the mean over the ranks beside ckplan's.

Usage: python validation/torch_cp_ring_traffic.py [--check]
"""

from __future__ import annotations

import sys

SHAPES = ({"b": 1, "a": 8, "s": 16, "d": 32}, {"b": 1, "a": 8, "s": 16, "d": 64})
CPS = (2, 3, 4, 8)
NOT_COUNTED = {
    "view", "_unsafe_view", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand",
    "slice", "select", "chunk", "split", "split_with_sizes", "unbind", "alias", "as_strided",
    "detach", "wait_tensor", "_wrap_tensor_autograd",
}  # fmt: skip
# ops that write their first argument without reading it
OVERWRITES = {"copy_", "fill_", "zero_"}
# allocations: no kernel touches the memory
ALLOCATES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# factories shaped like their argument: a fill kernel writes the output, reading nothing
FILLS_LIKE = {"zeros_like", "ones_like", "full_like"}


def measure(cp: int, rank: int, shape: dict[str, int], kv_heads: int) -> tuple[int, int]:
    """Bytes the ring's ops move on rank `rank` of `cp`, (forward, backward)."""
    moved = _run(cp, rank, shape, kv_heads)
    return moved[0].bytes, moved[1].bytes


def exchanged(cp: int, rank: int, shape: dict[str, int], kv_heads: int) -> tuple[list, list]:
    """The collectives of the forward and of the backward on rank `rank` of `cp`: (name,
    bytes), an all-gather's whole gathered buffer, an all-to-all's input."""
    moved = _run(cp, rank, shape, kv_heads)
    return moved[0].sent, moved[1].sent


def _run(cp: int, rank: int, shape: dict[str, int], kv_heads: int) -> list:
    """The ring's forward and backward under one counting mode each."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Moved(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.paused, self.sent = 0, False, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("all_gather_into_tensor", "all_to_all_single"):
                sent = args[0].numel() * args[0].element_size()
                self.sent.append((name, sent * cp if name == "all_gather_into_tensor" else sent))
            if self.paused or name in NOT_COUNTED or name in ALLOCATES:
                return out
            if func.namespace in ("_c10d_functional", "c10d"):
                return out
            inputs = tree_leaves((args, kwargs))[1 if name in OVERWRITES else 0 :]
            if name in FILLS_LIKE:
                inputs = []
            tensors = [t for t in inputs + tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            return out

    b, a, s, d = (shape[k] for k in "basd")
    modes: list[Moved] = []

    def kernel_forward(q, k, v, is_causal, dropout_p=0.0, scale=None, **_):
        modes[-1].paused = True
        out = torch.randn_like(q), torch.randn(q.shape[:3], dtype=torch.float32)
        modes[-1].paused = False
        return out

    def kernel_backward(query, key, value, out, logsumexp, is_causal, grad_out, **_):
        modes[-1].paused = True
        grads = torch.randn_like(query), torch.randn_like(key), torch.randn_like(value)
        modes[-1].paused = False
        return grads

    def bshd(heads):
        return torch.randn(b, s, heads, d, dtype=torch.bfloat16).transpose(1, 2)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        group = dist.group.WORLD
        q, k, v, grad_out = bshd(a), bshd(kv_heads), bshd(kv_heads), bshd(a)
        modes.append(Moved())
        with modes[-1]:
            out, lse = ring._templated_ring_attention(group, 2, kernel_forward, q, k, v, True)
        modes.append(Moved())
        with modes[-1]:
            ring._templated_ring_attention_backward(
                group, 2, kernel_backward, grad_out, "grad_out", q, k, v, out, lse, True
            )
    finally:
        dist.destroy_process_group()
    return modes


def main(check: bool) -> int:
    from ckplan.model.context_parallel import ring_moved_bytes

    failures = 0
    for shape in SHAPES:
        b, a, s, d = (shape[k] for k in "basd")
        for kv_heads in (a, a // 2):
            for cp in CPS:
                seen = [measure(cp, rank, shape, kv_heads) for rank in range(cp)]
                forward = sum(f for f, _ in seen) / cp
                backward = sum(g for _, g in seen) / cp
                ours = ring_moved_bytes(cp, b * s * a * d, b * s * kv_heads * d, b * s * a)
                print(
                    f"d {d}, K/V heads {kv_heads}/{a}, cp {cp}: forward {forward:,.0f} B "
                    f"(ckplan {ours[0]:,}), backward {backward:,.0f} B (ckplan {ours[1]:,})"
                )
                failures += forward != ours[0] or backward != ours[1]
    return 1 if check and failures else 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
