#!/usr/bin/env python3
"""The reserved peak of Liger-Kernel's end-to-end benchmark step (Llama 3 8B, Hugging Face
Trainer, FSDP1 FULL_SHARD over 8 GPUs, bf16 mixed precision, reentrant gradient checkpointing,
AdamW), two steps replayed through the default caching allocator's rules with FSDP1's streams
(validation/caching_allocator.py).

What is recorded, on the meta device (no memory is used; a TorchDispatchMode sees every storage
an op returns and a finalizer each storage's free, as validation/loss_allocator_replay.py):

- the model's ops: a transformers LlamaForCausalLM at Llama 3 8B's shapes (32 layers), its
  parameters bf16 (the unsharded copies FSDP1 computes with), `gradient_checkpointing_enable
  (use_reentrant=True)` (transformers v4.43.0's default); attention as the flash kernel
  allocates (`FlashAttention`: the output and fp32 log-sum-exp saved, in the backward dq, dk, dv
  and the fp32 dq accumulator), after transformers v4.43.0's `repeat_kv` (LlamaSdpaAttention
  repeats the KV heads before SDPA);
- the loss: transformers v4.44.0's (`logits.float()`, the shifted `.contiguous()` copy,
  CrossEntropyLoss: validation/loss_allocator_replay.py `_loss`), or Liger-Kernel's
  `lce_forward` at e85611c (the shifted hidden states' copy, then
  LigerFusedLinearCrossEntropyFunction's allocations in plain torch: `grad_linear` and
  `grad_input` zeros, fp32 `loss_1d`, per 256-token chunk the bf16 logits, their fp32 copy, the
  in-place cross-entropy kernel (no allocation), the bf16 downcast, the scaled gradient and the
  `grad_logits_chunk @ linear` product copied into `grad_input`; `addmm(out=grad_linear)`);
- FSDP1's buffers, as events at the points its hooks run (torch/distributed/fsdp/
  _runtime_utils.py, PyTorch v2.13.0; the Trainer's settings, ckplan.model.frameworks
  `fsdp1_*`): the root unit's bf16 copy from its pre-forward to its post-backward, each layer's
  bf16 copy from its pre-forward to its post-forward and again from its pre-backward (a hook on
  the recomputed output) to its post-backward, all on the unshard stream; the bf16 low-precision
  shard cast before each all-gather on the pre-unshard stream; a unit's gradients, once all its
  parameters' have arrived, concatenated into its flat gradient on the default stream (the
  views' split backward), the pieces then freed, and at the post-backward the reduce-scatter
  output (bf16) and its fp32 cast on the post-backward stream (`_reduce_grad`,
  `_cast_grad_to_param_dtype`), the flat gradient then freed;
- with `--liger`, Liger-Kernel's RMSNorm, SwiGLU and RoPE kernels at e85611c
  (`use_liger_kernels`) in place of the eager modules;
- the optimizer: torch.optim.AdamW with foreach (the CUDA default), its two fp32 states per
  parameter made at the first step (`_init_group`), `_foreach_sqrt` of the second moments alive
  through the update; the states are per original parameter's slice of rank 0's shard
  (use_orig_params); zero_grad frees the fp32 gradient shards.

The parameters' fp32 shards and the inputs are one block made first. Step 2 is replayed after
step 1, its peaks reset at its start (what step 1 reserved stays reserved, as
`torch.cuda.reset_peak_memory_stats` leaves `reserved_bytes.current`).

Left out: the CUDA events that delay the reuse of a block freed with record_stream (a freed
block is free at once here), NCCL's buffers, the cuBLAS workspaces.

With `--frozen` the base model is frozen as under LoRA (Answer.AI's fsdp_qlora train.py at
4cd6923, validation/runs/memory-answerai-fsdp-qlora.yaml): no gradient, no optimizer step, the
parameters' shards bf16, no low-precision shard cast (no MixedPrecision), and each layer's copy
resharded once its input's gradient is computed (FSDP1's `_register_post_backward_reshard_only_hook`
for a FlatParameter that does not require a gradient); the LoRA adapters (under 1 % of the
bytes) and their dropout are left out. `--prefetch` adds BACKWARD_PRE: a layer's pre-backward
gathers the layer before it too (`_prefetch_handle`). `--world` sets the ranks, `--shape` the
model's shapes.

Usage: python validation/fsdp1_step_allocator_replay.py [--seq 1024] [--batch 8] [--liger]
       [--layers 32] [--expandable] [--frozen] [--prefetch] [--world 8]
       [--shape llama3-8b|llama2-7b] | --write
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import types
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from caching_allocator import CachingAllocator, StreamsExpandableAllocator

WORLD = 8  # the Liger benchmark's ranks; `--world` changes it
GiB = 2**30
# FSDP1's streams (torch/distributed/fsdp/_runtime_utils.py `_init_streams`), 0 the default
UNSHARD, PRE_UNSHARD, POST_BACKWARD = 1, 2, 3
LLAMA3_8B = {"hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256}
LLAMA2_7B = {"hidden": 4096, "ffn": 11008, "heads": 32, "kv_heads": 32, "vocab": 32000}
SHAPES = {"llama3-8b": LLAMA3_8B, "llama2-7b": LLAMA2_7B}


class StepTrace(TorchDispatchMode):
    """("alloc", key, bytes, stream) for each storage an op returns, ("free", key, 0, 0) when
    it dies; `add` and `drop` record FSDP1's buffers by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, object, int, int]] = []
        self.keys = itertools.count()

    def _freed(self, key: int) -> None:
        self.events.append(("free", key, 0, 0))

    def add(self, size: int, stream: int) -> int:
        key = next(self.keys)
        self.events.append(("alloc", key, size, stream))
        return key

    def drop(self, key: int) -> None:
        self.events.append(("free", key, 0, 0))

    def mark(self, name: str) -> None:
        self.events.append(("mark", name, 0, 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() and not hasattr(storage, "_trace_key"):
                key = next(self.keys)
                storage._trace_key = key
                self.events.append(("alloc", key, storage.nbytes(), 0))
                weakref.finalize(storage, self._freed, key)
        return out


class FlashAttention(torch.autograd.Function):
    """What PyTorch's flash SDPA allocates (aten `_scaled_dot_product_flash_attention` and its
    backward): the output and the fp32 log-sum-exp, saved with q, k, v; in the backward dq, dk,
    dv and the fp32 dq accumulator."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, heads, s = q.shape[:3]
        out = torch.empty_like(q)
        lse = q.new_empty((b, heads, s), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        accumulator = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del accumulator
        return dq, dk, dv


def flash_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface with v4.43.0's LlamaSdpaAttention order: repeat_kv,
    then the kernel; returns (b, s, heads, d) as the interface does."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    out = FlashAttention.apply(query, key, value)
    return out.transpose(1, 2).contiguous(), None


class LigerFusedLinearCrossEntropy(torch.autograd.Function):
    """LigerFusedLinearCrossEntropyFunction at e85611c (src/liger_kernel/ops/
    fused_linear_cross_entropy.py), its allocations in plain torch; the Triton cross-entropy
    kernel writes the chunk's gradient into the fp32 logits in place (no allocation)."""

    @staticmethod
    def forward(ctx, states, weight, target):
        tokens, hidden = states.shape
        vocab = weight.shape[0]
        inc_factor = -(-vocab // hidden)
        chunk = 1 << (-(-tokens // inc_factor) - 1).bit_length()
        grad_linear = torch.zeros_like(weight)
        grad_input = torch.zeros_like(states)
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=states.device)
        for start in range(0, tokens, chunk):
            piece = states[start : start + chunk]
            logits = piece @ weight.t()
            logits = logits.float()
            logits = logits.to(states.dtype)
            grad_logits = logits * 0.5
            grad_input[start : start + chunk] = grad_logits @ weight
            torch.addmm(grad_linear, logits.t(), piece, out=grad_linear)
            del logits, grad_logits
        loss = torch.sum(loss_1d) / tokens
        ctx.save_for_backward(grad_input, grad_linear)
        return loss

    @staticmethod
    def backward(ctx, grad):
        grad_input, grad_linear = ctx.saved_tensors
        return grad_input, grad_linear, None


class LigerRMSNorm(torch.autograd.Function):
    """LigerRMSNormFunction at e85611c (src/liger_kernel/ops/rms_norm.py): the output and the
    inverse RMS (in the input's dtype) made, X, W and the inverse RMS saved; the backward writes
    dX into dY in place and sums a `zeros_like(X)` per-row weight gradient."""

    @staticmethod
    def forward(ctx, X, W):
        Y = torch.empty_like(X)
        r = X.new_empty(X.shape[:-1])
        ctx.save_for_backward(X, W, r)
        return Y

    @staticmethod
    def backward(ctx, dY):
        X = ctx.saved_tensors[0]
        dW = torch.zeros_like(X)
        return dY, torch.sum(dW.view(-1, X.shape[-1]), dim=0)


class LigerSiLUMul(torch.autograd.Function):
    """LigerSiLUMulFunction at e85611c (src/liger_kernel/ops/swiglu.py): `c = zeros_like(a)`,
    a and b saved; the backward writes da and db into a and b in place."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.zeros_like(a)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        return a, b


def liger_rotary(q, k, cos, sin, *args, **kwargs):
    """LigerRopeFunction at e85611c (src/liger_kernel/ops/rope.py): rotates q and k in place
    (the projections' outputs are contiguous after the transpose back) and its backward rotates
    dq and dk in place: no allocation either way."""
    return q, k


def use_liger_kernels(model):
    """apply_liger_kernel_to_llama's defaults at e85611c (rope, rms_norm, swiglu); returns
    transformers' rotary function, which the caller puts back."""
    from transformers.models.llama import modeling_llama

    def norm_forward(self, hidden_states):
        return LigerRMSNorm.apply(hidden_states, self.weight)

    def mlp_forward(self, x):
        return self.down_proj(LigerSiLUMul.apply(self.gate_proj(x), self.up_proj(x)))

    for module in model.modules():
        if isinstance(module, modeling_llama.LlamaRMSNorm):
            module.forward = types.MethodType(norm_forward, module)
        if isinstance(module, modeling_llama.LlamaMLP):
            module.forward = types.MethodType(mlp_forward, module)
    eager_rotary = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = liger_rotary
    return eager_rotary


def hf_loss(hidden_states, weight, labels, vocab):
    """transformers v4.44.0 LlamaForCausalLM.forward's loss."""
    logits = F.linear(hidden_states, weight)
    logits = logits.float()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    return torch.nn.CrossEntropyLoss()(shift_logits.view(-1, vocab), shift_labels.view(-1))


def liger_loss(hidden_states, weight, labels, vocab):
    """Liger-Kernel's lce_forward at e85611c (src/liger_kernel/transformers/model/llama.py)."""
    shift_hidden_states = hidden_states[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    shift_hidden_states = shift_hidden_states.view(-1, hidden_states.shape[-1])
    return LigerFusedLinearCrossEntropy.apply(shift_hidden_states, weight, shift_labels.view(-1))


def shard_numel(numel: int) -> int:
    """A flat parameter's shard on each rank (FSDP1 pads the flat parameter to a multiple of
    the world size)."""
    return -(-numel // WORLD)


def rank0_slices(numels: list[int]) -> list[int]:
    """The numels of the original parameters' pieces in rank 0's shard of a flat parameter
    (use_orig_params: the optimizer sees these views)."""
    end = shard_numel(sum(numels))
    pieces, start = [], 0
    for numel in numels:
        if start >= end:
            break
        pieces.append(min(numel, end - start))
        start += numel
    return pieces


class FSDP1Buffers:
    """FSDP1's buffers as trace events at the points its hooks run (module docstring)."""

    def __init__(self, trace: StepTrace, model, frozen: bool = False, prefetch: bool = False):
        self.trace, self.model = trace, model
        self.frozen, self.prefetch = frozen, prefetch
        layers = list(model.model.layers)
        root = [model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight]
        self.units = [root] + [list(layer.parameters()) for layer in layers]
        self.unit_of = {id(p): i for i, unit in enumerate(self.units) for p in unit}
        self.numel = [sum(p.numel() for p in unit) for unit in self.units]
        self.copies: dict[int, int] = {}
        self.arrived: dict[int, list] = {}
        self.shards: list[int] = []
        for index, layer in enumerate(layers, start=1):
            layer.register_forward_pre_hook(self._pre_forward(index))
            layer.register_forward_hook(self._post_forward(index))
        for unit in self.units:
            for param in unit:
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._accumulated)

    def unshard(self, unit: int) -> None:
        if unit in self.copies:  # gathered already (prefetched)
            return
        shard = shard_numel(self.numel[unit])
        low = None if self.frozen else self.trace.add(2 * shard, PRE_UNSHARD)
        self.copies[unit] = self.trace.add(2 * WORLD * shard, UNSHARD)
        if low is not None:
            self.trace.drop(low)

    def reshard(self, unit: int) -> None:
        if unit in self.copies:
            self.trace.drop(self.copies.pop(unit))

    def _pre_forward(self, unit: int):
        def hook(module, args):
            self.unshard(unit)
            hidden = args[0] if args else None
            if self.frozen and torch.is_grad_enabled() and getattr(hidden, "requires_grad", False):
                # the reshard-only hook: on the unit's inputs' gradients (the recomputation)
                hidden.register_hook(lambda grad: self.reshard(unit))

        return hook

    def _pre_backward(self, unit: int):
        def hook(grad):
            self.unshard(unit)
            if self.prefetch and unit > 1:
                self.unshard(unit - 1)  # BACKWARD_PRE: the next unit in backward order

        return hook

    def _post_forward(self, unit: int):
        def hook(module, args, output):
            self.reshard(unit)
            hidden = output[0] if isinstance(output, tuple) else output
            if torch.is_grad_enabled() and hidden.requires_grad:  # the recomputation
                hidden.register_hook(self._pre_backward(unit))

        return hook

    def _accumulated(self, param) -> None:
        unit = self.unit_of[id(param)]
        arrived = self.arrived.setdefault(unit, [])
        arrived.append(param)
        if len(arrived) < len(self.units[unit]):
            return
        flat = self.trace.add(2 * self.numel[unit], 0)  # the views' split backward: one cat
        for piece in arrived:
            piece.grad = None
        del self.arrived[unit]
        self.reshard(unit)  # `_post_backward_hook`: `_post_backward_reshard` first
        low = self.trace.add(2 * shard_numel(self.numel[unit]), POST_BACKWARD)
        self.shards.append(self.trace.add(4 * shard_numel(self.numel[unit]), POST_BACKWARD))
        self.trace.drop(low)
        self.trace.drop(flat)

    def optimizer_step(self, states: list[int]) -> None:
        """foreach AdamW: the fp32 states made at the first step, `_foreach_sqrt` of the
        second moments through the update."""
        pieces = [n for unit in self.units for n in rank0_slices([p.numel() for p in unit])]
        if not states:
            for numel in pieces:
                states.append(self.trace.add(4 * numel, 0))
            for numel in pieces:
                states.append(self.trace.add(4 * numel, 0))
        sqrt = [self.trace.add(4 * numel, 0) for numel in pieces]
        for key in sqrt:
            self.trace.drop(key)

    def zero_grad(self) -> None:
        for key in self.shards:
            self.trace.drop(key)
        self.shards = []


def build(layers: int, shape=LLAMA3_8B):
    """transformers' LlamaForCausalLM on the meta device in bf16, reentrant checkpointing."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    AttentionInterface.register("traced_sdpa", flash_sdpa)
    modeling_llama.create_causal_mask = lambda *args, **kwargs: None  # the kernel is causal
    config = LlamaConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        num_hidden_layers=layers, vocab_size=shape["vocab"], max_position_embeddings=131072,
        tie_word_embeddings=False, use_cache=False, rope_theta=500000.0,
        attn_implementation="traced_sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    return model


def trace_steps(
    batch: int,
    seq: int,
    liger: bool,
    layers: int = 32,
    steps: int = 2,
    shape=LLAMA3_8B,
    frozen: bool = False,
    prefetch: bool = False,
):
    """The recorded events of `steps` steps and the bytes alive before them (the parameters'
    fp32 shards; bf16 ones with `frozen`)."""
    from transformers.models.llama import modeling_llama

    model = build(layers, shape)
    eager_rotary = use_liger_kernels(model) if liger else modeling_llama.apply_rotary_pos_emb
    try:
        return _trace(model, batch, seq, liger, steps, frozen, prefetch)
    finally:
        modeling_llama.apply_rotary_pos_emb = eager_rotary


def _trace(model, batch: int, seq: int, liger: bool, steps: int, frozen=False, prefetch=False):
    vocab = model.config.vocab_size
    loss_fn = liger_loss if liger else hf_loss
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    for tensor in [ids, *model.parameters(), *model.buffers()]:
        tensor.untyped_storage()._trace_key = None  # made before the trace: not recorded
    trace = StepTrace()
    if frozen:  # transformers' enable_input_require_grads, as for reentrant checkpointing
        model.requires_grad_(False)
        model.model.embed_tokens.register_forward_hook(lambda m, a, out: out.requires_grad_())
    fsdp = FSDP1Buffers(trace, model, frozen, prefetch)
    states: list[int] = []
    with trace:
        for step in range(steps):
            trace.mark(f"step{step + 1}")
            fsdp.unshard(0)  # the root's pre-forward
            hidden = model.model(input_ids=ids).last_hidden_state
            loss = loss_fn(hidden, model.lm_head.weight, ids, vocab)
            del hidden
            trace.mark(f"backward{step + 1}")
            loss.backward()
            del loss
            if frozen:
                fsdp.reshard(0)  # the root's reshard-only hook, on the embedding's output
            trace.mark(f"optimizer{step + 1}")
            if not frozen:
                fsdp.optimizer_step(states)
                fsdp.zero_grad()
    master = sum((2 if frozen else 4) * shard_numel(n) for n in fsdp.numel)
    return trace.events, master


def replay(events, before: int, expandable_segments: bool = False) -> dict:
    """Replay with a pool per stream (with `expandable_segments`, an expandable segment per
    stream); the peaks per phase, each phase's peaks reset at its start."""
    allocator = StreamsExpandableAllocator() if expandable_segments else CachingAllocator()
    allocator.malloc(before)
    live, phases, current = {}, {}, None
    for kind, key, size, stream in events:
        if kind == "alloc":
            live[key] = allocator.malloc(size, stream)
        elif kind == "free":
            if key in live:
                allocator.free(live.pop(key))
        else:
            if current is not None:
                phases[current] = (allocator.peak_allocated, allocator.peak_reserved)
            current = key
            allocator.reset_peaks()
    phases[current] = (allocator.peak_allocated, allocator.peak_reserved)
    return {
        "phases": {name: [a / GiB, r / GiB] for name, (a, r) in phases.items()},
        "reserved_by_stream": {s: r / GiB for s, r in allocator.reserved_by_stream.items()},
    }


# The benchmark's bars (validation/runs/memory-liger-kernel-e2e-llama3-8b-fsdp.yaml)
RUNS = {
    "liger-e2e-llama3-8b-hf-seq1024": (1024, False),
    "liger-e2e-llama3-8b-hf-seq2048": (2048, False),
    "liger-e2e-llama3-8b-liger-seq1024": (1024, True),
    "liger-e2e-llama3-8b-liger-seq2048": (2048, True),
    "liger-e2e-llama3-8b-liger-seq4096": (4096, True),
    "liger-e2e-llama3-8b-liger-seq8192": (8192, True),
    "liger-e2e-llama3-8b-liger-seq16384": (16384, True),
}
RESULTS = "validation/results-fsdp1-step-allocator-replay-torch-2.13.0.json"
# Answer.AI's Llama-2 7B LoRA rows without CPU offload (validation/runs/
# memory-answerai-fsdp-qlora.yaml): two ranks, the base frozen, BACKWARD_PRE
LORA_RUNS = {
    "aai-fsdp-qlora-llama2-7b-lora-b1-s512-2x3090": (1, 512),
    "aai-fsdp-qlora-llama2-7b-lora-b1-s2048-2x3090": (1, 2048),
    "aai-fsdp-qlora-llama2-7b-lora-b4-s2048-2x3090": (4, 2048),
    "aai-fsdp-qlora-llama2-7b-lora-b6-s2048-2x3090": (6, 2048),
}
LORA_RESULTS = "validation/results-fsdp1-lora-step-allocator-replay-torch-2.13.0.json"


def peaks(replayed: dict) -> tuple[float, float]:
    """The steps' allocated and reserved peaks (GiB)."""
    values = replayed["phases"].values()
    return max(a for a, _ in values), max(r for _, r in values)


def measure_runs() -> dict:
    """Each bar replayed with both allocator modes, beside ckplan's allocated and reserved peaks
    and the published one (GiB)."""
    from ckplan.published.predict import predict
    from ckplan.published.suite import suite_runs

    runs = {run.name: run for run in suite_runs()}
    rows = {}
    for name, (seq, liger) in RUNS.items():
        events, master = trace_steps(8, seq, liger)
        prediction = predict(runs[name])
        row = {
            "published_reserved": runs[name].published.value / GiB,
            "ckplan_allocated": prediction.memory_bytes / GiB,
            "ckplan_reserved": prediction.predicted / GiB,
        }
        for mode, expandable in (("default", False), ("expandable_segments", True)):
            replayed = replay(events, master, expandable)
            allocated, reserved = peaks(replayed)
            row[mode] = {"allocated": allocated, "reserved": reserved, **replayed}
        rows[name] = row
    return {"torch": torch.__version__, "runs": rows}


def measure_lora_runs() -> dict:
    """Answer.AI's LoRA rows replayed with the default allocator, beside ckplan's allocated and
    reserved peaks and the published reserved one (GiB)."""
    global WORLD
    from ckplan.published.predict import predict
    from ckplan.published.suite import suite_runs

    runs = {run.name: run for run in suite_runs()}
    rows, world = {}, WORLD
    WORLD = 2
    try:
        for name, (batch, seq) in LORA_RUNS.items():
            events, before = trace_steps(
                batch, seq, False, shape=LLAMA2_7B, frozen=True, prefetch=True
            )
            replayed = replay(events, before)
            allocated, reserved = peaks(replayed)
            prediction = predict(runs[name])
            rows[name] = {
                "published_reserved": runs[name].published.value / GiB,
                "ckplan_allocated": prediction.memory_bytes / GiB,
                "ckplan_reserved": prediction.predicted / GiB,
                "default": {"allocated": allocated, "reserved": reserved, **replayed},
            }
    finally:
        WORLD = world
    return {"torch": torch.__version__, "runs": rows}


def main(argv=None) -> int:
    global WORLD
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--liger", action="store_true")
    parser.add_argument("--expandable", action="store_true", help="with expandable segments")
    parser.add_argument("--frozen", action="store_true", help="the base model frozen (LoRA)")
    parser.add_argument("--prefetch", action="store_true", help="BACKWARD_PRE")
    parser.add_argument("--world", type=int, default=WORLD, help="ranks")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--write", action="store_true", help=f"every bar, written to {RESULTS}")
    parser.add_argument(
        "--write-lora", action="store_true", help=f"the LoRA rows, written to {LORA_RESULTS}"
    )
    args = parser.parse_args(argv)
    if args.write_lora or args.write:
        result = measure_lora_runs() if args.write_lora else measure_runs()
        written = LORA_RESULTS if args.write_lora else RESULTS
        Path(written).write_text(json.dumps(result, indent=1) + "\n")
        for name, row in result["runs"].items():
            expandable = row.get("expandable_segments")
            print(
                f"{name:48s} published {row['published_reserved']:6.2f}  ckplan allocated "
                f"{row['ckplan_allocated']:6.2f} reserved {row['ckplan_reserved']:6.2f}  replay "
                f"allocated {row['default']['allocated']:6.2f} reserved "
                f"{row['default']['reserved']:6.2f}"
                + (f" (expandable {expandable['reserved']:6.2f})" if expandable else "")
                + " GiB"
            )
        return 0
    WORLD = args.world
    events, master = trace_steps(
        args.batch,
        args.seq,
        args.liger,
        args.layers,
        shape=SHAPES[args.shape],
        frozen=args.frozen,
        prefetch=args.prefetch,
    )
    result = replay(events, master, args.expandable)
    result.update(
        seq=args.seq, batch=args.batch, liger=args.liger, layers=args.layers, world=args.world,
        shape=args.shape, frozen=args.frozen, prefetch=args.prefetch,
    )  # fmt: skip
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
