"""The reserved peak beside the allocated one of torchtitan's 2-D (FSDP2 x tensor-parallel)
Llama 3 step and of its FSDP-only step, with `expandable_segments:True` (torchtitan's
run_llama_train.sh at 9dec370 exports PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"):
the steps' allocations and frees recorded on fake ranks and replayed through the allocator's
rules (validation/caching_allocator.py `ExpandableAllocator`).

The steps are those validation/torch_fsdp2_tp_memory.py (FSDP 32 x TP 8 at Llama 3 70B's
shapes, local batch 16 at 8192 tokens, full activation checkpointing, loss parallel) and
validation/torch_fsdp2_memory.py (FSDP 8 at Llama 3 8B's shapes, torchtitan's per-op SAC,
local batch 2) measure with FSDPMemTracker (`CASES`; `--layers` for fewer blocks). The fake
mode itself records each storage its ops return and its free (DTensor's handlers, loss
parallel's among them, run their local ops through it); the parameters and inputs alive before
the steps are one block made first, and views of them are not new storages
(`existing`). Storages are told apart by a number each carries, not by their address, which a
later storage reuses. Iteration 2 is replayed after iteration 1, its peaks reset at its start
(the pages iteration 1 mapped stay reserved).

What the replay leaves out: FSDP2 resizes the unsharded parameters' storages in place
(`storage.resize_`, no op the fake mode sees), so those storages are taken out of the trace
(`fsdp_resized_storages`): the gathered bf16 parameters in use (0.69 GiB at the 70B shapes) are
missing; the side streams (FSDP2's all-gather and reduce-scatter pools,
`fsdp2_stream_pool_bytes`) but with `--streams`; CUDA kernels (the CPU's SDPA, eager blocks
where the benchmark compiles them); torchao's float8 and asynchronous TP.

The replay's fidelity (`--h200`): validation/device/measure_plans.py's five one-GPU plans,
traced the same way and replayed as measured, against the H200 measurement with torch 2.11:
allocated peaks 64-67 MiB under the measured (CUDA's own), reserved peaks -108 to +332 MiB off
with the default allocator and -82 to +440 MiB with expandable segments
(validation/results-allocator-replay-h200-plans-torch-2.13.0.json).

Replayed with torch 2.13.0 and torchtitan 0.3.0, expandable segments
(validation/results-fsdp2-allocator-replay-torch-2.13.0.json): the 70B 2-D step's allocated
peak 57.46 GiB (FSDPMemTracker's less the unsharded parameters, to 1 MiB), reserved 64.46 GiB,
7.0 GiB beyond, 4.75 GiB of it one free block: the output layer's bf16 logits (3.91 GiB,
idle while every later request of the loss is fp32 and twice their size) and the final norm's
freed temporaries beside them; the 8B step 63.45 and 71.76 GiB, 8.3 GiB beyond, 3.91 GiB of
it the bf16 logits' block. ckplan's slack adds 4.1 and 4.9 GiB to its allocated peaks of those runs.

With `--streams` (`STREAM_CASES`, validation/results-fsdp2-default-allocator-streams-torch-
2.13.0.json) the trace records the stream each storage is made on (`stream_context`) and the
default allocator replays a pool per stream, as do expandable segments
(`StreamsExpandableAllocator`): torchao's MI300X row and Trainy's 32-GPU H200 row, both with
the default allocator, bf16, the loss compiled (`compiled_cross_entropy`) or eager. Compiled:
allocated peaks 29.73 and 39.39 GiB, reserved 38.71 and 46.05 GiB (34.65 and 43.67 on one
stream); the copy-in stream's pool is ckplan.model.frameworks `fsdp2_all_gather_pool_bytes` to
the byte, and the default stream holds the bf16 logits' freed segment beside the output layer's
backward (docs/memory.md). With expandable segments (`expandable_streams`) the default stream
holds, at the allocated peak under FSDP 8 at batch 1, 2.03 GiB beyond its allocated bytes with
the eager loss, 1.96 GiB of it one free block, the bf16 logits' (torchao's H100 row, the
December 2024 units, and the MI300X row's torchtitan 0.3 units, those of torchao's B200 rows),
and 0.07 and 0.46 GiB with the loss compiled; under FSDP 32 at batch 2 (Trainy's) 10.08 GiB with
the eager loss, a 5.97 GiB free block beside the logits' 3.91, and 0.21 GiB compiled.

Usage: python validation/fsdp2_tp_allocator_replay.py [--write] [--h200 | --streams] [--layers N
--kind tp|fsdp --ac full|op --batch B --seq S]
"""

from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from caching_allocator import CachingAllocator, ExpandableAllocator, StreamsExpandableAllocator

RESULTS = "validation/results-fsdp2-allocator-replay-torch-2.13.0.json"
STREAMS_RESULTS = "validation/results-fsdp2-default-allocator-streams-torch-2.13.0.json"
H200_RESULTS = "validation/results-allocator-replay-h200-plans-torch-2.13.0.json"


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
            self.ops: dict[int, str] = {}  # the op that made each recorded storage
            self.streams: dict[int, int] = {}  # the stream each storage was made on, not 0
            self.stream = 0  # the stream now current (`stream_context`)
            self.recording = False

        def _freed(self, key: int) -> None:
            if key in self.live:
                self.live.discard(key)
                self.events.append(("free", key, 0))

        def mark(self, name: str) -> None:
            self.events.append(("mark", name, 0))

        def existing(self, tensors) -> int:
            """Mark the storages of `tensors` (DTensors unwrapped) as made before the trace, so
            that views of them (a weight's transpose) are not taken for new storages; returns
            their bytes, each storage once."""
            total = 0
            for tensor in tensors:
                local = getattr(tensor, "_local_tensor", tensor)
                storage = local.untyped_storage()
                if not hasattr(storage, "_trace_key"):
                    storage._trace_key = None
                    total += storage.nbytes()
            return total

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.recording:
                for tensor in tree_flatten(out)[0]:
                    if not isinstance(tensor, torch.Tensor):
                        continue
                    storage = tensor.untyped_storage()
                    # a storage's Python object lives as long as the storage (PyObject
                    # preservation), so it carries its number; `_cdata`, the StorageImpl's
                    # address, is reused once a storage dies, before its finalizer runs
                    if storage.nbytes() and not hasattr(storage, "_trace_key"):
                        key = len(self.events)
                        storage._trace_key = key
                        self.live.add(key)
                        self.events.append(("alloc", key, storage.nbytes()))
                        self.ops[key] = str(func)
                        if self.stream:
                            self.streams[key] = self.stream
                        weakref.finalize(storage, self._freed, key)
            return out

    return RecordingFakeMode()


# FSDP2's streams (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py `FSDPCommContext`),
# numbered for the replay; 0 is the default stream
FSDP_STREAMS = (
    "all_gather_copy_in_stream",
    "all_gather_stream",
    "reduce_scatter_stream",
    "all_reduce_stream",
)


def stream_context(trace):
    """A stand-in for `torch.cpu.stream` (the device handle FSDP2 uses on CPU ranks,
    `_get_device_handle`) that makes the trace record the stream each storage is made on:
    FSDP2 allocates its all-gather output on the copy-in stream and its reduce-scatter output,
    the sharded gradients, on the reduce-scatter stream (`foreach_all_gather`, `foreach_reduce`,
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). Streams are numbered from 1 in
    the order first entered; `name_streams` names them."""
    import contextlib

    numbers: dict[int, int] = {}

    @contextlib.contextmanager
    def stream(value):
        previous = trace.stream
        trace.stream = numbers.setdefault(id(value), len(numbers) + 1) if value else 0
        trace.stream_objects = {**getattr(trace, "stream_objects", {}), trace.stream: value}
        try:
            yield
        finally:
            trace.stream = previous

    return stream


def name_streams(trace, model) -> dict[int, str]:
    """The FSDP2 stream name of each number `stream_context` gave."""
    comm = model._get_fsdp_state()._comm_ctx
    named = {id(getattr(comm, name, None)): name for name in FSDP_STREAMS}
    return {
        number: named.get(id(value), f"stream {number}")
        for number, value in getattr(trace, "stream_objects", {}).items()
        if number
    }


def compiled_cross_entropy():
    """A stand-in for torchtitan's cross-entropy under torch.compile (the upcast and
    `F.cross_entropy` compiled with the model, torchtitan/components/loss.py at 6fc499f), with
    the storages ckplan.model.loss's `compiled` loss says Inductor's graph makes (measured there
    with validation/torch_float8_sac.py, torch 2.13): the forward saves the B-byte logits (its
    input) and two fp32 statistics per token, and makes no fp32 copy of the logits; the
    backward writes the logits' B-byte gradient in one fused kernel. Inductor itself does not
    run under the fake mode, so its allocations are these, not traced."""
    import torch

    class CompiledCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels):
            tokens = logits.shape[0]
            maximum = logits.new_empty(tokens, dtype=torch.float32)
            sum_exp = logits.new_empty(tokens, dtype=torch.float32)
            ctx.save_for_backward(logits, maximum, sum_exp)
            return logits.new_zeros((), dtype=torch.float32)

        @staticmethod
        def backward(ctx, grad):
            logits, _, _ = ctx.saved_tensors
            return torch.empty_like(logits), None

    return CompiledCrossEntropy.apply


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
            keys.update(getattr(tensor.untyped_storage(), "_trace_key", None) for tensor in tensors)
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


def trace_step(
    kind: str,
    layers: int,
    ac: str = "full",
    batch: int = 0,
    seq: int = 8192,
    shape=None,
    world: int = 8,
    layout: str = "202412",
    loss: str = "eager",
    steps: int = 2,
):
    """The recorded events of two steps and the bytes alive before them; `shape` overrides the
    harness's model shape (dim, heads, kv_heads, ffn, vocab); `world` the FSDP degree and
    `layout` torchtitan's FSDP units (torch_fsdp2_memory.py `build`) of the FSDP-only step;
    `loss` "eager" (the upcast and F.cross_entropy) or "compiled" (`compiled_cross_entropy`);
    `steps` the steps traced, the last marked "forward", "backward", "step", the others
    "warmup[ N]" (-backward, -step).
    Each storage's stream (not the default) is in `trace_step.streams`, numbered, and their
    names in `trace_step.stream_names`."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if kind == "tp":
        import torch_fsdp2_tp_memory as harness

        shape = {**harness.SHAPE, **(shape or {}), "layers": layers, "seq": seq}
        dims, names, batch = (32, 8), ("dp_shard", "tp"), batch or 16
    else:
        import torch_fsdp2_memory as harness

        shape = {**harness.SHAPE, **(shape or {}), "layers": layers, "seq": seq}
        dims, names, batch = (world,), None, batch or 2
    vocab = shape["vocab"]
    loss_kind = loss
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
    from unittest import mock

    with context, mock.patch.object(torch.cpu, "stream", stream_context(trace)):
        if kind == "tp":
            model = harness.build(torch, shape, mesh)
        else:
            model = harness.build(torch, shape, ac, layout, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        tokens = torch.randint(0, vocab, (batch, seq))
        labels = torch.randint(0, vocab, (batch, seq))
        positions = torch.arange(seq).repeat(batch, 1)
        before = trace.existing([*model.parameters(), tokens, labels, positions])
        trace.recording = True
        for iteration in range(steps):
            last = iteration == steps - 1
            warmup = "warmup" + (f" {iteration}" if iteration else "")
            trace.mark("forward" if last else warmup)
            with loss_parallel():
                pred = model(tokens, positions)
                if loss_kind == "compiled":
                    loss = compiled_cross_entropy()(pred.flatten(0, 1), labels.flatten(0, 1))
                else:
                    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
                del pred
                trace.mark("backward" if last else f"{warmup}-backward")
                loss.backward()
            del loss
            trace.mark("step" if last else f"{warmup}-step")
            optimizer.step()
            optimizer.zero_grad()
        trace.mark("end")
        trace.recording = False
        resized = fsdp_resized_storages(model)
        trace_step.streams = dict(trace.streams)
        trace_step.stream_names = name_streams(trace, model)
    events = [event for event in trace.events if event[0] == "mark" or event[1] not in resized]
    dist.destroy_process_group()
    return events, before


def at_allocated_peak(events, allocator, before: int, streams: dict | None = None) -> dict:
    """Replay `events` (after the `before` block) and report iteration 2's allocated peak, the
    reserved bytes then and at the end, and the free mapped blocks (the holes) at that peak,
    largest first; with `streams` (storage -> stream number, the default allocator only) each
    storage is allocated on its stream, and the reserved bytes and holes of each stream are
    reported too."""
    streams = streams or {}

    def replay_to(stop):
        allocator_now = type(allocator)()
        allocator_now.malloc(before)
        live, inside, best = {}, False, (0, -1)
        for index, (kind, key, size) in enumerate(events):
            if kind == "mark":
                inside = key in ("forward", "backward", "step")
                continue
            if kind == "alloc":
                stream = streams.get(key, 0)
                live[key] = (
                    allocator_now.malloc(size, stream) if stream else allocator_now.malloc(size)
                )
            elif key in live:
                allocator_now.free(live.pop(key))
            if inside and allocator_now.allocated > best[0]:
                best = (allocator_now.allocated, index)
            if index == stop:
                break
        return allocator_now, best

    finished, (_, peak_index) = replay_to(None)
    at_peak, _ = replay_to(peak_index)
    result = {
        "allocated_peak": at_peak.allocated,
        "reserved_at_peak": at_peak.reserved,
        "reserved_peak": finished.peak_reserved,
        "holes_at_peak": sorted(at_peak.cached(), reverse=True)[:8],
    }
    if streams:
        result["by_stream_at_peak"] = {
            str(stream): {
                "reserved": at_peak.reserved_by_stream.get(stream, 0),
                "allocated": at_peak.allocated_by_stream.get(stream, 0),
                "holes": sorted(at_peak.cached(stream), reverse=True)[:8],
            }
            for stream in sorted({0, *streams.values()})
        }
    return result


# The cases: the benchmark's 70B 2-D run (Table 4 row 1) and 8B FSDP run (Table 1 row 1)
CASES = (
    {"kind": "tp", "layers": 80, "ac": "full", "batch": 16, "seq": 8192},
    {"kind": "fsdp", "layers": 32, "ac": "op", "batch": 2, "seq": 8192},
)


def measure(case: dict) -> dict:
    events, before = trace_step(
        case["kind"], case["layers"], case["ac"], case["batch"], case["seq"]
    )
    return {
        **case,
        "expandable_segments": at_allocated_peak(events, ExpandableAllocator(), before),
        "default": at_allocated_peak(events, CachingAllocator(), before),
    }


# The default allocator's published torchtitan FSDP runs (the calibration ones), as far as the
# trace can run them: bf16 (no torchao here, so no float8), the blocks eager (no torch.compile
# under the fake mode), the loss compiled as the runs compile it (`compiled_cross_entropy`) and,
# for contrast, eager; torchao's MI300X bf16 row (FSDP 8, local batch 1, torchtitan 0.3's units,
# the units and shape of its B200 rows too) and Trainy's 32-GPU H200 row (FSDP 32, local batch
# 2, the December 2024 units); and torchao's H100 bf16 row, with expandable segments (FSDP 8,
# local batch 1, the December 2024 units, the loss eager as that run's)
STREAM_RUNS = (
    {"kind": "fsdp", "layers": 32, "ac": "op", "batch": 1, "seq": 8192, "world": 8,
     "layout": "0.3.0", "steps": 3, "run": "torchao-mi300x-llama3-8b-fsdp8-bf16-compile"},
    {"kind": "fsdp", "layers": 32, "ac": "op", "batch": 2, "seq": 8192, "world": 32,
     "layout": "202412", "steps": 3,
     "run": "torchtitan-trainy-llama3-8b-h200-32gpu-fsdp-float8"},
    {"kind": "fsdp", "layers": 32, "ac": "op", "batch": 1, "seq": 8192, "world": 8,
     "layout": "202412", "steps": 3, "run": "torchao-h100-llama3-8b-fsdp8-bf16-compile"},
)  # fmt: skip
STREAM_CASES = tuple({**run, "loss": loss} for run in STREAM_RUNS for loss in ("compiled", "eager"))


def measure_streams(case: dict) -> dict:
    """One FSDP case replayed through the default allocator on one stream and on FSDP2's
    streams (`stream_context`) and with expandable segments on them: the last step's allocated
    peak (step 3: the reserved bytes no longer grow from step 2 on), the reserved bytes then,
    and each stream's reserved, allocated and idle bytes at that peak."""
    events, before = trace_step(
        case["kind"], case["layers"], case["ac"], case["batch"], case["seq"],
        world=case["world"], layout=case["layout"], loss=case["loss"], steps=case["steps"],
    )  # fmt: skip
    streams, names = trace_step.streams, trace_step.stream_names
    on_streams = at_allocated_peak(events, CachingAllocator(), before, streams)
    stream_names = {"0": "default", **{str(k): v for k, v in names.items()}}
    on_streams["stream_names"] = stream_names
    expandable = at_allocated_peak(events, StreamsExpandableAllocator(), before, streams)
    expandable["stream_names"] = stream_names
    return {
        **case,
        "one_stream": at_allocated_peak(events, CachingAllocator(), before),
        "streams": on_streams,
        "expandable_streams": expandable,
    }


# measure_plans.py's plans that run on the GPU alone (offload's pinned host copies are not
# device memory, which a CPU trace cannot tell apart)
H200_PLANS = ("none", "full", "selective", "sac", "lora")


def replay_measure_plans(plans=H200_PLANS) -> list[dict]:
    """The fidelity check: validation/device/measure_plans.py's steps (the Llama-like model on
    one GPU, measured on an H200 with torch 2.11, validation/device/results-h200-*.json)
    traced under the fake mode and replayed as measure_plans.py measures them (two steps, the
    peaks reset, two more), beside the measured allocated and reserved peaks."""
    import json

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent / "device"))
    import measure_plans

    device = Path(__file__).resolve().parent / "device"
    measured = {
        mode: {
            plan["plan"]: plan
            for plan in json.loads((device / name).read_text(encoding="utf-8"))["plans"]
        }
        for mode, name in (
            ("default", "results-h200-torch-2.11.json"),
            ("expandable_segments", "results-h200-torch-2.11-expandable.json"),
        )
    }
    shape = measure_plans.SHAPE
    rows = []
    for plan in plans:
        trace = recording_fake_mode()
        with trace:
            torch.manual_seed(0)
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # the model made in bf16 (`.to` fails fake)
            try:
                model = measure_plans.Model(shape, plan)
            finally:
                torch.set_default_dtype(default_dtype)
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-5)
            tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]))
            targets = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]))
            before = trace.existing([*model.parameters(), tokens, targets])
            trace.recording = True
            for step in range(4):
                trace.mark("forward" if step == 2 else f"step {step}")
                optimizer.zero_grad(set_to_none=True)
                model(tokens, targets).backward()
                optimizer.step()
            trace.mark("end")
            trace.recording = False
        row = {"plan": plan}
        for mode, allocator in (
            ("default", CachingAllocator()),
            ("expandable_segments", ExpandableAllocator()),
        ):
            replayed, _ = replay_marked(trace.events, allocator, before)
            row[mode] = {
                "replayed_allocated": replayed.peak_allocated,
                "replayed_reserved": replayed.peak_reserved,
                "measured_allocated": measured[mode][plan]["max_memory_allocated"],
                "measured_reserved": measured[mode][plan]["max_memory_reserved"],
            }
        rows.append(row)
    return rows


def main(argv=None) -> int:
    from torch_fsdp2_memory import report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="one case at this many blocks")
    parser.add_argument("--kind", choices=("tp", "fsdp"), default="tp")
    parser.add_argument("--ac", choices=("full", "op"), default="full", help="fsdp: AC policy")
    parser.add_argument("--batch", type=int, default=0, help="default 16 (tp), 2 (fsdp)")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--streams",
        action="store_true",
        help="the default allocator with FSDP2's streams on STREAM_CASES",
    )
    parser.add_argument("--h200", action="store_true", help="replay measure_plans.py's steps")
    parser.add_argument(
        "--write", action="store_true", help=f"write {RESULTS} (the CASES) or {H200_RESULTS}"
    )
    args = parser.parse_args(argv)
    cases = CASES
    if args.layers:
        batch = args.batch or (16 if args.kind == "tp" else 2)
        cases = ({"kind": args.kind, "layers": args.layers, "ac": args.ac, "batch": batch,
                  "seq": args.seq},)  # fmt: skip
    if args.streams:
        rows = report([measure_streams(case) for case in STREAM_CASES], STREAMS_RESULTS, args)
        gib = 2**30
        for row in rows:
            one, on = row["one_stream"], row["streams"]
            print(
                f"{row['run']} ({row['loss']} loss): allocated "
                f"{on['allocated_peak'] / gib:.3f} GiB, reserved "
                f"{one['reserved_at_peak'] / gib:.3f} (one stream) / "
                f"{on['reserved_at_peak'] / gib:.3f} GiB (streams)"
            )
            grown = row["expandable_streams"]
            print(f"  expandable segments: reserved {grown['reserved_at_peak'] / gib:.3f} GiB")
            for number, part in on["by_stream_at_peak"].items():
                print(
                    f"  {on['stream_names'][number]:26s} reserved {part['reserved'] / gib:.3f}"
                    f" allocated {part['allocated'] / gib:.3f} idle "
                    + ", ".join(f"{hole / gib:.3f}" for hole in part["holes"])
                )
        return 0
    if args.h200:
        rows = report(replay_measure_plans(), H200_RESULTS, args)
        mib = 2**20
        for row in rows:
            for mode in ("default", "expandable_segments"):
                r = row[mode]
                print(
                    f"{row['plan']:9s} {mode:19s} replayed {r['replayed_allocated'] // mib} / "
                    f"{r['replayed_reserved'] // mib} MiB, measured "
                    f"{r['measured_allocated'] // mib}"
                    f" / {r['measured_reserved'] // mib} MiB (allocated / reserved)"
                )
        return 0
    results = report([measure(case) for case in cases], RESULTS, args)
    gib = 2**30
    for case in results:
        for mode in ("expandable_segments", "default"):
            peak = case[mode]
            print(
                f"{case['kind']} {case['layers']} blocks {mode}: allocated peak "
                f"{peak['allocated_peak'] / gib:.3f} GiB, reserved then "
                f"{peak['reserved_at_peak'] / gib:.3f} GiB, reserved peak "
                f"{peak['reserved_peak'] / gib:.3f} GiB; holes "
                + ", ".join(f"{hole / gib:.3f}" for hole in peak["holes_at_peak"])
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
