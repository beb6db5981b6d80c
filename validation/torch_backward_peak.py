#!/usr/bin/env python3
"""Measure the peak memory of ONE transformer layer's forward + backward with PyTorch's memory
profiler, and compare it with ckplan's backward walk (`ckplan.model.memory.layer_backward_walk`).

This validates what ckplan adds to a layer's backward beyond its tape, δ_out and δ_in: the
gradients in flight and the kernels' temporaries (docs/validation.md, "Backward peak"). PyTorch
is an optional dependency, used only here and in torch_saved_bytes.py, whose layers and configs
this script reuses.

Method
------
* The layer input x (requires_grad, standing for the previous layer's output) and the gradient
  of the layer output δ_out are allocated before profiling: both are alive throughout, as in
  ckplan's chain (x is norm1's saved input; δ_out is freed only after the layer's backward).
* Under `torch.profiler.profile(activities=[CPU], profile_memory=True, record_shapes=True,
  with_stack=True)`: the forward; then the output's storage is freed (`resize_(0)`: nothing
  saved it, and the chain frees a stage output no forward consumes); then
  `torch.autograd.grad(out, x, δ_out)`. Asking for the input gradient only makes autograd skip
  every weight-gradient matmul (`Node.task_should_compute_output`): parameter gradients are
  model states, which ckplan counts separately, and no parameter-gradient temporary is run.
* Live bytes: the profiler's allocation events (`prof._memory_profile()._op_tree`: every
  allocation and free with its size, the data `MemoryProfileTimeline` is built from), replayed
  in time order on top of x and δ_out. Parameters were allocated before the profile, so they
  are not in it. The peak is taken after every single allocation, so a temporary freed within
  the same microsecond still counts (`MemoryProfileTimeline._coalesce_timeline` keeps one
  point per microsecond; its peak without the PARAMETER column is reported as a cross-check).
* Attribution: a backward allocation sits under an "autograd::engine::evaluate_function:
  <Node>" event whose sequence number is that of the forward op that made the node; forward ops
  are tagged with ckplan's op names by recording the sequence number at which each tagged
  block starts (untagged view and residual-add ops fall under the op before them).
* BLAS workspace: a CPU GEMM library may allocate packing/conversion buffers through torch's
  allocator and free them before the call returns (oneDNN's bf16 matmul scratchpad). They are
  the library's, not tensors autograd or the model keeps, so ckplan does not model them. Each
  GEMM call (aten::mm, bmm, addmm, ...) inside a backward node is probed: the same aten op, on
  operands of the same sizes, strides and dtype, run alone under the same profiler
  (`_probe_blas_workspace`). When the bytes it allocates and frees inside itself there equal
  those of the call in the layer's backward, they are left out of the live bytes and reported
  as the step's `blas_workspace_bytes`; otherwise they stay in, with a note. A probe that finds
  none changes nothing.

Usage
-----
    python validation/torch_backward_peak.py --list
    python validation/torch_backward_peak.py --compare            # measured vs predicted, per op
    python validation/torch_backward_peak.py --compare --output   # and the output stage
    python validation/torch_backward_peak.py --compare --output --json
    python validation/torch_backward_peak.py --compare --config gpt-bf16-nodrop --seq 512
    python validation/torch_backward_peak.py --compare --device cuda   # needs a CUDA build
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch._C._profiler import _EventType, _TensorMetadata
    from torch.profiler import ProfilerActivity, profile
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("torch_backward_peak.py needs PyTorch: python3 -m pip install torch")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch_saved_bytes as tsb  # noqa: E402  (the layers, configs and ckplan mapping)

Config = tsb.Config
EVALUATE = "autograd::engine::evaluate_function: "


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------


def default_configs() -> list[Config]:
    """The configs of torch_saved_bytes.py that ckplan models op for op, the eager ones for
    contrast, and long-sequence variants (as/h = 16) whose peak is in the attention part."""
    known = {c.name: c for c in tsb.default_configs()}
    names = [
        "gpt-bf16-dropout-native",
        "gpt-bf16-nodrop",
        "gpt-bf16-sdpa",
        "llama-bf16-fused",
        "gpt-fp32-dropout",
        "gpt-bf16-dropout",
        "llama-bf16-sdpa",
        "llama-bf16-fusedswiglu",
    ]
    configs = [dataclasses.replace(known[n]) for n in names]
    for base in ("gpt-bf16-dropout-native", "gpt-bf16-nodrop"):
        long = dataclasses.replace(known[base], name=f"{base}-s512", seq=512)
        long.description += " [seq=512: as/h = 16]"
        configs.append(long)
    return configs


# --------------------------------------------------------------------------------------------
# The output stage: final norm, output layer, loss
# --------------------------------------------------------------------------------------------


class VocabCrossEntropy(torch.autograd.Function):
    """Megatron-LM's vocab-parallel cross-entropy on one rank
    (megatron/core/tensor_parallel/cross_entropy.py, _VocabParallelCrossEntropy, t = 1): an fp32
    copy of the logits becomes the softmax in place and is saved; the backward writes the
    gradient into it in place and returns it in fp32 (autograd casts it to the logits' dtype)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.float()  # (b, s, V) fp32 copy
        logits.sub_(logits.max(dim=-1, keepdim=True)[0])
        predicted = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (b, s)
        torch.exp(logits, out=logits)
        sum_exp = logits.sum(dim=-1, keepdim=True)  # (b, s, 1)
        loss = torch.log(sum_exp.squeeze(-1)) - predicted  # (b, s)
        logits.div_(sum_exp)  # the softmax, in place
        ctx.save_for_backward(logits, target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, target = ctx.saved_tensors
        grad = softmax  # in place, as Megatron
        rows = grad.view(-1, grad.shape[-1])
        rows[torch.arange(rows.shape[0]), target.view(-1)] -= 1.0
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None


class OutputStage(nn.Module):
    """Final norm, output layer (no bias), loss: `megatron` (VocabCrossEntropy) or `torch`
    (F.cross_entropy on fp32 logits, as Hugging Face's loss does)."""

    def __init__(self, cfg: Config, vocab: int, loss: str):
        super().__init__()
        norms = {"gpt": lambda n: nn.LayerNorm(n), "llama": tsb.FusedRMSNorm}
        self.norm = norms[cfg.arch](cfg.hidden)
        self.output = nn.Linear(cfg.hidden, vocab, bias=False)
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(x))  # (b, s, V)
        if self.loss == "megatron":
            return VocabCrossEntropy.apply(logits, target).mean()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1))


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def _next_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will get."""
    return (torch.empty(0, requires_grad=True) * 1).grad_fn._sequence_nr()


class OpTagger:
    """Passed as `rec` to the layers: records where each ckplan op starts, by sequence number."""

    def __init__(self) -> None:
        self.starts: list[tuple[int, str]] = []

    @contextlib.contextmanager
    def op(self, name: str) -> Iterator[None]:
        self.starts.append((_next_sequence_nr(), name))
        yield

    def name_of(self, sequence_nr: int) -> str | None:
        found = None
        for start, name in self.starts:
            if start > sequence_nr:
                break
            found = name
        return found


@dataclass
class Step:
    op: str | None  # ckplan's op name
    node: str | None  # the autograd node
    peak_bytes: int  # live bytes, the GEMM library's own workspace left out
    blas_workspace_bytes: int = 0  # that workspace, the most alive during this step


@dataclass
class GemmWorkspace:
    """One GEMM call of a backward node: what it allocates and frees inside itself."""

    node: str  # the autograd node
    op: str  # the aten op
    operands: str  # dtype, sizes and strides (the transposition)
    probe_bytes: int  # the call alone (_probe_blas_workspace)
    trace_bytes: int  # the call inside the layer's backward (a differing one, if any)


@dataclass
class PeakMeasurement:
    config: Config
    what: str  # "layer" or "output-megatron" / "output-torch"
    baseline_bytes: int  # x and δ_out, alive before the profile
    forward_peak_bytes: int
    backward_peak_bytes: int
    end_bytes: int
    steps: list[Step]
    timeline_peak_bytes: int  # _coalesce_timeline's, forward and backward (see _timeline_peak)
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    raw_backward_peak_bytes: int = 0  # as the profiler saw it, BLAS workspace included
    gemm_calls: list[GemmWorkspace] = field(default_factory=list)  # one per distinct call


GEMMS = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm"})


def _subtree_allocations(op) -> list:
    found, stack = [], [op]
    while stack:
        for child in stack.pop().children:
            (found if child.typed[0] == _EventType.Allocation else stack).append(child)
    return sorted(found, key=lambda e: e.start_time_ns)


def _transients(op) -> tuple[int, set[int]]:
    """What an op allocates and frees again before it returns: the most of it alive at once,
    and the allocation ids (each pairs an allocation with its free)."""
    events = _subtree_allocations(op)
    allocated = {e.typed[1].allocation_id for e in events if e.typed[1].alloc_size > 0}
    ids = {e.typed[1].allocation_id for e in events if e.typed[1].alloc_size < 0} & allocated
    live = peak = 0
    for e in events:
        if e.typed[1].allocation_id in ids:
            live += e.typed[1].alloc_size
            peak = max(peak, live)
    return peak, ids


def _gemm_call(op) -> tuple:
    """A GEMM call as the library sees it: the aten op; per operand (dtype, sizes, strides) or
    the scalar's value."""
    inputs = tuple(
        (i.dtype, tuple(i.sizes), tuple(i.strides)) if isinstance(i, _TensorMetadata) else i
        for i in op.typed[1].inputs
    )
    return op.name, inputs


def _probe_blas_workspace(call: tuple, device: str) -> int:
    """The workspace the GEMM library allocates and frees for this call alone: the same aten op
    on operands of the same dtype, sizes and strides, under the same memory profiler."""
    name, inputs = call
    schema = getattr(torch.ops.aten, name.removeprefix("aten::")).default._schema
    args, kwargs = [], {}
    for argument, value in zip(schema.arguments, inputs, strict=True):
        if isinstance(value, tuple):
            dtype, sizes, strides = value
            value = torch.empty_strided(sizes, strides, dtype=dtype, device=device).normal_()
        if argument.kwarg_only:
            kwargs[argument.name] = value
        else:
            args.append(value)
    with _profile(device) as prof:
        getattr(torch.ops.aten, name.removeprefix("aten::"))(*args, **kwargs)
    ops = [
        e
        for e in prof._memory_profile()._op_tree.dfs()
        if e.typed[0] == _EventType.TorchOp and e.name == name
    ]
    return _transients(ops[0])[0]


def _operands(call: tuple) -> str:
    tensors = [v for v in call[1] if isinstance(v, tuple)]
    dtypes = sorted({str(t[0]).removeprefix("torch.") for t in tensors})
    return f"{'/'.join(dtypes)} " + " @ ".join(f"{list(t[1])}:{list(t[2])}" for t in tensors)


def _allocations(prof, device: str) -> tuple[list[tuple], list[GemmWorkspace]]:
    """(time ns, bytes (+ alloc / - free), autograd node, its sequence number, whether it is a
    GEMM library's workspace), in time order; and the distinct GEMM calls of backward nodes."""
    blas_ids: set[int] = set()
    calls: dict[tuple, GemmWorkspace] = {}
    for op in prof._memory_profile()._op_tree.dfs():
        if op.typed[0] != _EventType.TorchOp or op.name not in GEMMS:
            continue
        parent = op.parent
        while parent is not None and not parent.name.startswith(EVALUATE):
            if parent.name in GEMMS:  # an inner call: its outermost one counts
                break
            parent = parent.parent
        if parent is None or parent.name in GEMMS:
            continue
        trace_bytes, ids = _transients(op)
        call = _gemm_call(op)
        key = (parent.name, call)
        if key not in calls:
            calls[key] = GemmWorkspace(
                node=parent.name.removeprefix(EVALUATE),
                op=op.name,
                operands=_operands(call),
                probe_bytes=_probe_blas_workspace(call, device),
                trace_bytes=trace_bytes,
            )
        if trace_bytes == calls[key].probe_bytes:
            blas_ids |= ids
        else:  # kept in the live bytes; shown, with a note
            calls[key].trace_bytes = trace_bytes
    events = []
    for event in prof._memory_profile()._op_tree.dfs():
        if event.typed[0] != _EventType.Allocation:
            continue
        alloc = event.typed[1]
        if alloc.device.type != torch.device(device).type:
            continue
        node = sequence = None
        parent = event.parent
        while parent is not None:
            if parent.name.startswith(EVALUATE):
                node, sequence = parent.name.removeprefix(EVALUATE), parent.typed[1].sequence_number
                break
            parent = parent.parent
        blas = alloc.allocation_id in blas_ids
        events.append((event.start_time_ns, alloc.alloc_size, node, sequence, blas))
    events.sort(key=lambda e: e[0])
    return events, list(calls.values())


def _blas_notes(calls: list[GemmWorkspace]) -> list[str]:
    return [
        f"{c.node} {c.op} {c.operands}: {c.trace_bytes} B allocated and freed inside the call, "
        f"{c.probe_bytes} B alone; kept in the live bytes"
        for c in calls
        if c.trace_bytes != c.probe_bytes
    ]


def _timeline_peak(prof, device: str, buffers: int) -> int:
    """The peak of `MemoryProfileTimeline._coalesce_timeline`: every category but PARAMETER,
    less the module buffers it finds (the causal mask, an INPUT to it). It already holds the
    tensors made before the profile (x, δ_out) as INPUT, so it is comparable with the larger of
    the forward and backward peaks, at microsecond resolution."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category, MemoryProfileTimeline

    timeline = MemoryProfileTimeline(prof._memory_profile())
    _, sizes = timeline._coalesce_timeline(device)
    # Column 1 + i is category i of _CATEGORY_TO_INDEX (its last, None, is "unknown").
    parameter = _CATEGORY_TO_INDEX[Category.PARAMETER] + 1
    return max((sum(row) - row[parameter] for row in sizes), default=0) - buffers


def _replay(
    events, baseline: int, tagger: OpTagger | None
) -> tuple[int, int, int, int, list[Step]]:
    """Forward peak, backward peak (BLAS workspace left out), the same with it, end, steps."""
    live, workspace, forward_peak, backward_peak, raw_peak = baseline, 0, baseline, 0, 0
    steps: list[Step] = []
    in_backward = False
    for _, size, node, sequence, blas in events:
        if blas:
            workspace += size
        else:
            live += size
        in_backward = in_backward or node is not None
        if not in_backward:
            forward_peak = max(forward_peak, live + workspace)
            continue
        backward_peak = max(backward_peak, live)
        raw_peak = max(raw_peak, live + workspace)
        op = tagger.name_of(sequence) if tagger and sequence is not None and sequence >= 0 else None
        if steps and (steps[-1].op, steps[-1].node) == (op, node):
            steps[-1].peak_bytes = max(steps[-1].peak_bytes, live)
            steps[-1].blas_workspace_bytes = max(steps[-1].blas_workspace_bytes, workspace)
        else:
            steps.append(Step(op, node, live, workspace))
    return forward_peak, backward_peak, raw_peak, live + workspace, steps


def _profile(device: str):
    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True)


def measure_layer(cfg: Config, seed: int = 0, device: str = "cpu") -> PeakMeasurement:
    """Forward + backward of one layer; the input gradient only (see the module docstring)."""
    torch.manual_seed(seed)
    layer_cls = tsb.GPTLayer if cfg.arch == "gpt" else tsb.LlamaLayer
    layer = layer_cls(cfg).to(device=device, dtype=cfg.torch_dtype).train()
    shape = (cfg.micro_batch, cfg.seq, cfg.hidden)
    x = torch.randn(shape, dtype=cfg.torch_dtype, device=device, requires_grad=True)
    grad_out = torch.randn(shape, dtype=cfg.torch_dtype, device=device)
    baseline = x.untyped_storage().nbytes() + grad_out.untyped_storage().nbytes()
    tagger = OpTagger()
    previous = tsb._FusedRMSNormFunction.weight_grads
    tsb._FusedRMSNormFunction.weight_grads = False  # input gradient only
    try:
        with _profile(device) as prof:
            out = layer(x, tagger)
            out.untyped_storage().resize_(0)
            (grad_in,) = torch.autograd.grad(out, x, grad_out)
    finally:
        tsb._FusedRMSNormFunction.weight_grads = previous
    assert torch.isfinite(grad_in.float()).all()
    events, calls = _allocations(prof, device)
    forward_peak, backward_peak, raw_peak, end, steps = _replay(events, baseline, tagger)
    return PeakMeasurement(
        config=cfg,
        what="layer",
        baseline_bytes=baseline,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        end_bytes=end,
        steps=steps,
        timeline_peak_bytes=_timeline_peak(prof, str(x.device), _used_buffer_bytes(layer, cfg)),
        device=device,
        notes=_blas_notes(calls),
        raw_backward_peak_bytes=raw_peak,
        gemm_calls=calls,
    )


def _used_buffer_bytes(layer: nn.Module, cfg: Config) -> int:
    """The module buffers the forward reads: the additive causal mask of standard attention."""
    if cfg.attention == "standard" and cfg.mask == "additive":
        return layer.mask.untyped_storage().nbytes()
    if cfg.mask == "masked_fill":
        return layer.tril.untyped_storage().nbytes()
    return 0


def measure_output(
    cfg: Config, loss: str = "megatron", vocab: int = 1024, seed: int = 0, device: str = "cpu"
) -> PeakMeasurement:
    """Forward + backward of the output stage from its input x; the loss is a scalar, so the
    baseline is x alone."""
    torch.manual_seed(seed)
    stage = OutputStage(cfg, vocab, loss).to(device=device, dtype=cfg.torch_dtype).train()
    shape = (cfg.micro_batch, cfg.seq, cfg.hidden)
    x = torch.randn(shape, dtype=cfg.torch_dtype, device=device, requires_grad=True)
    target = torch.randint(0, vocab, shape[:2], device=device)
    baseline = x.untyped_storage().nbytes() + target.untyped_storage().nbytes()
    previous = tsb._FusedRMSNormFunction.weight_grads
    tsb._FusedRMSNormFunction.weight_grads = False
    try:
        with _profile(device) as prof:
            out = stage(x, target)
            (grad_in,) = torch.autograd.grad(out, x)
    finally:
        tsb._FusedRMSNormFunction.weight_grads = previous
    assert torch.isfinite(grad_in.float()).all()
    events, calls = _allocations(prof, device)
    forward_peak, backward_peak, raw_peak, end, steps = _replay(events, baseline, None)
    return PeakMeasurement(
        config=cfg,
        what=f"output-{loss}",
        baseline_bytes=baseline,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        end_bytes=end,
        steps=steps,
        timeline_peak_bytes=_timeline_peak(prof, str(x.device), 0),
        device=device,
        notes=[f"vocab {vocab}; baseline = x and the int64 targets", *_blas_notes(calls)],
        raw_backward_peak_bytes=raw_peak,
        gemm_calls=calls,
    )


# --------------------------------------------------------------------------------------------
# ckplan's prediction
# --------------------------------------------------------------------------------------------


def _spec(cfg: Config, vocab: int = 1024):
    tsb._import_ckplan()
    from ckplan.inputs.presets import spec_from_values

    mapping = tsb.ckplan_mapping_for(cfg)
    mapping["vocab"] = vocab
    return spec_from_values(mapping, origin=cfg.name)


def predict_layer(cfg: Config) -> dict:
    """ckplan's walk and peaks for the same layer: the walk per op, its maximum, the chain's
    previous model (tape + δ_out + δ_in) and `simulate` on a one-stage chain with the workspace."""
    tsb._import_ckplan()
    from ckplan.model import memory
    from ckplan.schedules import Chain, simulate, store_all_schedule

    spec = _spec(cfg)
    tape = memory.activation_bytes_per_layer(spec)
    stream = memory.layer_input_bytes(spec)
    workspace = memory.layer_backward_workspace_bytes(spec)
    chain = Chain(
        forward_flops=(1,),
        backward_flops=(2,),
        input_bytes=(stream, stream),
        tape_bytes=(tape,),
        backward_workspace_bytes=(workspace,),
    )
    return {
        "walk": [
            {
                "op": p.op,
                "live_bytes": p.live_bytes,
                "saved_bytes": p.saved_bytes,
                "grad_bytes": p.grad_bytes,
                "workspace_bytes": p.workspace_bytes,
            }
            for p in memory.layer_backward_walk(spec)
        ],
        "peak_bytes": memory.layer_backward_peak_bytes(spec),
        "tape_bytes": tape,
        "stream_bytes": stream,
        "previous_model_bytes": tape + 2 * stream,
        "workspace_bytes": workspace,
        "chain_peak_bytes": simulate(chain, store_all_schedule(chain)).peak_bytes,
    }


def predict_output(cfg: Config, vocab: int = 1024) -> dict:
    tsb._import_ckplan()
    from ckplan.model import loss, memory

    spec = _spec(cfg, vocab)
    tape = loss.output_saved_bytes(spec)
    stream = memory.layer_input_bytes(spec)
    return {
        "peak_bytes": loss.output_backward_peak_bytes(spec),
        "tape_bytes": tape,
        "stream_bytes": stream,
        "previous_model_bytes": tape + stream,
        "workspace_bytes": loss.output_backward_workspace_bytes(spec),
    }


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _x(n: int, stream: int) -> str:
    """n in units of X, one (s, b, h) tensor."""
    return f"{n / stream:8.3f}X"


def _bytes_and_x(n: int, stream: int) -> str:
    return f"{n} ({_x(n, stream).strip()})"


def print_layer(m: PeakMeasurement, pred: dict | None) -> None:
    cfg = m.config
    print(tsb._header(cfg))
    stream = cfg.seq * cfg.micro_batch * cfg.hidden * cfg.dtype_bytes
    print(f"   X = {stream} B (one (s, b, h) tensor); baseline x + δ_out = {m.baseline_bytes}")
    print(f"   forward peak {m.forward_peak_bytes} ({_x(m.forward_peak_bytes, stream).strip()})")
    if pred is None:
        print(f"   {'op':<15}{'autograd node':<48}{'bytes':>12}{'':>10}{'BLAS ws':>10}")
        for s in m.steps:
            where = f"{s.op or '-':<15}{s.node or '-':<48}"
            blas = s.blas_workspace_bytes
            print(f"   {where}{s.peak_bytes:>12}{_x(s.peak_bytes, stream)}{blas:>10}")
    else:
        walk = {p["op"]: p["live_bytes"] for p in pred["walk"]}
        measured: dict[str, tuple[int, str, int]] = {}
        for s in m.steps:
            key = s.op or "-"
            if key not in measured or s.peak_bytes > measured[key][0]:
                measured[key] = (s.peak_bytes, s.node or "-", s.blas_workspace_bytes)
        print(
            f"   {'op':<15}{'predicted':>12}{'measured':>12}{'diff':>11}{'':>10}{'BLAS ws':>10}"
            "  max at node"
        )
        for op in [p["op"] for p in pred["walk"]] + [k for k in measured if k not in walk]:
            p, (q, node, blas) = walk.get(op, 0), measured.get(op, (0, "-", 0))
            print(f"   {op:<15}{p:>12}{q:>12}{q - p:>+11}{_x(q - p, stream)}{blas:>10}  {node}")
    print(
        f"   backward peak: measured {_bytes_and_x(m.backward_peak_bytes, stream)}, BLAS workspace "
        f"left out ({m.raw_backward_peak_bytes} with it); MemoryProfileTimeline peak (forward and "
        f"backward, BLAS workspace in) {m.timeline_peak_bytes}"
    )
    _print_gemm_calls(m)
    if pred is not None:
        p = pred["peak_bytes"]
        print(
            f"   predicted {_bytes_and_x(p, stream)} = tape {pred['tape_bytes']} + 2X + "
            f"workspace {pred['workspace_bytes']}; previous model tape + 2X = "
            f"{pred['previous_model_bytes']}; simulate, 1-stage chain: {pred['chain_peak_bytes']}"
        )
        d = m.backward_peak_bytes - p
        print(f"   measured - predicted = {d:+d} ({d / p:+.2%})")
    print()


def _print_gemm_calls(m: PeakMeasurement) -> None:
    """The BLAS workspace column's source: each backward GEMM call, probed alone."""
    if not any(c.probe_bytes or c.trace_bytes for c in m.gemm_calls):
        print(f"   BLAS workspace: none ({len(m.gemm_calls)} backward GEMM calls probed)")
        return
    print("   BLAS workspace, each backward GEMM call (dtype [sizes]:[strides]): alone / in trace")
    node, operands = (max(len(getattr(c, k)) for c in m.gemm_calls) for k in ("node", "operands"))
    for c in m.gemm_calls:
        where = f"{c.node:<{node + 2}}{c.op:<11}{c.operands:<{operands}}"
        print(f"     {where}{c.probe_bytes:>9} /{c.trace_bytes:>8}")
    for note in m.notes if m.what == "layer" else []:
        print(f"   note: {note}")


def print_output(m: PeakMeasurement, pred: dict | None) -> None:
    cfg = m.config
    stream = cfg.seq * cfg.micro_batch * cfg.hidden * cfg.dtype_bytes
    print(
        f"== {cfg.name} output stage, loss {m.what.removeprefix('output-')}: {'; '.join(m.notes)}"
    )
    print(
        f"   forward peak {m.forward_peak_bytes}, backward peak {m.backward_peak_bytes} "
        f"({m.raw_backward_peak_bytes} with the BLAS workspace); MemoryProfileTimeline peak "
        f"(forward and backward) {m.timeline_peak_bytes}"
    )
    for s in m.steps:
        blas = s.blas_workspace_bytes
        print(f"   {s.node or '-':<48}{s.peak_bytes:>12}{_x(s.peak_bytes, stream)}{blas:>10}")
    _print_gemm_calls(m)
    if pred is not None:
        p = pred["peak_bytes"]
        d = m.backward_peak_bytes - m.baseline_bytes + stream - p  # the ids are not ckplan's
        print(
            f"   predicted {p} = tape {pred['tape_bytes']} + logits gradient; previous model "
            f"tape + δ_in = {pred['previous_model_bytes']}; measured - predicted (x counted as "
            f"ckplan does, targets left out) = {d:+d}"
        )
    print()


def _cpu() -> str:
    """The CPU's model name and the kernels torch picked for it."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return f"{model or platform.processor()} ({torch.backends.cpu.get_cpu_capability()})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", help="config name (repeatable); default: all")
    ap.add_argument("--list", action="store_true", help="list the configs and exit")
    ap.add_argument("--seq", type=int, help="override s")
    ap.add_argument("--batch", type=int, help="override b")
    ap.add_argument("--compare", action="store_true", help="compare with ckplan's prediction")
    ap.add_argument("--output", action="store_true", help="also measure the output stage")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    configs = default_configs()
    if args.list:
        for c in configs:
            print(f"{c.name:<32}{c.description}")
        return 0
    if args.config:
        known = {c.name: c for c in configs + tsb.default_configs()}
        missing = [n for n in args.config if n not in known]
        if missing:
            print(f"unknown config(s): {', '.join(missing)}; see --list", file=sys.stderr)
            return 2
        configs = [dataclasses.replace(known[n]) for n in args.config]
    for c in configs:
        c.seq = args.seq or c.seq
        c.micro_batch = args.batch or c.micro_batch

    runs = []
    for c in configs:
        m = measure_layer(c, device=args.device)
        runs.append((m, predict_layer(c) if args.compare else None))
    outputs = []
    if args.output:
        for c in configs:
            if c.name not in ("gpt-bf16-dropout-native", "llama-bf16-fused"):
                continue
            for loss in ("megatron", "torch"):
                m = measure_output(c, loss, device=args.device)
                outputs.append((m, predict_output(c) if args.compare else None))

    if args.json:

        def record(m: PeakMeasurement, pred: dict | None) -> dict:
            out = dataclasses.asdict(m)
            out["config"] = dataclasses.asdict(m.config)
            out["predicted"] = pred
            return out

        print(json.dumps({
            "torch_version": torch.__version__,
            "device": args.device,
            "cpu": _cpu(),  # the BLAS workspace is this CPU's and these threads'
            "threads": torch.get_num_threads(),
            "layers": [record(m, p) for m, p in runs],
            "output_stages": [record(m, p) for m, p in outputs],
        }, indent=2))  # fmt: skip
        return 0
    print(
        f"torch {torch.__version__} on {args.device}; live bytes of one layer's forward + backward "
        "(activations, their gradients, temporaries; parameters and their gradients excluded)\n"
    )
    for m, pred in runs:
        print_layer(m, pred)
    for m, pred in outputs:
        print_output(m, pred)
    return 0


if __name__ == "__main__":
    sys.exit(main())
