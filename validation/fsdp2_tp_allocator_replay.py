"""The reserved peak beside the allocated one of torchtitan's 2-D (FSDP2 x tensor-parallel)
Llama 3 step and of its FSDP-only step, with `expandable_segments:True` (torchtitan's
run_llama_train.sh at 9dec370 exports PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"):
the steps' allocations and frees recorded on fake ranks and replayed through the allocator's
rules (validation/caching_allocator.py `ExpandableAllocator`).

The steps are those validation/torch_fsdp2_tp_memory.py (FSDP 32 x TP 8 at Llama 3 70B's
shapes, local batch 16 at 8192 tokens, full activation checkpointing, loss parallel) and
validation/torch_fsdp2_memory.py (FSDP 8 at Llama 3 8B's shapes) measure with FSDPMemTracker,
with fewer blocks (`--layers`). The fake mode itself records each storage its ops return and its
free (DTensor's handlers, loss parallel's among them, run their local ops through it); the
sharded parameters alive before the steps are one block made first. Iteration 2 is replayed
after iteration 1, its peaks reset at its start (the pages iteration 1 mapped stay reserved);
the phases end at the loss (`forward`, the loss's forward included), after its backward
(`backward`) and after the optimizer step.

What the replay leaves out: FSDP2 resizes the unsharded parameters' storages in place
(`storage.resize_`, no op the fake mode sees), so those storages are taken out of the trace
(`fsdp_resized_storages`): the gathered bf16 parameters of the blocks in use (214 MB a block
at the 70B shapes over t 8) are missing; the side streams (FSDP2's all-gather and reduce-scatter
pools, `fsdp2_stream_pool_bytes`); CUDA kernels (the CPU's SDPA, eager blocks where the
benchmark compiles them); torchao's float8 and asynchronous TP.

Replayed with torch 2.13.0 and torchtitan 0.3.0 (allocated and reserved peaks of iteration 2,
expandable segments): FSDP 32 x TP 8 at the 70B shapes with 80 blocks, 58.49 and 70.21 GiB
(11.7 GiB beyond; ckplan's allocated peak of the published run is 57.85 GiB, its slack adds
7.15 %, 4.1 GiB); FSDP 8 at the 8B shapes with 32 blocks (batch 2, full recomputation), 58.15
and 66.27 GiB (8.1 GiB beyond). The default allocator: 58.49 and 74.34 GiB; 58.15 and 64.68.

Usage: python validation/fsdp2_tp_allocator_replay.py [--layers 4] [--kind tp|fsdp]
"""

from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from caching_allocator import CachingAllocator, ExpandableAllocator


def recording_fake_mode():
    """A FakeTensorMode that records ("alloc", key, bytes) and ("free", key, 0) for each storage
    its ops return while `recording` is set: every local op, a DTensor's included (DTensor's
    handlers, loss parallel's among them, run their local ops through the fake mode), where a
    dispatch mode above DTensor would see only each DTensor op's outputs."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten

    class RecordingFakeMode(FakeTensorMode):
        def __init__(self):
            super().__init__()
            self.events: list[tuple[str, object, int]] = []
            self.live: set[int] = set()
            self.recording = False

        def _freed(self, key: int) -> None:
            if key in self.live:
                self.live.discard(key)
                self.events.append(("free", key, 0))

        def mark(self, name: str) -> None:
            self.events.append(("mark", name, 0))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.recording:
                for tensor in tree_flatten(out)[0]:
                    if not isinstance(tensor, torch.Tensor):
                        continue
                    storage = tensor.untyped_storage()
                    key = storage._cdata
                    if storage.nbytes() and key not in self.live:
                        self.live.add(key)
                        self.events.append(("alloc", key, storage.nbytes()))
                        weakref.finalize(storage, self._freed, key)
            return out

    return RecordingFakeMode()


def fsdp_resized_storages(model) -> set[int]:
    """The storages FSDP2 frees and remakes in place (`free_storage` / `alloc_storage`,
    `untyped_storage().resize_`, which no dispatched op shows): each parameter's unsharded
    parameter and all-gather outputs (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)."""
    keys = set()
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        for fsdp_param in group.fsdp_params if group else ():
            tensors = list(getattr(fsdp_param, "all_gather_outputs", ()))
            if hasattr(fsdp_param, "_unsharded_param"):
                tensors.append(fsdp_param._unsharded_param)
            keys.update(tensor.untyped_storage()._cdata for tensor in tensors)
    return keys


def replay_marked(events, allocator, before: int):
    """Replay `events` after one `before`-byte block; the peaks restart at the mark "step2".
    Returns (allocator, allocated and reserved peak per phase mark)."""
    allocator.malloc(before)
    live = {}
    phases: dict[str, tuple[int, int]] = {}
    current = None
    for kind, key, size in events:
        if kind == "alloc":
            live[key] = allocator.malloc(size)
        elif kind == "free":
            if key in live:
                allocator.free(live.pop(key))
        else:
            if current is not None:
                phases[current] = (allocator.peak_allocated, allocator.peak_reserved)
            current = key
            if key == "forward":
                allocator.reset_peaks()
    return allocator, phases


def trace_step(kind: str, layers: int):
    """The recorded events of two steps and the bytes alive before them."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if kind == "tp":
        import torch_fsdp2_tp_memory as harness

        shape = {**harness.SHAPE, "layers": layers, "seq": 8192}
        dims, names, batch = (32, 8), ("dp_shard", "tp"), 16
    else:
        import torch_fsdp2_memory as harness

        shape = {**harness.SHAPE, "layers": layers, "seq": 8192}
        dims, names, batch = (8,), None, 2
    seq, vocab = 8192, shape["vocab"]
    world = 1
    for d in dims:
        world *= d
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    if kind == "tp":
        from torch.distributed.tensor.parallel import loss_parallel

        trace = recording_fake_mode()
        context = harness.fake_dtensor_workarounds(trace)
    else:
        import contextlib

        trace = recording_fake_mode()
        context = trace
        loss_parallel = contextlib.nullcontext
    with context:
        if kind == "tp":
            model = harness.build(torch, shape, mesh)
        else:
            model = harness.build(torch, shape, "full", "202412", mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        tokens = torch.randint(0, vocab, (batch, seq))
        labels = torch.randint(0, vocab, (batch, seq))
        positions = torch.arange(seq).repeat(batch, 1)
        before = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes
                     for p in model.parameters())  # fmt: skip
        trace.recording = True
        for iteration in range(2):
            trace.mark("forward" if iteration else "warmup")
            with loss_parallel():
                pred = model(tokens, positions)
                loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
                del pred
                trace.mark("backward" if iteration else "warmup-backward")
                loss.backward()
            del loss
            trace.mark("step" if iteration else "warmup-step")
            optimizer.step()
            optimizer.zero_grad()
        trace.mark("end")
        trace.recording = False
        resized = fsdp_resized_storages(model)
    events = [event for event in trace.events if event[0] == "mark" or event[1] not in resized]
    dist.destroy_process_group()
    return events, before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kind", choices=("tp", "fsdp"), default="tp")
    args = parser.parse_args(argv)
    events, before = trace_step(args.kind, args.layers)
    gib = 2**30
    for allocator in (ExpandableAllocator(), CachingAllocator()):
        allocator, phases = replay_marked(events, allocator, before)
        print(type(allocator).__name__, args.kind, args.layers, "blocks")
        for phase, (allocated, reserved) in phases.items():
            print(
                f"  {phase:16s} allocated peak {allocated / gib:8.3f} GiB, reserved peak "
                f"{reserved / gib:8.3f} GiB, beyond {(reserved - allocated) / gib:6.3f} GiB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
