"""The output stage: final norm, output layer and the loss, as each implementation holds it.

Notation: T = s·b/cp tokens on this rank, L = T·V/t logits on this rank (the vocabulary split
over t, Megatron's vocab-parallel output layer; torchtitan's loss parallel), X = the residual
stream's bytes (`memory.layer_input_bytes`), B the activation dtype's bytes. The stage's input is
the last layer's output (X); its tape keeps that (the final norm's input) and the output layer's
input (X) and what the loss saves.

- `fused` — Megatron-LM's vocab-parallel cross-entropy (megatron/core/tensor_parallel/
  cross_entropy.py): `.float()` copies the B-byte logits to fp32, turns the copy into the
  softmax in place and saves it (4L, Korthikanti §4.3's fp32 logits); the backward writes the
  gradient into that buffer in place and autograd casts it to B bytes. Forward transient: the
  B-byte logits beside the fp32 copy; backward: + B·L.
- `eager` — PyTorch's cross-entropy on upcast logits, as Hugging Face transformers
  (loss/loss_utils.py ForCausalLMLoss: `logits = logits.float()` then
  `nn.functional.cross_entropy`) and torchtitan (`cross_entropy(pred.flatten(0, 1).float(), ...)`)
  run it: the fp32 copy feeds log_softmax, which saves its fp32 output (4L); nll_loss saves only
  the targets. Forward transient: the B-byte logits, the fp32 copy and the log-probabilities
  together (B + 8)L; backward: the log-probabilities' gradient and the logits' (8L) beside the
  saved 4L. torchtitan over vocabulary-split logits (t > 1) runs its loss parallel, the
  DTensor handlers of torch/distributed/tensor/parallel/loss.py (PyTorch 2.13), whose
  `_nll_loss_backward` folds log_softmax's backward in as `(grad_input + torch.exp(x)) *
  grad_output`: the scattered gradient, exp(x) and their sum alive together, 12L beside the
  saved 4L (validation/torch_loss_parallel.py measures 4L more than the plain path).
  Hugging Face's older form (`framework_version: "4.44"`, transformers v4.44.0's
  LlamaForCausalLM.forward: `logits = logits.float()`, `shift_logits = logits[..., :-1,
  :].contiguous()`, then `CrossEntropyLoss`) also copies the shifted fp32 logits (4L', L' =
  b·(s-1)·V): the B-byte logits die at the upcast, and the fp32 logits, their shifted copy and
  the log-probabilities are alive together, 12L in the forward
  (validation/hf_llama_loss_bytes.py); the backward is as above. In PyTorch's caching
  allocator the eager loss leaves segments idle at its backward's peak, 2L (6L with the
  shifted copy) reserved beyond the allocated peak (ckplan.model.allocator
  `eager_loss_cached_bytes`, `loss_cached_bytes` here).
- `compiled` — the same cross-entropy under torch.compile, as torchtitan compiles its loss with
  the model since bbb1b616e (April 2025; `build_cross_entropy_loss`, torchtitan/components/
  loss.py at 6fc499f). Inductor's decompositions turn log_softmax into a max, a sum of
  exponentials and a log per token; the partitioner saves the B-byte logits (the graph's input)
  and those two fp32 statistics per token (8T), and no fp32 copy of the logits
  (validation/torch_float8_sac.py, torch 2.13): tape B·L + 8T. The forward's reductions and the
  backward's pointwise gradient run fused, holding nothing of size L but the B-byte gradient the
  backward writes: backward peak tape + B·L.
- `xentropy` — a fused cross-entropy kernel that reads the B-byte logits as they are
  (flash-attn's CrossEntropyLoss, flash_attn/ops/triton/cross_entropy.py at v2.5.0, which
  llm-foundry's MPT uses by default, `loss_fn: fused_crossentropy`, modeling_mpt.py at
  495218376; the xentropy extension of flash-attn v1 and apex before it): the forward saves the
  logits themselves and the fp32 log-sum-exp of each token (`ctx.save_for_backward(logits,
  lse, labels)`, 4T), and returns fp32 losses and z-losses (8T, transient); the backward writes
  the logits' gradient into a new B-byte tensor (`torch.empty_like(logits)`,
  inplace_backward False). Saved B·L + 4T; backward: + B·L.
- `chunked:N` — the output layer and the loss N tokens-chunks at a time, each chunk's backward
  run in the forward (torchtitan's ChunkedLossWrapper, Liger-Kernel's fused linear
  cross-entropy): nothing of size L is saved; the hidden states' gradient is accumulated in fp32
  (4·T·h per rank) and kept for the backward; a chunk holds its logits, their fp32 copy,
  log-probabilities and two fp32 gradients, (B + 16)·L/N.
- `chunked-output:N` — the output layer run on N token chunks whose B-byte logits are all kept,
  each fed to the compiled cross-entropy of `compiled`, as torchtune's CEWithChunkedOutputLoss
  with compile (torchtune/modules/loss/ce_chunked_output_loss.py and
  training/_compile.py `compile_loss` at 1814feb: `compute_cross_entropy`, the upcast and
  F.cross_entropy, compiled alone; TransformerDecoder.chunked_output returns
  `[self.output(chunk) for chunk in last_hidden_state.chunk(N, dim=1)]`). Tape: B·L + 8T, as
  `compiled`, and nothing of size L in the forward beyond it. The backward first runs every
  chunk's compiled backward (their autograd nodes are the newest), each writing its chunk's
  B-byte gradient before its saved chunk is freed: tape + B·L/N. Then each chunk's output GEMM
  writes a (V/t x h) weight gradient in the GEMM's dtype, which the engine sums in the weight's
  input buffer; the first sum is out of place, so at the second chunk, with N - 2 chunks'
  gradients left, three weight-sized tensors are alive, one of them the gradient the model
  states count: tape - 2·B·L/N + 2·B·V·h/t. Measured with torch 2.13 on the CPU
  (validation/torch_chunked_output_loss.py): both peaks to the tensor.
"""

from __future__ import annotations

from ckplan.model import allocator, frameworks
from ckplan.model.op import FP32_BYTES, split_share
from ckplan.model.spec import ChainSpec

LOSSES = ("fused", "eager", "xentropy", "compiled", "chunked:N", "chunked-output:N")
CHUNKED_KINDS = ("chunked", "chunked-output")


def chunks(loss: str) -> int:
    """N of `chunked:N` and `chunked-output:N` (1 for the others)."""
    kind, _, count = loss.partition(":")
    return int(count) if kind in CHUNKED_KINDS and count else 1


def keeps_chunk_logits(spec: ChainSpec) -> bool:
    """Whether the loss is `chunked-output:N` (the chunks' logits kept for the backward)."""
    return spec.loss.startswith("chunked-output:")


def logits_elements(spec: ChainSpec) -> int:
    """L: the logits on this rank, T·V/t (the largest share of the vocabulary split)."""
    return split_share(tokens(spec) * spec.vocab, spec.tp)


def stream_bytes(spec: ChainSpec) -> int:
    """X: the residual stream's bytes on this rank (/t under sequence parallelism)."""
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    replicated = spec.tp if spec.sp else 1
    return spec.dtype_bytes * split_share(tokens * spec.hidden, replicated)


def hidden_grad_accumulator_bytes(spec: ChainSpec) -> int:
    """The fp32 gradient of the output layer's input a chunked loss accumulates: 4·T·h."""
    return FP32_BYTES * tokens(spec) * spec.hidden


def tokens(spec: ChainSpec) -> int:
    """T: the tokens on this rank, s·b/cp."""
    return (spec.seq // spec.cp) * spec.micro_batch


def loss_statistics_bytes(spec: ChainSpec) -> int:
    """The compiled loss's per-token fp32 statistics: the max and the log of the sum of
    exponentials, 2·4·T on this rank (module docstring, `compiled`)."""
    return 2 * FP32_BYTES * tokens(spec)


def final_norm_saved_bytes(spec: ChainSpec) -> int:
    """What the final norm saves for its backward: its input, X, as a fused or compiled RMSNorm
    or LayerNorm keeps it (its per-token statistics left out, as for the layers' norms), except
    under torchtitan's RMSNorm of December 2024 (`framework_version` 2024.12), which runs
    eagerly in fp32 whether or not the model is compiled: torchtitan/models/norms.py at 9dec370,
    `self._norm(x.float()).type_as(x) * self.weight` with `_norm(x) = x * torch.rsqrt(
    x.pow(2).mean(-1, keepdim=True) + eps)`, and `training.compile` compiles each
    TransformerBlock alone (parallelize_llama.apply_compile at 9dec370), never the final norm.
    Those ops save the fp32 copy of the input, the fp32 rstd of each token and the normalized
    tensor cast back, which `* self.weight` keeps: (4 + B)·n + 4·T_r for n input elements and
    T_r tokens on this rank (/t under sequence parallelism), transformers' LlamaRMSNorm's ops
    and the torch-eager profile's norm1 term; with a frozen weight the cast product is not
    saved, 4·n + 4·T_r. The bf16 input itself is freed (the upcast saves nothing). Measured on
    the CPU at Llama 3 70B's shapes under FSDP2 x TP 8 (validation/torch_fsdp2_tp_memory.py):
    3X + 4·T_r at B = 2, 2X + 4·T_r beyond the input. torchtitan's 3b39d7ab0 (March 2025)
    made the norm `nn.RMSNorm`, whose saved tensors depend on the PyTorch release; the key
    cannot tell those `2024.12` runs apart, which are counted the same."""
    X = stream_bytes(spec)
    if spec.framework != "torchtitan" or frameworks.framework_version(spec) != "2024.12":
        return X
    elements = X // spec.dtype_bytes
    rank_tokens = split_share(tokens(spec), spec.tp if spec.sp else 1)
    product = spec.dtype_bytes * elements if spec.training == "full" else 0
    return FP32_BYTES * elements + product + FP32_BYTES * rank_tokens


def output_layer_input_bytes(spec: ChainSpec) -> int:
    """What the output layer saves of its input for its weight's gradient: the final norm's
    output, X; under torchtitan's sequence parallelism the whole sequence, t·X (B·T·h). Its
    output layer is `ColwiseParallel(input_layouts=Shard(1))` (torchtitan/parallelisms/
    parallelize_llama.py `apply_tp` at 9dec370; models/llama3/infra/parallelize.py since): the
    input DTensor is redistributed to Replicate, an all-gather, before F.linear, which saves
    the gathered local tensor. Megatron-LM's ColumnParallelLinear saves its sequence shard and
    gathers it again in backward (tensor_parallel/layers.py,
    LinearWithGradAccumulationAndAsyncCommunication)."""
    if spec.framework == "torchtitan" and spec.tp > 1 and spec.sp:
        return spec.dtype_bytes * tokens(spec) * spec.hidden
    return stream_bytes(spec)


def output_saved_bytes(spec: ChainSpec) -> int:
    """The output stage's tape: what the final norm saves (its input, X, or torchtitan 2024.12's
    eager fp32 copies, `final_norm_saved_bytes`) and the output layer's input (2X; 4sbh/t for
    B = 2 under SP, X + t·X under torchtitan's, `output_layer_input_bytes`; the final norm's
    alone when the output layer is frozen) and what the loss keeps: 4L (fused,
    eager: the fp32 softmax or log-probabilities, Korthikanti §4.3's 4sbV/t), B·L + 8T
    (compiled: the logits and two statistics per token) or the fp32 hidden-gradient accumulator
    (chunked)."""
    # a frozen output layer (training: frozen, lora, qlora) keeps no input for its weight's
    # gradient (docs/fine-tuning.md); the final norm keeps its own
    norm = final_norm_saved_bytes(spec)
    inputs = norm + output_layer_input_bytes(spec) if spec.training == "full" else norm
    if spec.loss.startswith("chunked:"):
        return inputs + hidden_grad_accumulator_bytes(spec)
    if spec.loss == "xentropy":  # the B-byte logits and the fp32 log-sum-exp per token
        return inputs + spec.dtype_bytes * logits_elements(spec) + FP32_BYTES * tokens(spec)
    if spec.loss == "compiled" or keeps_chunk_logits(spec):
        return inputs + spec.dtype_bytes * logits_elements(spec) + loss_statistics_bytes(spec)
    return inputs + FP32_BYTES * logits_elements(spec)


def output_forward_workspace_bytes(spec: ChainSpec) -> int:
    """What the output stage's forward holds beyond its input while it runs (the chain's
    forward workspace): its tape less the input, and the loss's transients (module docstring):
    B·L (fused), (B + 4)·L (eager: the B-byte logits and the fp32 copy beside the saved
    log-probabilities), 8T (xentropy: its fp32 losses and z-losses), nothing (compiled: the
    logits are the tape), (B + 16)·L/N (a chunk)."""
    X, L, B = stream_bytes(spec), logits_elements(spec), spec.dtype_bytes
    beyond_input = output_saved_bytes(spec) - X
    if spec.loss == "fused":
        return beyond_input + B * L
    if spec.loss == "compiled" or keeps_chunk_logits(spec):
        return beyond_input
    if spec.loss == "eager":  # the copy's forward: fp32 logits and their shifted copy
        shifted = FP32_BYTES * (L + shifted_logits_elements(spec)) if shifted_logits(spec) else 0
        return beyond_input + max((B + FP32_BYTES) * L, shifted)
    if spec.loss == "xentropy":  # the fp32 losses and z-losses it returns
        return beyond_input + 2 * FP32_BYTES * tokens(spec)
    return beyond_input + -(-(B + 4 * FP32_BYTES) * L // chunks(spec.loss))


def output_backward_peak_bytes(spec: ChainSpec) -> int:
    """Peak bytes alive during the output stage's backward (output layer and loss).

    fused (derived, Megatron-LM's vocab-parallel cross-entropy): its backward writes the logits'
    gradient into the saved fp32 buffer in place and returns it in fp32, which autograd casts
    to the logits' dtype, a new B·L tensor, while the fp32 one is alive: tape + B·L. Afterwards
    the fp32 buffer is freed, and the output layer's backward (the B·L gradient, its input and
    the final norm's input saved, the final norm's output gradient X) and the final norm's
    (adding δ_in, X) hold less. eager: nll_loss's backward writes the log-probabilities'
    gradient (4L), log_softmax's the fp32 logits' (4L) beside the saved 4L: tape + 8L; the cast
    back to B bytes follows once the log-probabilities are freed; under torchtitan's loss
    parallel (t > 1, module docstring) tape + 12L. xentropy: the new B-byte gradient beside the
    saved logits: tape + B·L. compiled: one fused kernel writes the B-byte gradient beside the
    saved logits: tape + B·L. chunked: the gradient is
    already accumulated; the output layer's input gradient is that buffer: tape + X (δ_in).
    The loss is a scalar: no δ_out."""
    L, B = logits_elements(spec), spec.dtype_bytes
    tape = output_saved_bytes(spec)
    if spec.loss in ("fused", "compiled"):
        return tape + B * L
    if spec.loss == "eager":
        return tape + eager_backward_gradients(spec) * FP32_BYTES * L
    if spec.loss == "xentropy":
        return tape + B * L
    if keeps_chunk_logits(spec):
        return tape + chunk_output_backward_bytes(spec)
    return tape + stream_bytes(spec)


def chunk_output_backward_bytes(spec: ChainSpec) -> int:
    """`chunked-output:N`'s backward beyond its tape (module docstring): the larger of one
    chunk's B-byte gradient while the chunks' compiled backwards run (B·L/N) and, when the
    output layer trains, two more weight-sized gradients less two chunks' gradients while the
    chunks' weight gradients are summed (2·B·V·h/t - 2·B·L/N)."""
    L, B, N = logits_elements(spec), spec.dtype_bytes, chunks(spec.loss)
    chunk = -(-B * L // N)
    if spec.training != "full":
        return chunk
    weight = B * split_share(spec.vocab * spec.hidden, spec.tp)
    return max(chunk, 2 * weight - 2 * chunk)


def eager_backward_gradients(spec: ChainSpec) -> int:
    """The fp32 logit-sized tensors the eager loss's backward holds beside its tape: 2 (the
    log-probabilities' and the logits' gradients), 3 under torchtitan's loss parallel (its
    vocabulary-split logits, t > 1: the scattered gradient, exp(x) and their sum; module
    docstring)."""
    return 3 if spec.framework == "torchtitan" and spec.tp > 1 else 2


def output_backward_workspace_bytes(spec: ChainSpec) -> int:
    """The output stage's backward beyond the chain's tape + δ_in (δ_out is a scalar loss, 0
    bytes): max(0, output_backward_peak_bytes - (output_saved_bytes + X))."""
    peak = output_backward_peak_bytes(spec)
    return max(0, peak - (output_saved_bytes(spec) + stream_bytes(spec)))


def loss_moved_bytes(spec: ChainSpec) -> tuple[int, int]:
    """Bytes the loss's kernels read and write, (forward, backward), beyond the output GEMM
    (derived from the kernels above): fused, one fp32 pass to copy, one to find the max, one
    to sum the exponentials and normalise, (B + 12)·L forward, (12 + B)·L backward (the
    in-place gradient and the cast back); eager, the cast (B + 4), log_softmax (4 + 4 and its
    two reductions, 8) and nll_loss's gather, (B + 16)·L forward, nll_loss's and log_softmax's
    backward (4 + 12) and the cast back (4 + B), (20 + B)·L; xentropy, one read of the logits
    forward (B·L, the row's maximum and sum in one block), a read and the gradient's write
    backward (2B·L); compiled, the B-byte logits read by the max and by the sum of
    exponentials, 2B·L forward, read and the gradient written, 2B·L backward; chunked-output,
    the compiled loss's on every chunk and, where the output layer trains, the N - 1 sums of
    its weight's gradients (two read, one written: 3·B·V·h/t each) in the backward; chunked, the
    eager kernels on every chunk, forward and backward in the
    forward pass."""
    L, B = logits_elements(spec), spec.dtype_bytes
    if spec.loss == "fused":
        return (B + 12) * L, (12 + B) * L
    if spec.loss == "compiled":
        return 2 * B * L, 2 * B * L
    if keeps_chunk_logits(spec):
        sums = chunks(spec.loss) - 1 if spec.training == "full" else 0
        weight = B * split_share(spec.vocab * spec.hidden, spec.tp)
        return 2 * B * L, 2 * B * L + sums * 3 * weight
    if spec.loss == "eager":
        return (B + 16) * L, (20 + B) * L
    if spec.loss == "xentropy":
        return B * L, 2 * B * L
    return (B + 16) * L + (20 + B) * L, 0


def shifted_logits(spec: ChainSpec) -> bool:
    """Whether the eager loss copies the shifted fp32 logits: Hugging Face transformers at
    `framework_version: "4.44"` (LlamaForCausalLM.forward at v4.44.0: `shift_logits =
    logits[..., :-1, :].contiguous()` after `logits = logits.float()`; the same lines at
    v4.38.2 and v4.39.0), under the Trainer (hf) or under DeepSpeed (a transformers model
    that the Trainer or accelerate hands to DeepSpeed); transformers 5.25's ForCausalLMLoss
    pads and shifts the labels instead (`nn.functional.pad(labels, (0, 1),
    value=ignore_index)`, loss/loss_utils.py), as torchtitan never shifts."""
    transformers_model = spec.framework in ("hf", "deepspeed")
    return (
        spec.loss == "eager" and transformers_model and frameworks.framework_version(spec) == "4.44"
    )


def shifted_logits_elements(spec: ChainSpec) -> int:
    """L': the shifted copy's elements, b·(s - 1)·V (hf runs no tensor or context parallelism)."""
    return spec.micro_batch * (spec.seq - 1) * spec.vocab


def loss_cached_bytes(spec: ChainSpec, stage: int | None = None) -> int:
    """The bytes the loss's blocks leave reserved beyond the allocated peak on a GPU of pipeline
    stage `stage` (default the last, which runs the loss): the eager loss's idle segments
    (ckplan.model.allocator `eager_loss_cached_bytes`) with the default allocator, but under
    torchtitan's loss parallel (t > 1, its DTensor ops not replayed there); with expandable
    segments the logits' idle block (`expandable_eager_loss_idle_bytes`), loss parallel's
    local logits included (validation/fsdp2_tp_allocator_replay.py: at the 70B 2-D step's
    allocated peak the local bf16 logits' 3.91 GiB are idle, within a 4.75 GiB free block);
    0 for the other losses and on the other stages."""
    if stage is not None and stage != spec.pp - 1:
        return 0
    if spec.loss != "eager":
        return 0
    if spec.expandable_segments:
        return allocator.expandable_eager_loss_idle_bytes(logits_elements(spec), spec.dtype_bytes)
    if spec.framework == "torchtitan" and spec.tp > 1:
        return 0
    shifted = shifted_logits_elements(spec) if shifted_logits(spec) else 0
    return allocator.eager_loss_cached_bytes(logits_elements(spec), spec.dtype_bytes, shifted)
