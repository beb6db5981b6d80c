"""Step time: the ops of the op table timed on a GPU, composed into one training iteration.

One micro-batch through the chain one GPU runs (embedding -> its layers -> output and loss):
every stage's forward is timed once per forward the schedule replay runs (`Plan.stage_forwards`,
so every strategy, `optimal` and `revolve` included, gets the time of the ops it re-runs), its
backward once; selective recomputation re-runs each layer's attention core in the backward.
Communication: tensor-parallel collectives per layer (Megatron-LM's, Korthikanti §4.2.2) in the
forward, the backward and every re-forward; the context-parallel K/V ring; MLA's RoPE-key
gather; the expert-parallel all-to-alls and etp gathers of every MoE layer
(`hardware.expert_parallel`); pipeline sends; the data-parallel gradient reduction (dense
parameters over dp·cp, routed experts over their expert-data-parallel group) and ZeRO-3's
parameter gathers. Then the pipeline: m micro-batches, and the 1F1B bubble of (p - 1)/v
micro-batch times (Narayanan et al. 2021 §2.2: a bubble fraction of (p - 1)/(m·v) of the ideal
time), then the optimizer step. Under DualPipe (`hardware.dualpipe`) and Megatron-Core's
combined 1F1B (`overlap_moe_expert_parallel_comm`, `hardware.combined_1f1b`) paired forward and
backward chunks hide each other's all-to-alls (`hardware.chunk_pairs`).

MFU and HFU follow Korthikanti §6.3 (Chowdhery et al. 2022): model FLOPs per iteration
(`flops.model_flops_per_iteration`, no recompute) over step time, GPUs and peak; hardware FLOPs
add the recompute the plan runs (`Plan.flops.overhead`).

Pure and fast: the per-layer figures are cached per (spec, gpu), so timing each of a sweep's
plans is a few additions (`step_time(plan, gpu)`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import groupby

from ckplan.hardware import combined_1f1b, host_states
from ckplan.hardware import communication as comm
from ckplan.hardware.chunk_pairs import Chunk, hidden_in_pair
from ckplan.hardware.code_path import (
    AMAX_BYTES,
    current_scaling_amax_reductions,
    float8_precompute_amax_bytes,
    float8_shard_cast_bytes,
    fp8_gemm,
    sequence_parallel_gather_size,
    spec_code_path,
)
from ckplan.hardware.dualpipe import COMMUNICATION_SMS, forward_backward_seconds, paired_chunks
from ckplan.hardware.expert_parallel import expert_parallel_comm, exposed_fraction
from ckplan.hardware.gpus import GPU
from ckplan.hardware.roofline import (
    OpTime,
    backward_matmuls,
    contended_matmul_seconds,
    matmul_seconds,
    memory_seconds,
)
from ckplan.hardware.times import ZERO, MicroBatchTime, StageTime
from ckplan.model import frameworks, loss, memory, mtp, optimizers
from ckplan.model.context_parallel import (
    a2a_tensor_bytes,
    hierarchical_sizes,
    te_a2a_sent_bytes,
    te_hierarchical_a2a_sent_bytes,
    torchtitan_ring_exchange_bytes,
    uses_a2a,
    uses_te_allgather,
)
from ckplan.model.flops import MFU_CONVENTION, iteration_flops, model_flops_per_iteration
from ckplan.model.layers import LayerKind, stage_chunk_layers, stage_kinds
from ckplan.model.modules import module_ops
from ckplan.model.moe import MOE
from ckplan.model.op import (
    ATTENTION_CORE,
    FP32_BYTES,
    Matmul,
    Op,
    kv_heads_per_rank,
    saves_gathered_input,
    split_share,
)
from ckplan.model.op_policy import (
    Unit,
    is_policy,
    parse_policy,
    rerun_comm_ops,
    rerun_units,
)
from ckplan.model.ops import layer_ops as model_layer_ops
from ckplan.model.ops import representative_kind
from ckplan.model.parts import cached_by_chain
from ckplan.model.spec import ModelSpec

TOKEN_ID_BYTES = memory.TOKEN_ID_BYTES


def _add(a: OpTime, b: OpTime) -> OpTime:
    return OpTime(a.matmul + b.matmul, a.memory + b.memory)


def _scale(a: OpTime, factor: float) -> OpTime:
    return OpTime(a.matmul * factor, a.memory * factor)


@dataclass(frozen=True)
class StepTime:
    """One training iteration on the busiest GPU, in seconds; the parts sum to `step_seconds`.

    communication_seconds is what forward, backward, pipeline and data-parallel communication
    add (the re-forwards' collectives are in recompute_seconds); `breakdown` splits the step
    by kind instead (its communication includes the re-forwards')."""

    step_seconds: float
    forward_seconds: float
    backward_seconds: float
    recompute_seconds: float
    communication_seconds: float
    bubble_seconds: float
    optimizer_seconds: float
    overhead: float  # recompute's cost: step / step without recompute - 1
    mfu: float
    hfu: float
    tokens_per_second_per_gpu: float
    breakdown: dict[str, float] = field(default_factory=dict)
    # exposed expert-parallel communication of the step (all-to-alls, etp gathers), re-forwards
    # included; part of communication_seconds and recompute_seconds
    expert_parallel_seconds: float = 0.0
    # the FLOP count `mfu` divides (ckplan.model.flops.FLOP_CONVENTIONS); hfu counts what ran
    mfu_convention: str = MFU_CONVENTION
    # activation offloading: host copies the compute could not hide (hardware.host_link);
    # part of step_seconds
    offload_exposed_seconds: float = 0.0
    # model states on the host (hardware.host_states): their copies the compute could not
    # hide; part of step_seconds (optimizer_seconds is then the CPU step)
    state_copy_seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        """The JSON `time` object (docs/time-model.md) plus optimizer_seconds,
        expert_parallel_seconds and breakdown."""
        return (
            {
                "step_seconds": self.step_seconds,
                "forward_seconds": self.forward_seconds,
                "backward_seconds": self.backward_seconds,
                "recompute_seconds": self.recompute_seconds,
                "communication_seconds": self.communication_seconds,
                "bubble_seconds": self.bubble_seconds,
                "overhead": self.overhead,
                "mfu": self.mfu,
                "mfu_convention": self.mfu_convention,
                "hfu": self.hfu,
                "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
                "optimizer_seconds": self.optimizer_seconds,
                "expert_parallel_seconds": self.expert_parallel_seconds,
                "breakdown": dict(self.breakdown),
            }
            | (
                {"offload_exposed_seconds": self.offload_exposed_seconds}
                if self.offload_exposed_seconds
                else {}
            )
            | ({"state_copy_seconds": self.state_copy_seconds} if self.state_copy_seconds else {})
        )


# ---- per-stage times (cached per spec and GPU) -------------------------------------------


def _sum_ops(ops, timer, dtype: int) -> OpTime:
    total = ZERO
    for op in ops:
        total = _add(total, timer(op, dtype))
    return total


def tensor_parallel_comm(spec: ModelSpec, gpu: GPU, ops: tuple[Op, ...]) -> tuple[float, float]:
    """Seconds the tensor-parallel collectives of `ops` add, (forward, backward), as
    Megatron-LM runs them (tensor_parallel/layers.py, `LinearWithGradAccumulationAndAsync
    Communication`, and mappings.py; Korthikanti §4.2.2):

    - a column-parallel linear (`tp_comm` "column": QKV, fc1): without SP, its input gradient
      is all-reduced in the backward, overlapped with the weight-gradient GEMM; with SP, its
      input is all-gathered in the forward (exposed) and again in the backward, overlapped with
      the input-gradient GEMM (not where the linear saved the gathered input, as torchtitan's
      do: `op.saves_gathered_input`), and the input gradient is reduce-scattered, overlapped
      with the weight-gradient GEMM;
    - a row-parallel linear ("row": out_proj, fc2): its output is all-reduced in the forward
      (exposed); with SP reduce-scattered in the forward and its output gradient all-gathered
      in the backward (both exposed).

    With `tp_comm_overlap` the exposed ones are pipelined with their GEMM (`pipelined`).

    Each collective moves the whole (s·b, h) tensor of B-byte values on the TP link, plus NCCL's
    ring latency (`comm.all_reduce_latency`, `all_gather_latency`); under Transformer Engine's
    FP8 (and torchtitan 2024.12's torchao float8) the SP all-gathers of an FP8 GEMM move one
    byte per value (`code_path.sequence_parallel_gather_bytes`, MXFP8's scales beside them;
    block scaling's copies and scales, `code_path.fp8_block_gathered_bytes`), and under
    current scaling each FP8 gather waits for an all-reduce of its amax over the group first
    (`code_path.current_scaling_amax_reductions`), exposed: the host waits on it before the
    cast. An overlapped one adds what it does not hide and the slowdown of the GEMM whose SMs
    its blocks hold (`comm.overlapped`).
    """
    t = spec.tp
    if t == 1:
        return 0.0, 0.0
    bandwidth = comm.group_bandwidth(gpu, t, 1)
    reduce_latency = comm.all_reduce_latency(gpu, t)
    gather_latency = comm.all_gather_latency(gpu, t)
    amax_reduce = current_scaling_amax_reductions(
        spec.fp8_recipe if spec.precision == "fp8" else None, spec.sp, t
    ) * (comm.all_reduce_seconds(AMAX_BYTES, t, bandwidth) + reduce_latency)

    def beside(seconds: float, gemm: Matmul) -> float:
        alone = matmul_seconds(gpu, gemm)
        return comm.overlapped(seconds, alone, contended_matmul_seconds(gpu, gemm))

    def pipelined(seconds: float, gemm: Matmul) -> float:
        """A collective on the GEMM's critical path: exposed, or with `tp_comm_overlap`
        (Transformer Engine's userbuffers, torchtitan's async TP) split into t chunks
        pipelined with the GEMM, one chunk exposed (NeMo's communication-overlap docs)."""
        if not spec.tp_comm_overlap:
            return seconds
        return max(seconds / t, beside(seconds, gemm))

    forward = backward = 0.0
    for op in ops:
        if op.tp_comm is None or op.matmul is None:
            continue
        mm = op.matmul
        input_grad, weight_grad = backward_matmuls(mm)
        amax = amax_reduce if fp8_gemm(op) and spec.framework == "megatron" else 0.0
        if op.tp_comm == "column":
            size = mm.batch * mm.m * mm.k * mm.dtype_bytes
            if spec.sp:
                rows = mm.batch * mm.m
                gather_size = sequence_parallel_gather_size(spec, op, rows, mm.k, "rowwise")
                gather = comm.all_gather_seconds(gather_size, t, bandwidth) + gather_latency
                forward += amax + pipelined(gather, mm)
                if not saves_gathered_input(spec):
                    # the backward re-gathers the saved copy, the column-wise one
                    regather_size = sequence_parallel_gather_size(
                        spec, op, rows, mm.k, "columnwise"
                    )
                    regather = comm.all_gather_seconds(regather_size, t, bandwidth) + gather_latency
                    backward += beside(regather, input_grad)
                scatter = comm.reduce_scatter_seconds(size, t, bandwidth) + gather_latency
                backward += beside(scatter, weight_grad)
            else:
                reduce = comm.all_reduce_seconds(size, t, bandwidth) + reduce_latency
                backward += beside(reduce, weight_grad)
        else:
            size = mm.batch * mm.m * mm.n * mm.dtype_bytes
            if spec.sp:
                scatter = comm.reduce_scatter_seconds(size, t, bandwidth) + gather_latency
                forward += pipelined(scatter, mm)
                # the output gradient, with both copies where the recipe gathers them
                gather_size = sequence_parallel_gather_size(spec, op, mm.batch * mm.m, mm.n, "both")
                gather = comm.all_gather_seconds(gather_size, t, bandwidth) + gather_latency
                backward += amax + pipelined(gather, input_grad)
            else:
                forward += pipelined(
                    comm.all_reduce_seconds(size, t, bandwidth) + reduce_latency, mm
                )
    return forward, backward


def context_parallel_comm(
    spec: ModelSpec, gpu: GPU, core_forward: OpTime, core_backward: OpTime
) -> tuple[float, float]:
    """Exposed seconds of the context-parallel ring exchange of K and V, (forward, backward).

    Ring attention as Megatron-LM's context parallelism runs it (Liu et al. 2023; Megatron-Core
    context_parallel docs): each of the cp - 1 steps sends this rank's K and V chunk, 2·(s/cp)·b
    ·(g·d/t)·B bytes, to the next rank while the attention of the current chunk is computed; the
    backward sends K, V and their gradients, twice that. Overlapped with the attention core.
    torchtitan's PyTorch ring attention exchanges otherwise (`torchtitan_ring_comm`), and so
    do Transformer Engine's all-to-all and all-gather exchanges under `cp_attention` a2a and
    allgather (`a2a_context_parallel_comm`, `allgather_context_parallel_comm`).
    """
    cp = spec.cp
    if cp == 1 or spec.kind != "transformer":
        return 0.0, 0.0
    heads_r = max(1, spec.heads // spec.tp)
    if uses_a2a(spec):
        return a2a_context_parallel_comm(spec, gpu, heads_r)
    if uses_te_allgather(spec):
        return allgather_context_parallel_comm(spec, gpu)
    ring = torchtitan_ring_exchange_bytes(spec, heads_r, kv_heads_per_rank(spec))
    if ring != (0, 0):
        return torchtitan_ring_comm(spec, gpu, ring, core_forward.total, core_backward.total)
    # under a2a+p2p the ring runs over cp / a2a ranks, tp·a2a apart, with the same bytes per
    # rank (s·a2a/cp tokens at 1/a2a of the K/V heads); the all-to-alls around it
    # (`hierarchical_context_parallel_comm`) are exposed
    a2a, ring_size = hierarchical_sizes(spec)
    a2a_forward, a2a_backward = (
        hierarchical_context_parallel_comm(spec, gpu, heads_r) if a2a > 1 else (0.0, 0.0)
    )
    tokens = (spec.seq // cp) * spec.micro_batch
    kv = 2 * tokens * kv_heads_per_rank(spec) * spec.head_dim * spec.dtype_bytes
    bandwidth = comm.group_bandwidth(gpu, ring_size, spec.tp * a2a)
    send = (ring_size - 1) * comm.p2p_seconds(kv, bandwidth)
    return (
        a2a_forward + comm.exposed(send, core_forward.total),
        a2a_backward + comm.exposed(2 * send, core_backward.total),
    )


def hierarchical_context_parallel_comm(
    spec: ModelSpec, gpu: GPU, heads_r: int
) -> tuple[float, float]:
    """Seconds of the all-to-alls of Transformer Engine's a2a+p2p context parallelism,
    (forward, backward): one per tensor sent (`context_parallel.te_hierarchical_a2a_sent_
    bytes`) over a group of `cp_a2a_size` consecutive cp ranks, tp apart, none hidden (as
    `a2a_context_parallel_comm`: the ring needs what they bring)."""
    release = frameworks.framework_version(spec)
    tensors = a2a_tensor_bytes(spec, heads_r, kv_heads_per_rank(spec))
    forward, backward = te_hierarchical_a2a_sent_bytes(release, *tensors)
    a2a = spec.cp_a2a_size

    def seconds(sent: tuple[int, ...]) -> float:
        return sum(comm.hierarchical_all_to_all_seconds(size, a2a, spec.tp, gpu) for size in sent)

    return seconds(forward), seconds(backward)


def a2a_context_parallel_comm(spec: ModelSpec, gpu: GPU, heads_r: int) -> tuple[float, float]:
    """Seconds of Transformer Engine's all-to-all context parallelism, (forward, backward):
    one all-to-all over the cp group per tensor it sends (`context_parallel.te_a2a_sent_bytes`),
    each (cp - 1)/cp of the rank's tensor out over the links the group spans
    (`communication.hierarchical_all_to_all_seconds`, cp ranks tp apart). None hides behind
    the kernel: the kernel needs what they bring, and the output's and gradients' all-to-alls
    start after it (`flash_attn_a2a_communicate` overlaps one tensor's all-to-all with
    another's reordering copy only)."""
    release = frameworks.framework_version(spec)
    tensors = a2a_tensor_bytes(spec, heads_r, kv_heads_per_rank(spec))
    forward, backward = te_a2a_sent_bytes(release, *tensors)

    def seconds(sent: tuple[int, ...]) -> float:
        return sum(
            comm.hierarchical_all_to_all_seconds(size, spec.cp, spec.tp, gpu) for size in sent
        )

    return seconds(forward), seconds(backward)


def allgather_context_parallel_comm(spec: ModelSpec, gpu: GPU) -> tuple[float, float]:
    """Seconds of Transformer Engine's all-gather context parallelism, (forward, backward)
    (`AttnFuncWithCPAndKVAllGather`: "KV all-gather between CP ranks is exposed"): the
    forward all-gathers K and V over the cp group before its kernels; the backward gathers
    them again and reduce-scatters dK and dV after its kernels, each the whole sequence's
    bf16 tensor (cp x the rank's), none hidden."""
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    gathered = spec.cp * tokens * kv_heads_per_rank(spec) * spec.head_dim * spec.dtype_bytes
    bandwidth = comm.group_bandwidth(gpu, spec.cp, spec.tp)
    latency = comm.all_gather_latency(gpu, spec.cp)
    gather = comm.all_gather_seconds(gathered, spec.cp, bandwidth) + latency
    scatter = comm.reduce_scatter_seconds(gathered, spec.cp, bandwidth) + latency
    return 2 * gather, 2 * gather + 2 * scatter


def torchtitan_ring_comm(
    spec: ModelSpec,
    gpu: GPU,
    exchange: tuple[int, int],
    core_forward: float,
    core_backward: float,
) -> tuple[float, float]:
    """Exposed seconds of PyTorch's ring attention's exchange under torchtitan, (forward,
    backward) (`context_parallel.torchtitan_ring_exchange_bytes`; torch/distributed/tensor/
    experimental/_context_parallel/_attention.py at v2.13.0). The K‖V all-gather is issued
    before step 0 and waited for at step 1: it hides behind step 0's kernel, 1/cp of the core
    (load balancing evens the steps). In the backward the gather again, then each step's fp32
    dK‖dV goes to the next rank while the next step computes; the last shift, after the last
    step, is waited for at once. `exchange`: the gathered and the shifted bytes."""
    cp = spec.cp
    gathered, rotated = exchange
    bandwidth = comm.group_bandwidth(gpu, cp, spec.tp)
    gather = comm.all_gather_seconds(gathered, cp, bandwidth) + comm.all_gather_latency(gpu, cp)
    shift = comm.p2p_seconds(rotated, bandwidth)
    forward = comm.exposed(gather, core_forward / cp)
    step = core_backward / cp
    backward = comm.exposed(gather, step) + (cp - 1) * comm.exposed(shift, step) + shift
    return forward, backward


def mla_comm(spec: ModelSpec, gpu: GPU) -> tuple[float, float]:
    """Exposed seconds of MLA's RoPE-key gather, (forward, backward): under sequence
    parallelism the shared RoPE key (s·b, qk_rope) of the rank's s/t tokens is all-gathered over
    TP in the forward and its gradient reduce-scattered in the backward
    (multi_latent_attention.py: `gather_from_sequence_parallel_region(k_pos_emb)`); the up
    projections' own gathers are their `tp_comm`. Nothing without SP (each rank projects all
    tokens) or without MLA."""
    if not spec.mla or spec.tp == 1 or not spec.sp:
        return 0.0, 0.0
    size = _tokens(spec) * spec.qk_rope_head_dim * spec.dtype_bytes
    bandwidth = comm.group_bandwidth(gpu, spec.tp, 1)
    latency = comm.all_gather_latency(gpu, spec.tp)
    return (
        comm.all_gather_seconds(size, spec.tp, bandwidth) + latency,
        comm.reduce_scatter_seconds(size, spec.tp, bandwidth) + latency,
    )


@lru_cache(maxsize=256)
def expert_comm_exposed(spec: ModelSpec, gpu: GPU, kind: LayerKind) -> tuple[float, float]:
    """Exposed seconds of an MoE layer's expert-parallel collectives, (forward, backward): the
    share `exposed_fraction` leaves of them beside the layer's forward and backward compute. 0
    in a dense layer. `gpu`: at the sustained rates (`spec_code_path`)."""
    if not kind.moe:
        return 0.0, 0.0
    ops = model_layer_ops(spec, kind)
    path = spec_code_path(spec, gpu)
    gpu = path.gpu  # compute at the sustained rates; links as they are
    ep = expert_parallel_comm(spec, gpu)
    compute = _sum_ops(ops, path.forward, spec.dtype_bytes).total
    compute += _sum_ops(ops, path.backward, spec.dtype_bytes).total
    # under the combined 1F1B the merged chunks hide it (`combined_1f1b_hidden`), not a share
    overlap = 0.0 if spec.overlap_moe_expert_parallel_comm else gpu.ep_overlap
    left = exposed_fraction(ep.forward + ep.backward, compute, overlap)
    return left * ep.forward, left * ep.backward


@lru_cache(maxsize=256)
def attention_cp_comm(spec: ModelSpec, gpu: GPU, kind: LayerKind) -> tuple[float, float]:
    """Exposed seconds of the context-parallel K/V ring, (forward, backward), beside the
    attention core it feeds (`context_parallel_comm`)."""
    path = spec_code_path(spec, gpu)
    core = module_ops(model_layer_ops(spec, kind), (ATTENTION_CORE,))
    return context_parallel_comm(
        spec,
        path.gpu,
        _sum_ops(core, path.forward, spec.dtype_bytes),
        _sum_ops(core, path.backward, spec.dtype_bytes),
    )


# the policy searches cost the same groups of units on each layout of a `plan` again and again,
# and layouts that differ in dp, ZeRO or the micro-batch count share them
@cached_by_chain(16384)
def rerun_time(
    spec: ModelSpec, gpu: GPU, kind: LayerKind | None, again: tuple[Unit, ...]
) -> tuple[OpTime, float, float]:
    """A per-op policy's re-forward of the units `again` (`op_policy.rerun_units`) in a layer
    of `kind`: (the units' forward time, the collectives it repeats in seconds, of which
    expert-parallel). Collectives (derived): the tensor-parallel ones of the table ops
    `op_policy.rerun_comm_ops` names, once per table op; the K/V ring when the attention
    kernel re-runs (`attention_cp_comm`); the exposed share of the dispatch all-to-all (and
    the etp all-gather) when `dispatch` re-runs, of the combine all-to-all (and the etp
    reduce-scatter) when `combine` does. A sum over the units with one term per table op and
    per collective: what the policy search adds up group by group
    (`plan.policy_search.rerun_cost`)."""
    kind = representative_kind(spec) if kind is None else kind
    path = spec_code_path(spec, gpu)
    forward = _sum_ops([unit.op for unit in again], path.forward, spec.dtype_bytes)
    collectives = tensor_parallel_comm(spec, path.gpu, rerun_comm_ops(spec, again, kind))[0]
    names = {unit.name for unit in again}
    if "attention" in names:
        collectives += attention_cp_comm(spec, gpu, kind)[0]
    expert = 0.0
    if kind.moe and names & {"dispatch", "combine"}:
        ep = expert_parallel_comm(spec, path.gpu)
        left_forward = expert_comm_exposed(spec, gpu, kind)[0]
        share = left_forward / ep.forward if ep.forward > 0 else 0.0
        if "dispatch" in names:
            expert += share * (ep.dispatch + ep.gather)
        if "combine" in names:
            expert += share * (ep.combine + ep.scatter)
    return forward, collectives + expert, expert


@lru_cache(maxsize=256)
def layer_time(
    spec: ModelSpec,
    gpu: GPU,
    kind: LayerKind | None = None,
    groups: tuple[str, ...] = (ATTENTION_CORE,),
) -> StageTime:
    """One layer of `kind` (default: the representative one), one micro-batch: its ops'
    roofline times and its exposed communication; `core_forward` is the forward of the
    recompute `groups` (the attention core by default), `core_comm` the collectives its re-run
    repeats (the K/V ring of the attention core; the shared experts' TP collectives and the
    expert-parallel ones of the whole MoE block, group `moe`)."""
    kind = representative_kind(spec) if kind is None else kind
    ops = model_layer_ops(spec, kind)
    dtype = spec.dtype_bytes
    given = gpu
    path = spec_code_path(spec, gpu)
    gpu = path.gpu  # compute at the sustained rates; links as they are
    policy = parse_policy(groups[0]) if groups and is_policy(groups[0]) else None
    forward = _sum_ops(ops, path.forward, dtype)
    backward = _sum_ops(ops, path.backward, dtype)
    tp_forward, tp_backward = tensor_parallel_comm(spec, gpu, ops)
    mla_forward, mla_backward = mla_comm(spec, gpu)
    ep_forward, ep_backward = expert_comm_exposed(spec, given, kind)
    if policy is not None:
        # a per-op policy re-runs what the backward reads and it does not keep; the K/V ring
        # of the forward hides behind the attention core, whatever the policy re-runs
        cp_forward, cp_backward = attention_cp_comm(spec, given, kind)
        core_forward, core_comm, core_ep = rerun_time(
            spec, given, kind, rerun_units(spec, policy, kind)
        )
    else:
        core = module_ops(ops, groups)
        core_forward = _sum_ops(core, path.forward, dtype)
        core_backward = _sum_ops(core, path.backward, dtype)
        cp_forward, cp_backward = context_parallel_comm(spec, gpu, core_forward, core_backward)
        core_comm = tensor_parallel_comm(spec, gpu, tuple(core))[0]
        core_comm += cp_forward if ATTENTION_CORE in groups else 0.0
        core_ep = ep_forward if MOE in groups else 0.0
        core_comm += core_ep
    return StageTime(
        forward=forward,
        backward=backward,
        forward_comm=tp_forward + cp_forward + mla_forward + ep_forward,
        backward_comm=tp_backward + cp_backward + mla_backward + ep_backward,
        core_forward=core_forward,
        core_comm=core_comm,
        expert_forward_comm=ep_forward,
        expert_backward_comm=ep_backward,
        core_expert_comm=core_ep,
    )


def _tokens(spec: ModelSpec) -> int:
    return (spec.seq // spec.cp) * spec.micro_batch


@lru_cache(maxsize=256)
def embedding_time(spec: ModelSpec, gpu: GPU) -> StageTime:
    """The embedding (first pipeline stage): a gather of token rows (memory-bound: reads the ids
    and rows, writes (s·b, h)), learned positions added, embedding dropout; Megatron's
    vocab-parallel embedding all-reduces its output over TP (reduce-scatters under SP, whose
    backward all-gathers). Backward: the rows' gradients accumulated into the fp32 gradient."""
    if spec.kind != "transformer" or spec.vocab == 0:
        return StageTime()
    tokens, B = _tokens(spec), spec.dtype_bytes
    full = tokens * spec.hidden
    stream = memory.layer_input_bytes(spec)
    moved = TOKEN_ID_BYTES * tokens + 2 * B * full
    if spec.positions == "learned":
        moved += 3 * B * full
    if spec.dropout > 0:
        moved += 2 * stream + stream // B
    backward_moved = B * full + 2 * FP32_BYTES * full
    forward_comm = backward_comm = 0.0
    if spec.tp > 1:
        bandwidth = comm.group_bandwidth(gpu, spec.tp, 1)
        if spec.sp:
            latency = comm.all_gather_latency(gpu, spec.tp)
            forward_comm = comm.reduce_scatter_seconds(B * full, spec.tp, bandwidth) + latency
            backward_comm = comm.all_gather_seconds(B * full, spec.tp, bandwidth) + latency
        else:
            latency = comm.all_reduce_latency(gpu, spec.tp)
            forward_comm = comm.all_reduce_seconds(B * full, spec.tp, bandwidth) + latency
    return StageTime(
        forward=OpTime(0.0, memory_seconds(gpu, moved)),
        backward=OpTime(0.0, memory_seconds(gpu, backward_moved)),
        forward_comm=forward_comm,
        backward_comm=backward_comm,
    )


@lru_cache(maxsize=256)
def output_time(spec: ModelSpec, gpu: GPU) -> StageTime:
    """Final norm, the output layer (a column-parallel GEMM, (s·b, h) @ (h, V/t)) and the loss's
    kernels as its implementation runs them (`loss.loss_moved_bytes`: Megatron's vocab-parallel
    cross-entropy, PyTorch's on upcast logits, or chunks of either)."""
    if spec.kind != "transformer" or spec.vocab == 0:
        return StageTime()
    head = _output_op(spec)
    B = spec.dtype_bytes
    path = spec_code_path(spec, gpu)
    forward_comm, backward_comm = tensor_parallel_comm(spec, path.gpu, (head,))
    return StageTime(
        forward=path.forward(head, B),
        backward=path.backward(head, B),
        forward_comm=forward_comm,
        backward_comm=backward_comm,
    )


def _output_op(spec: ModelSpec) -> Op:
    """The output layer with the final norm's and the loss's memory-bound kernels, one op."""
    tokens, B = _tokens(spec), spec.dtype_bytes
    stream = memory.layer_input_bytes(spec)
    loss_forward, loss_backward = loss.loss_moved_bytes(spec)
    return Op(
        "output",
        "output",
        0,
        2 * tokens * split_share(spec.vocab, spec.tp) * spec.hidden,
        # a frozen output layer (docs/fine-tuning.md): the input gradient's GEMM alone
        (4 if spec.training == "full" else 2)
        * tokens
        * split_share(spec.vocab, spec.tp)
        * spec.hidden,
        matmul=Matmul(tokens, split_share(spec.vocab, spec.tp), spec.hidden, 1, B),
        forward_bytes=2 * stream + loss_forward,
        backward_bytes=3 * stream + loss_backward,
        tp_comm="column",
    )


@lru_cache(maxsize=256)
def chain_stage_times(
    spec: ModelSpec, gpu: GPU, stage: int, groups: tuple[str, ...] = (ATTENTION_CORE,)
) -> tuple[StageTime, ...]:
    """The times of the chain of pipeline stage `stage`, in `plan.layer_chain`'s order: each
    layer timed as its kind (mixed layers, `model.layers`)."""
    kinds = stage_kinds(spec, stage)
    per_kind = {kind: layer_time(spec, gpu, kind, groups) for kind in set(kinds)}
    stages = [per_kind[kind] for kind in kinds]
    has_vocab = spec.kind == "transformer" and spec.vocab > 0
    if has_vocab and stage == 0:
        stages = [embedding_time(spec, gpu), *stages]
    if has_vocab and stage == spec.pp - 1:
        depth = mtp_time(spec, gpu, groups)
        heads = 1 + spec.mtp_layers  # the main loss and each MTP depth's, one after another
        stages = [*stages, *(depth,) * spec.mtp_layers, _scaled(output_time(spec, gpu), heads)]
    return tuple(stages)


def _scaled(stage: StageTime, factor: int) -> StageTime:
    """`stage` run `factor` times over."""
    if factor == 1:
        return stage
    return StageTime(
        forward=_scale(stage.forward, factor),
        backward=_scale(stage.backward, factor),
        forward_comm=stage.forward_comm * factor,
        backward_comm=stage.backward_comm * factor,
        core_forward=_scale(stage.core_forward, factor),
        core_comm=stage.core_comm * factor,
        expert_forward_comm=stage.expert_forward_comm * factor,
        expert_backward_comm=stage.expert_backward_comm * factor,
        core_expert_comm=stage.core_expert_comm * factor,
    )


def _plus(a: StageTime, b: StageTime) -> StageTime:
    """Two parts of one chain stage run one after the other."""
    return StageTime(
        forward=_add(a.forward, b.forward),
        backward=_add(a.backward, b.backward),
        forward_comm=a.forward_comm + b.forward_comm,
        backward_comm=a.backward_comm + b.backward_comm,
        core_forward=_add(a.core_forward, b.core_forward),
        core_comm=a.core_comm + b.core_comm,
        expert_forward_comm=a.expert_forward_comm + b.expert_forward_comm,
        expert_backward_comm=a.expert_backward_comm + b.expert_backward_comm,
        core_expert_comm=a.core_expert_comm + b.core_expert_comm,
    )


@lru_cache(maxsize=256)
def mtp_time(spec: ModelSpec, gpu: GPU, groups: tuple[str, ...]) -> StageTime:
    """One MTP depth (ckplan.model.mtp), one micro-batch: the embedding lookup of the shifted
    tokens (`embedding_time`), enorm and hnorm (each reads and writes a stream), eh_proj (a
    column-parallel GEMM (s·b, 2h) @ (2h, h/t), its TP collectives as any column-parallel
    linear's; its output gathered over TP and scattered back, counted with them),
    final_layernorm, and the transformer block timed as a layer of the decoder's last kind."""
    projection = _mtp_projection_op(spec)
    B = spec.dtype_bytes
    path = spec_code_path(spec, gpu)
    forward_comm, backward_comm = tensor_parallel_comm(spec, path.gpu, (projection,))
    prologue = StageTime(
        forward=path.forward(projection, B),
        backward=path.backward(projection, B),
        forward_comm=forward_comm,
        backward_comm=backward_comm,
    )
    block = layer_time(spec, gpu, mtp.mtp_kind(spec), groups)
    return _plus(_plus(embedding_time(spec, gpu), prologue), block)


def _mtp_projection_op(spec: ModelSpec) -> Op:
    """An MTP depth's eh_proj with its three norms' memory-bound kernels, one op."""
    tokens, B = _tokens(spec), spec.dtype_bytes
    stream = memory.layer_input_bytes(spec)
    return Op(
        "mtp_projection",
        "mtp",
        0,
        mtp.projection_forward_flops(spec),
        mtp.projection_backward_flops(spec),
        matmul=Matmul(tokens, split_share(spec.hidden, spec.tp), 2 * spec.hidden, 1, B),
        forward_bytes=3 * 2 * stream,  # three norms, each reads and writes a stream
        backward_bytes=3 * 3 * stream,
        tp_comm="column",
    )


# ---- one micro-batch through one pipeline stage ------------------------------------------


def micro_batch_time(
    stages: tuple[StageTime, ...] | list[StageTime],
    forwards: tuple[int, ...],
    selective: bool | tuple[bool, ...],
) -> MicroBatchTime:
    """One micro-batch: stage i's forward `forwards[i]` times (the first is the forward, the
    others recompute), every backward once, and with `selective` each layer's re-forward of
    its recompute groups (`StageTime.core_forward`); a tuple says it stage by stage (`sac+mixed`:
    the stages that store the policy's tape)."""
    if len(forwards) != len(stages):
        raise ValueError(f"{len(forwards)} forward counts for a chain of {len(stages)} stages")
    flags = (selective,) * len(stages) if isinstance(selective, bool) else tuple(selective)
    forward = backward = recompute = ZERO
    forward_comm = backward_comm = recompute_comm = expert_comm = expert_forward = 0.0
    # Runs of equal stages with equal counts (a deep uniform stack is a few runs) are added once.
    for (stage, count, selective), run in groupby(zip(stages, forwards, flags, strict=True)):
        n = sum(1 for _ in run)
        forward = _add(forward, _scale(stage.forward, n))
        backward = _add(backward, _scale(stage.backward, n))
        recompute = _add(recompute, _scale(stage.forward, n * (count - 1)))
        forward_comm += n * stage.forward_comm
        backward_comm += n * stage.backward_comm
        recompute_comm += n * (count - 1) * stage.forward_comm
        expert_comm += n * (count * stage.expert_forward_comm + stage.expert_backward_comm)
        expert_forward += n * stage.expert_forward_comm
        if selective:
            recompute = _add(recompute, _scale(stage.core_forward, n))
            recompute_comm += n * stage.core_comm
            expert_comm += n * stage.core_expert_comm
    return MicroBatchTime(
        forward,
        backward,
        recompute,
        forward_comm,
        backward_comm,
        recompute_comm,
        expert_comm,
        expert_forward,
    )


# Below this many chain stages `micro_batch_time`'s loop is as fast as the arrays.
TABLE_MIN_STAGES = 48


@lru_cache(maxsize=256)
def _chain_stage_table(spec: ModelSpec, gpu: GPU, stage: int, groups: tuple[str, ...]):
    from ckplan.hardware.stage_table import StageTable  # NumPy, for long chains only

    return StageTable(chain_stage_times(spec, gpu, stage, groups))


@lru_cache(maxsize=8192)
def _stage_micro_batch(
    spec: ModelSpec,
    gpu: GPU,
    stage: int,
    forwards: tuple[int, ...],
    groups: tuple[str, ...],
    mask: tuple[bool, ...] | None = None,
) -> MicroBatchTime:
    chain_groups = groups or (ATTENTION_CORE,)
    if mask is not None:
        return micro_batch_time(chain_stage_times(spec, gpu, stage, chain_groups), forwards, mask)
    return _activation_micro_batch(spec.chain, gpu, stage, forwards, chain_groups, bool(groups))


@lru_cache(maxsize=8192)
def _activation_micro_batch(
    spec: ModelSpec,
    gpu: GPU,
    stage: int,
    forwards: tuple[int, ...],
    chain_groups: tuple[str, ...],
    selective: bool,
) -> MicroBatchTime:
    """`_stage_micro_batch` on the parts one GPU's chain depends on (`spec.chain`): a
    micro-batch's stage times depend on neither dp, ZeRO nor the micro-batch count, so the
    layouts that differ only there share it."""
    if len(forwards) >= TABLE_MIN_STAGES:
        from ckplan.hardware.stage_table import table_micro_batch_time

        table = _chain_stage_table(spec, gpu, stage, chain_groups)
        return table_micro_batch_time(table, forwards, selective)
    stages = chain_stage_times(spec, gpu, stage, chain_groups)
    return micro_batch_time(stages, forwards, selective)


# ---- the iteration -----------------------------------------------------------------------


@lru_cache(maxsize=256)
def pipeline_p2p_seconds(spec: ModelSpec, gpu: GPU) -> float:
    """Pipeline sends of one micro-batch on one stage: its activation forward and its gradient
    backward, once per virtual stage (Narayanan et al. 2021 §2.2, §4.1: with the scatter/gather
    optimisation each rank sends its 1/t share, as it holds under SP). Counted exposed."""
    if spec.pp == 1:
        return 0.0
    stream = memory.layer_input_bytes(spec)
    size = stream if spec.sp else split_share(stream, spec.tp)
    bandwidth = comm.group_bandwidth(gpu, 2, spec.tp * spec.cp * spec.dp)
    return 2 * spec.virtual_stages * comm.p2p_seconds(size, bandwidth)


@dataclass(frozen=True)
class DataParallelComm:
    """The data-parallel collectives of one iteration, before overlap, in seconds: once per
    iteration (the gradients' reduction after the last micro-batch, the updated weights'
    gather) and per micro-batch (the weights gathered for its forward, for its backward, and
    the gradients reduced beside it where the framework does: `frameworks.gradient_sync`)."""

    reduce: float = 0.0
    gather: float = 0.0
    forward: float = 0.0  # per micro-batch
    backward: float = 0.0  # per micro-batch

    def __add__(self, other: DataParallelComm) -> DataParallelComm:
        return DataParallelComm(
            self.reduce + other.reduce,
            self.gather + other.gather,
            self.forward + other.forward,
            self.backward + other.backward,
        )

    def total(self, microbatches: int) -> float:
        return self.reduce + self.gather + microbatches * (self.forward + self.backward)


def gradient_reduction(
    spec: ModelSpec,
    zero: int,
    pp: int,
    params: int,
    ranks: int,
    bandwidth: float,
    regathered: int = 0,
    float8: int = 0,
    float8_cast_seconds: float = 0.0,
    fp8_params: int = 0,
    frozen_bytes: int = 0,
) -> DataParallelComm:
    """One group's share of the data-parallel communication at ZeRO `zero` and pipeline size
    `pp` (a layout's; spec gives the framework and bytes): ZeRO 0 a ring all-reduce of the
    gradients (grad_bytes per parameter); ZeRO 1-3 a reduce-scatter of the gradients and an
    all-gather of the weights (weight_bytes): ZeRO 1-2's updated weights once per step (Megatron's
    distributed optimizer), ZeRO 3's (Rajbhandari et al. 2020 §5.3) for every micro-batch's
    forward and again for its backward. The gradients are reduced once per step or every
    micro-batch, beside its backward, and the weights gathered per micro-batch as the framework
    runs gradient accumulation (`frameworks.gradient_sync`), in the bytes it reduces them in
    (`frameworks.spec_reduce_bytes`). `regathered`: the elements a ZeRO-3 backward
    gathers beyond `params` once per micro-batch, the weights of the layers it re-runs forward
    (`regathered_elements`). `float8`: the weights among `params` that torchao's float8
    all-gather gathers in 1 byte each (`frameworks.fsdp2_gathered_bytes`), whose shards are
    cast first, `float8_cast_seconds` before each gather (`float8_shard_cast_bytes`, on the
    all-gather's copy-in stream, counted with it). `fp8_params`: of `params`, the FP8 primary
    weights, which the distributed optimizer's once-per-step gather moves in one byte each
    (Megatron-LM --fp8-param-gather: "perform the param all-gather in fp8"; its parameter
    buffer is uint8, `frameworks.fp8_primary_weight_bytes`). `frozen_bytes`: the frozen base
    weights' bytes the forward's and the backward's gathers move beside `params`' (ZeRO 3 with
    frozen base weights, `memory.frozen_gathered_bytes`); nothing else of theirs moves, as they
    have no gradient and no update."""
    if ranks == 1 or (params == 0 and frozen_bytes == 0):
        return DataParallelComm()
    sync = frameworks.gradient_sync(spec.framework, zero, pp, spec.grad_sync)
    reduce_bytes = frameworks.spec_reduce_bytes(spec, zero)
    # FSDP gathers the weights in the compute dtype (MixedPrecisionPolicy.param_dtype), whatever
    # the sharded copy's (fp32 under torchtitan and Hugging Face's AMP)
    gather_bytes = min(spec.weight_bytes, spec.dtype_bytes)
    fp8_bytes = frameworks.fp8_primary_weight_bytes(True, spec.weight_bytes)
    grads = params * reduce_bytes
    weights = (params - fp8_params) * gather_bytes + fp8_params * fp8_bytes
    weights -= (gather_bytes - frameworks.FLOAT8) * float8
    if grads == 0:  # frozen base weights and no adapter: only their gathers
        reduce = gather = 0.0
    elif zero == 0:
        reduce = comm.all_reduce_seconds(grads, ranks, bandwidth)
        gather = 0.0
    else:
        reduce = comm.reduce_scatter_seconds(grads, ranks, bandwidth)
        gather = comm.all_gather_seconds(weights, ranks, bandwidth) + float8_cast_seconds
    forward = 0.0
    if sync.gather_forward:
        forward = gather
        if frozen_bytes:
            passed = weights + frozen_bytes
            forward = comm.all_gather_seconds(passed, ranks, bandwidth) + float8_cast_seconds
    backward = 0.0
    if sync.gather_backward:
        again = weights + frozen_bytes + regathered * gather_bytes
        backward = comm.all_gather_seconds(again, ranks, bandwidth) + float8_cast_seconds
    once_gather = 0.0 if sync.gather_forward or sync.gather_backward else gather
    if sync.each_micro_batch:
        return DataParallelComm(gather=once_gather, forward=forward, backward=backward + reduce)
    return DataParallelComm(reduce=reduce, gather=once_gather, forward=forward, backward=backward)


def regathered_elements(spec: ModelSpec, stage: int, forwards: tuple[int, ...]) -> int:
    """The weights DeepSpeed ZeRO-3 gathers per micro-batch beyond one forward's and one
    backward's gather, on pipeline stage `stage` whose chain runs `forwards` forwards per
    chain stage: each re-run forward of a layer gathers its weights again (its sub-modules'
    forward pre-hooks fetch them as in the first), and the backward after the last re-run
    gathers only the sub-modules released in between (`frameworks.deepspeed_zero3_regathered`)
    instead of the whole layer. A layer re-run c - 1 times adds (c - 2) layers and the
    re-gathered part. 0 for other frameworks and ZeRO stages, and for layers whose
    sub-modules ckplan does not lay out (`memory.layer_module_parameters`: MoE, MLA).

    derived: each re-run forward taken just before the layer's backward, as per-layer
    activation checkpointing runs it."""
    if spec.framework != "deepspeed" or spec.zero != 3 or spec.dp * spec.cp == 1:
        return 0
    kinds = stage_kinds(spec, stage)
    first = 1 if stage == 0 and spec.kind == "transformer" and spec.vocab > 0 else 0
    extra = 0
    for kind, count in zip(kinds, forwards[first : first + len(kinds)], strict=False):
        modules = memory.layer_module_parameters(spec, kind)
        if count < 2 or modules is None:
            continue
        extra += (count - 2) * sum(modules) + frameworks.deepspeed_zero3_regathered(modules)
    return extra


def zero3_gathers_frozen(spec: ModelSpec, zero: int | None = None) -> bool:
    """Whether the frozen base weights are sharded and so gathered for every pass: training
    other than full at the framework's weight-sharding stage (`frameworks.weights_sharded_from`;
    `zero` a layout's, default the spec's)."""
    zero = spec.zero if zero is None else zero
    return spec.training != "full" and zero >= frameworks.weights_sharded_from(spec)


@lru_cache(maxsize=256)
def data_parallel_comm(spec: ModelSpec, gpu: GPU, regathered: int = 0) -> DataParallelComm:
    """Data-parallel communication of one iteration, before overlap, on the busiest stage's
    GPU: its dense parameters' gradients reduced over the dp·cp ranks that hold the same
    parameters (Megatron-LM reduces over both), and its routed experts' over their
    expert-data-parallel group, tp·cp·dp/(ep·etp) ranks ep·etp apart (Megatron's
    expert_data_parallel group, `ModelSpec.expert_data_parallel`), one after the other
    (`gradient_reduction` for each); only the trainable parameters' gradients
    (`memory.trainable_stage_parameters`). `regathered`: the dense weights ZeRO-3 gathers
    again for re-run forwards (`regathered_elements`)."""
    stage = memory.busiest_stage(spec)
    dense, experts = memory.trainable_stage_parameters(spec, stage)
    fp8_dense, fp8_experts = memory.fp8_primary_weights(spec, stage)
    ranks = spec.dp * spec.cp
    bandwidth = comm.group_bandwidth(gpu, ranks, spec.tp)
    float8 = memory.float8_gathered_stage_weights(spec, stage)
    cast = (
        memory_seconds(gpu, float8_shard_cast_bytes(split_share(float8, ranks))) if float8 else 0.0
    )
    frozen = memory.frozen_gathered_bytes(spec, stage) if zero3_gathers_frozen(spec) else 0
    parts = gradient_reduction(
        spec, spec.zero, spec.pp, dense, ranks, bandwidth, regathered, float8, cast, fp8_dense,
        frozen,
    )  # fmt: skip
    if experts:
        expert_ranks, stride = spec.expert_data_parallel, spec.ep * spec.etp
        parts += gradient_reduction(
            spec,
            spec.zero,
            spec.pp,
            experts,
            expert_ranks,
            comm.group_bandwidth(gpu, expert_ranks, stride),
            fp8_params=fp8_experts,
        )
    return parts


def _layer_uses(
    modules: tuple[int, ...], seconds: OpTime, gathers: tuple[float, ...], order: range
) -> list[tuple[OpTime, float]]:
    """A pass over one layer's sub-modules in `order`: each one's share of the pass's
    `seconds`, by its weights (derived: a linear's GEMM FLOPs are 2·tokens·weights; the ops
    without weights counted with them pro rata), and the gather it waits for."""
    total = sum(modules)
    return [(_scale(seconds, modules[i] / total), gathers[i]) for i in order]


def _zero3_gather_seconds(
    spec: ModelSpec, gpu: GPU, elements: int, ranks: int, bandwidth: float
) -> float:
    """One ZeRO-3 weight gather: the all-gather, and under DeepSpeed's path of 2021 the copies
    on the communication streams that the next fetch's synchronisation waits for
    (`frameworks.deepspeed_zero3_gather_copy_bytes`, at HBM rate: `roofline.memory_seconds`)."""
    weight_bytes = min(spec.weight_bytes, spec.dtype_bytes)
    seconds = comm.all_gather_seconds(elements * weight_bytes, ranks, bandwidth)
    if frameworks.deepspeed_list_collectives(spec):
        copies = frameworks.deepspeed_zero3_gather_copy_bytes(elements, ranks, weight_bytes)
        seconds += memory_seconds(gpu, copies.stream)
    return seconds


def deepspeed_2021_reduce_seconds(
    spec: ModelSpec, gpu: GPU, modules: tuple[int, ...], ranks: int, bandwidth: float
) -> tuple[float, ...]:
    """Under DeepSpeed's path of 2021 (`frameworks.deepspeed_list_collectives`), the seconds of
    the bucket reductions each of a layer's sub-modules issues from its gradient's hook in the
    backward (sub-modules last to first): the reduce-scatters of the gradients the hook sends
    (`frameworks.deepspeed_zero3_reduce_triggers`, in the dtype
    `frameworks.reduce_bytes_per_parameter` gives) and their copies on the reduction and NCCL
    streams (`frameworks.deepspeed_zero3_reduce_call_bytes`, at HBM rate). All zeros on other
    paths, whose reduce-scatters hide behind the whole backward (`data_parallel_exposed`).

    derived: the bucket rule run over three layers' gradients, the middle layer's hooks taken
    as every layer's; a module's weight and bias one gradient, as
    `memory.layer_module_parameters` lays them out."""
    n = len(modules)
    if not frameworks.deepspeed_list_collectives(spec):
        return (0.0,) * n
    reduce_bytes = frameworks.spec_reduce_bytes(spec)
    triggered, _ = frameworks.deepspeed_zero3_reduce_triggers(tuple(reversed(modules)) * 3)
    seconds = []
    for call in triggered[n : 2 * n]:
        if not call:
            seconds.append(0.0)
            continue
        copies = frameworks.deepspeed_zero3_reduce_call_bytes(call, ranks, reduce_bytes)
        rs = comm.reduce_scatter_seconds(sum(call) * reduce_bytes, ranks, bandwidth)
        seconds.append(rs + memory_seconds(gpu, copies.stream))
    return tuple(seconds)


@dataclass(frozen=True)
class Zero3Copies:
    """The HBM copies of DeepSpeed ZeRO-3's path of 2021 around one micro-batch's collectives,
    in seconds: `serial` where nothing else runs or on the compute stream (the gather buffers'
    zero fill before each sub-module's compute, the gradients' copies into the reduction
    bucket), `forward` and `backward` on the communication streams, in the collectives' time."""

    serial: float = 0.0
    forward: float = 0.0
    backward: float = 0.0


def deepspeed_2021_copies(
    spec: ModelSpec, gpu: GPU, forwards: tuple[int, ...]
) -> Zero3Copies | None:
    """`Zero3Copies` of one micro-batch on the first stage under `framework_version` 0.5.4
    (`frameworks.deepspeed_list_collectives`), else None. The gathered weights are each
    layer's sub-modules above stage3_param_persistence_threshold
    (`memory.layer_module_parameters`), once for the forward and, for the backward, once per
    re-run forward plus those released before the backward (`frameworks.deepspeed_zero3_released`),
    or once where the layer is not re-run; the rest of the stage's weights (embedding, final
    norm, output layer) as one tensor, once each way. The gradients reach the reduction bucket
    in the backward's order: the rest first, then the layers' sub-modules last to first.

    derived: `frameworks.deepspeed_zero3_gather_copy_bytes` per gather and
    `frameworks.deepspeed_zero3_reduce_copy_bytes` over the backward, at HBM rate
    (`roofline.memory_seconds`); a module's weight and bias counted as one tensor, as
    `memory.layer_module_parameters` lays them out."""
    if not frameworks.deepspeed_list_collectives(spec) or spec.zero != 3 or spec.dp * spec.cp == 1:
        return None
    ranks = spec.dp * spec.cp
    weight_bytes = min(spec.weight_bytes, spec.dtype_bytes)
    reduce_bytes = frameworks.spec_reduce_bytes(spec)
    kinds = stage_kinds(spec, 0)
    first = 1 if spec.kind == "transformer" and spec.vocab > 0 else 0
    counts = list(forwards[first : first + len(kinds)]) or [1] * len(kinds)
    counts += [1] * (len(kinds) - len(counts))
    dense, _ = memory.trainable_stage_parameters(spec, 0)
    forward_gathers: list[int] = []
    backward_gathers: list[int] = []
    gradients: list[int] = []
    layered = 0
    for kind, count in zip(kinds, counts, strict=True):
        modules = memory.layer_module_parameters(spec, kind)
        if modules is None:
            return None
        layered += sum(modules)
        gradients.extend(reversed(modules))
        kept = [w for w in modules if w > frameworks.DEEPSPEED_PERSISTENCE]
        forward_gathers.extend(kept)
        if count < 2:
            backward_gathers.extend(kept)
            continue
        released = frameworks.deepspeed_zero3_released(modules)
        backward_gathers.extend(kept * (count - 1))
        backward_gathers.extend(
            w
            for w, again in zip(modules, released, strict=True)
            if again and w > frameworks.DEEPSPEED_PERSISTENCE
        )
    rest = max(0, dense - layered)
    if rest:
        gradients.insert(0, rest)
        if rest > frameworks.DEEPSPEED_PERSISTENCE:
            forward_gathers.append(rest)
            backward_gathers.append(rest)

    def gathers(weights: list[int]) -> tuple[int, int]:
        copies = [
            frameworks.deepspeed_zero3_gather_copy_bytes(w, ranks, weight_bytes) for w in weights
        ]
        return sum(c.serial for c in copies), sum(c.stream for c in copies)

    forward_serial, forward_stream = gathers(forward_gathers)
    backward_serial, backward_stream = gathers(backward_gathers)
    reduce = frameworks.deepspeed_zero3_reduce_copy_bytes(tuple(gradients), ranks, reduce_bytes)
    return Zero3Copies(
        serial=memory_seconds(gpu, forward_serial + backward_serial + reduce.serial),
        forward=memory_seconds(gpu, forward_stream),
        backward=memory_seconds(gpu, backward_stream + reduce.stream),
    )


@lru_cache(maxsize=256)
def deepspeed_zero3_layer_exposed(
    spec: ModelSpec, gpu: GPU, forwards: tuple[int, ...]
) -> tuple[float, float] | None:
    """DeepSpeed ZeRO-3's weight gathers of the layers of one micro-batch, each beside the
    compute its prefetch leaves it (`frameworks.deepspeed_zero3_prefetch_windows`: one weight
    ahead when every gathered weight holds more than stage3_prefetch_bucket_size elements):
    (forward exposed, backward exposed) in seconds, the
    backward with the re-run forwards (`forwards`, as `regathered_elements` reads them). A
    gather beside compute adds what it does not hide and the slowdown of the GEMMs whose SMs
    NCCL holds (`comm.overlapped`). None where the rule does not hold (a weight within the
    bucket, which prefetches deeper; a layer ckplan does not lay out by sub-module; a layer
    run more than twice; pipeline stages), left to `data_parallel_exposed`'s whole-pass
    overlap. Weights of at most stage3_param_persistence_threshold elements stay gathered
    (`frameworks.deepspeed_persistent_bytes`). Only for DeepSpeed's zero 3 with
    dp_comm_overlap (its overlap_comm)."""
    if (
        spec.framework != "deepspeed"
        or spec.zero != 3
        or not spec.dp_comm_overlap
        or spec.pp != 1
        or spec.dp * spec.cp == 1
    ):
        return None
    kinds = stage_kinds(spec, 0)
    first = 1 if spec.kind == "transformer" and spec.vocab > 0 else 0
    counts = forwards[first : first + len(kinds)]
    if len(counts) != len(kinds) or any(count > 2 for count in counts):
        return None
    ranks = spec.dp * spec.cp
    bandwidth = comm.group_bandwidth(gpu, ranks, spec.tp)
    slowdown = gpu.sm_count / (gpu.sm_count - gpu.nccl_channels)
    totals = [0.0, 0.0]
    for (kind, count), run in groupby(zip(kinds, counts, strict=True)):
        layers = sum(1 for _ in run)
        modules = memory.layer_module_parameters(spec, kind)
        if modules is None:
            return None
        gathered = [w > frameworks.DEEPSPEED_PERSISTENCE for w in modules]
        if any(
            frameworks.DEEPSPEED_PERSISTENCE < w < frameworks.DEEPSPEED_PREFETCH_BUCKET
            for w in modules
        ):
            return None
        gathers = tuple(
            _zero3_gather_seconds(spec, gpu, w, ranks, bandwidth) if g else 0.0
            for g, w in zip(gathered, modules, strict=True)
        )
        layer = layer_time(spec, gpu, kind)
        forward = _add(layer.forward, OpTime(0.0, layer.forward_comm))
        backward = _add(layer.backward, OpTime(0.0, layer.backward_comm))
        n = len(modules)
        passes = [_layer_uses(modules, forward, gathers, range(n))]
        reduces = deepspeed_2021_reduce_seconds(spec, gpu, modules, ranks, bandwidth)
        issued: list[tuple[float, ...]] = [(0.0,) * n]
        if count == 2:
            # the re-run forward gathers every weight; the backward those released in between
            released = frameworks.deepspeed_zero3_released(modules)
            again = tuple(g if r else 0.0 for g, r in zip(gathers, released, strict=True))
            passes.append(
                _layer_uses(modules, forward, gathers, range(n))
                + _layer_uses(modules, backward, again, range(n - 1, -1, -1))
            )
            issued.append((0.0,) * n + reduces)
        else:
            passes.append(_layer_uses(modules, backward, gathers, range(n - 1, -1, -1)))
            issued.append(reduces)
        for phase, uses in enumerate(passes):
            windows = frameworks.deepspeed_zero3_prefetch_windows(
                tuple((time.total, gather) for time, gather in uses), issued[phase]
            )
            # the window's GEMMs slowed by the SMs NCCL holds (`data_parallel_exposed`)
            matmul_share = forward.matmul / forward.total if forward.total else 0.0
            exposed = 0.0
            for gather, window in windows:
                contended = window * (matmul_share * slowdown + 1 - matmul_share)
                exposed += comm.overlapped(gather, window, contended)
            totals[phase] += layers * exposed
    return totals[0], totals[1]


def data_parallel_seconds(spec: ModelSpec, gpu: GPU) -> float:
    """All the data-parallel communication of one iteration, before overlap."""
    return data_parallel_comm(spec, gpu).total(spec.microbatches)


def data_parallel_exposed(
    spec: ModelSpec,
    gpu: GPU,
    busiest: MicroBatchTime,
    regathered: int = 0,
    forwards: tuple[int, ...] = (),
) -> float:
    """What the data-parallel communication adds to the step.

    Without `dp_comm_overlap`, all of it but the GPU file's dp_overlap share. With it, each
    collective runs beside the compute it can hide behind, as Megatron-LM
    (--overlap-grad-reduce, --overlap-param-gather), DDP's buckets, DeepSpeed's overlap_comm and
    FSDP's prefetch run it: the gradients' reduction beside the backward of the last
    micro-batch, the weights' gather beside the next forward (each of these two hidden or not
    by its own key, `overlap_grad_reduce` and `overlap_param_gather`, as Megatron-Core's
    DistributedDataParallelConfig sets them apart; by default both as dp_comm_overlap), the
    per-micro-batch gathers and
    reductions (ZeRO 3; ZeRO 2 where the framework reduce-scatters every micro-batch) beside
    that micro-batch's forward and backward. Each adds what it does
    not hide and the slowdown of the GEMMs whose SMs its NCCL blocks hold
    (`comm.overlapped`), and never less than one layer's chunk, which waits for the last
    layer's compute (NeMo's communication-overlap docs: "exposes only one DP communication
    chunk"). `regathered`: as `data_parallel_comm` takes it. Under DeepSpeed's ZeRO-3 the
    layers' weight gathers instead hide sub-module by sub-module behind what the prefetch
    leaves them (`deepspeed_zero3_layer_exposed`, from the chain's `forwards`), and the rest
    (the gradients' reduce-scatter, the embedding's and output layer's gathers) as above."""
    parts = data_parallel_comm(spec, gpu, regathered)
    # DeepSpeed's path of 2021: its copies lengthen the collectives, its zero fills and
    # bucket copies run alone or on the compute stream (`deepspeed_2021_copies`)
    copies = deepspeed_2021_copies(spec, gpu, forwards) or Zero3Copies()
    serial = 1 - gpu.dp_overlap  # the share of a collective no overlap hides
    chunks = max(1, spec.layers_per_stage // spec.virtual_stages)
    slowdown = gpu.sm_count / (gpu.sm_count - gpu.nccl_channels)

    def hidden(seconds: float, behind: OpTime) -> float:
        if seconds == 0:
            return 0.0
        contended = behind.matmul * slowdown + behind.memory
        return max(seconds / chunks, comm.overlapped(seconds, behind.total, contended))

    backward = _add(busiest.backward, busiest.recompute)
    once = (
        hidden(parts.reduce, backward) if spec.overlap_grad_reduce else serial * parts.reduce
    ) + (
        hidden(parts.gather, busiest.forward)
        if spec.overlap_param_gather
        else serial * parts.gather
    )
    if not spec.dp_comm_overlap:
        added = copies.serial + copies.forward + copies.backward
        each = serial * (parts.forward + parts.backward) + added
        return once + spec.microbatches * each
    forward_comm, backward_comm = parts.forward + copies.forward, parts.backward + copies.backward
    layered = deepspeed_zero3_layer_exposed(spec, gpu, forwards) if forwards else None
    if layered is None:
        each = hidden(forward_comm, busiest.forward) + hidden(backward_comm, backward)
        return once + spec.microbatches * (each + copies.serial)
    # one link carries the gathers, the embedding's and the gradients' reduce-scatter: a pass
    # takes at least its bytes' time (derived), beyond what the prefetch leaves exposed
    forward_exposed, backward_exposed = layered
    each = max(forward_exposed, forward_comm - busiest.forward.total)
    each += max(backward_exposed, backward_comm - backward.total)
    return once + spec.microbatches * (each + copies.serial)


@lru_cache(maxsize=256)
def optimizer_seconds(spec: ModelSpec, gpu: GPU) -> float:
    """The optimizer's step, memory-bound: per parameter it reads the gradient, master weight and
    its states and writes the master weight, states and half-precision weight (Megatron-LM's
    mixed-precision Adam; `optimizers.step_bytes_per_parameter` for the others), over the
    parameters whose optimizer state this GPU holds: from ZeRO 1
    its dense parameters' share over dp·cp and its routed experts' share over their
    expert-data-parallel group (as `memory.model_state_bytes` shards them); only the trainable
    ones when the base weights are frozen (`memory.trainable_stage_parameters`). With
    optimizer_offload the host's CPU steps instead (`host_states.cpu_adam_seconds`). With FP8
    primary weights (`fp8_param_gather`) the shard's FP8 weights are cast from their master
    weights instead of written in BF16 (`frameworks.fp8_master_cast_bytes`), and their amaxes
    all-reduced (`fp8_amax_reduction_seconds`)."""
    if spec.optimizer_offload != "none":
        traffic = host_states.state_traffic(spec)
        return host_states.cpu_adam_seconds(traffic, gpu, host_states.gpus_stepping(spec, gpu))
    stage = memory.busiest_stage(spec)
    fp8_dense, fp8_experts = memory.fp8_primary_weights(spec, stage)
    if spec.zero >= 1:
        fp8_dense = split_share(fp8_dense, spec.dp * spec.cp)
        fp8_experts = split_share(fp8_experts, spec.expert_data_parallel) if fp8_experts else 0
    step = memory.stepped_parameters(spec, stage) * optimizer_step_bytes_per_parameter(spec)
    cast = fp8_master_cast_extra_bytes(spec, fp8_dense + fp8_experts)
    # torchao's precomputed float8 scales, after the step (`float8_precompute_amax_bytes`)
    float8 = memory.float8_gathered_stage_weights(spec, stage)
    amax = float8_precompute_amax_bytes(split_share(float8, spec.dp * spec.cp))
    return memory_seconds(gpu, step + cast + amax) + fp8_amax_reduction_seconds(spec, gpu)


def optimizer_step_bytes_per_parameter(spec: ModelSpec) -> int:
    """Bytes the optimizer step moves per parameter it steps: foreach AdamW's kernel by kernel
    (`optimizers.foreach_adamw_step_bytes_per_parameter`) under `optimizer_implementation`
    foreach, else one pass (`optimizers.step_bytes_per_parameter`)."""
    args = (spec.grad_bytes, spec.master_bytes, spec.weight_bytes, spec.optimizer_bytes)
    if frameworks.optimizer_implementation(spec) == "foreach":
        return optimizers.foreach_adamw_step_bytes_per_parameter(*args)
    return optimizers.step_bytes_per_parameter(spec.optimizer, *args)


def fp8_master_cast_extra_bytes(spec: ModelSpec, fp8_shard: int) -> int:
    """What casting `fp8_shard` master weights to FP8 moves beyond the BF16 write the step
    counts for them (`frameworks.fp8_master_cast_bytes` less `weight_bytes`); 0 without FP8
    primary weights."""
    if not spec.fp8_param_gather:
        return 0
    return fp8_shard * (frameworks.fp8_master_cast_bytes(spec.fp8_recipe) - spec.weight_bytes)


def fp8_amax_reduction_seconds(spec: ModelSpec, gpu: GPU) -> float:
    """The all-reduces (max) of the FP8 primary weights' amaxes after the master weights' cast,
    one fp32 per FP8 weight tensor of the GPU (per 128x128 block under block scaling,
    `memory.fp8_weight_amaxes`) packed into one all-reduce over each
    distributed optimizer's data-parallel group (Transformer Engine v2.9 tensor/utils.py,
    `packed_amaxes`, `torch.distributed.all_reduce(..., group=group)`, under delayed and
    current scaling, `_cast_master_weights_to_fp8_blockwise_scaling` under block scaling;
    Megatron-Core core_v0.14.0 builds one distributed optimizer over the
    dense parameters' dp·cp ranks and one over the experts' expert-data-parallel group):
    bytes and ring latency (`comm.all_reduce_latency`), exposed, before the weights' gather.
    0 without `fp8_param_gather`."""
    if not spec.fp8_param_gather:
        return 0.0
    dense, experts = memory.fp8_weight_amaxes(spec, memory.busiest_stage(spec))
    groups = (
        (dense, spec.dp * spec.cp, spec.tp),
        (experts, spec.expert_data_parallel, spec.ep * spec.etp),
    )
    return sum(amax_all_reduce_seconds(gpu, *group) for group in groups)


def amax_all_reduce_seconds(gpu: GPU, tensors: int, ranks: int, stride: int) -> float:
    """One packed all-reduce of `tensors` fp32 amaxes (weight tensors, or blocks) over `ranks`
    GPUs `stride` apart: its bytes and ring latency; 0 for no tensors or one rank."""
    if not tensors or ranks <= 1:
        return 0.0
    size = tensors * frameworks.FP8_AMAX_BYTES
    bandwidth = comm.group_bandwidth(gpu, ranks, stride)
    return comm.all_reduce_seconds(size, ranks, bandwidth) + comm.all_reduce_latency(gpu, ranks)


def carries_weight_gradient(op: Op) -> bool:
    """Whether the op's backward computes a weight gradient: a GEMM with a weight operand (a
    linear, an expert's grouped GEMM, the router) whose weight trains (its backward has both
    products, `roofline.op_backward_time`). The attention core's products (fused, or the
    standard scores and values GEMMs, group attention_core) multiply activations only."""
    return (
        op.matmul is not None
        and not op.fused_kernel
        and op.group != ATTENTION_CORE
        and op.backward_flops >= 2 * op.forward_flops
    )


def _weight_gradient_seconds(spec: ModelSpec, gpu: GPU, ops) -> float:
    """The weight-gradient GEMMs' seconds of `ops`' backward: half of each weighted GEMM's
    two backward products (derived: dW = Xᵀ·dY and dX = dY·Wᵀ have the forward's FLOPs each,
    `roofline.backward_matmuls`), timed on the run's code path; the re-run forwards some ops
    add to their backward (`op_backward_time`) are not the weight's."""
    path = spec_code_path(spec, gpu)
    seconds = 0.0
    for op in ops:
        if carries_weight_gradient(op):
            plain = dataclasses.replace(
                op, backward_flops=2 * op.forward_flops, forward_bytes=0, backward_bytes=0
            )
            seconds += path.backward(plain, spec.dtype_bytes).matmul / 2
    return seconds


@lru_cache(maxsize=256)
def stage_weight_gradient_seconds(spec: ModelSpec, gpu: GPU, stage: int) -> float:
    """W of one micro-batch through model stage `stage` (DeepSeek-V3 Technical Report, arXiv
    2412.19437, Table 2: 'the execution time of a "backward for weights" chunk'): the weight
    gradients of its layers, and on the last stage of the MTP depths' blocks and projections
    and of the output layer. The embedding's gradient (a scatter-add of rows) is no GEMM and
    counts with the input gradients' part."""
    weighted = [op for kind in stage_kinds(spec, stage) for op in model_layer_ops(spec, kind)]
    if spec.kind == "transformer" and spec.vocab > 0 and stage == spec.pp - 1:
        depth = [*model_layer_ops(spec, mtp.mtp_kind(spec)), _mtp_projection_op(spec)]
        weighted += depth * spec.mtp_layers
        weighted.append(_output_op(spec))
    return _weight_gradient_seconds(spec, gpu, weighted)


def dualpipe_bubble_seconds(pp: int, overlapped: float, backward: float, weight: float) -> float:
    """DualPipe's bubble, DeepSeek-V3 Technical Report (arXiv 2412.19437) Table 2:
    (PP/2 - 1)(F&B + B - 3W), against 1F1B's (PP - 1)(F + B) and ZB1P's (PP - 1)(F + B - 2W);
    `overlapped` F&B, the time of a forward chunk and a backward chunk run overlapped,
    `backward` B, a full backward chunk, `weight` W, its weight-gradient part."""
    return (pp // 2 - 1) * (overlapped + backward - 3 * weight)


def bubble_steps(spec: ModelSpec, stage: int) -> float:
    """The pipeline bubble in micro-batches of stage `stage`: (p - 1)/v (Narayanan et al. 2021
    §2.2: p - 1 steps of one chunk, 1/v of a micro-batch). Under a pipeline_layout each step
    is the stage's largest chunk's share of its layers (derived: each step of the fill and the
    drain waits for a whole chunk, the largest the longest); an even layout gives (p - 1)/v."""
    chunks = stage_chunk_layers(spec, stage)
    if spec.parsed_layout is None or not sum(chunks):
        return (spec.pp - 1) / spec.virtual_stages
    return (spec.pp - 1) * max(chunks) / sum(chunks)


def _pipeline(
    spec: ModelSpec, gpu: GPU, busiest: MicroBatchTime, stage: int = 0
) -> tuple[float, float, float]:
    """(compute and stage communication, bubble, p2p) seconds of the iteration under 1F1B,
    `busiest` the micro-batch time of pipeline stage `stage`."""
    p2p = pipeline_p2p_seconds(spec, gpu)
    per_micro_batch = busiest.total + p2p
    bubble = bubble_steps(spec, stage) * per_micro_batch
    return spec.microbatches * per_micro_batch, bubble, spec.microbatches * p2p


def dualpipe_chunks(busiest: MicroBatchTime, p2p: float) -> tuple[Chunk, Chunk]:
    """A micro-batch's forward and backward chunk (`dualpipe.Chunk`): the forward's compute,
    its first forward's expert-parallel collectives and half the pipeline sends (its
    activation) hideable; the backward's compute with the re-forwards', the rest of the
    expert-parallel collectives and the other half (its input gradient) hideable. The other
    collectives of each (tensor and context parallel, MLA's) stay exposed."""
    forward = Chunk(
        busiest.forward.total,
        busiest.expert_forward_comm,
        p2p / 2,
        busiest.forward_comm - busiest.expert_forward_comm,
    )
    backward_expert = busiest.expert_comm - busiest.expert_forward_comm
    backward = Chunk(
        busiest.backward.total + busiest.recompute.total,
        backward_expert,
        p2p / 2,
        busiest.backward_comm + busiest.recompute_comm - backward_expert,
    )
    return forward, backward


@dataclass(frozen=True)
class DualPipeRank:
    """A DualPipe rank's iteration, seconds: `compute` its chunks (the paired ones overlapped),
    `bubble` Table 2's, `p2p` its pipeline sends before overlap, `hidden` the communication
    its pairs hide (`expert` of it expert-parallel), `mean` its mean micro-batch."""

    compute: float
    bubble: float
    p2p: float
    hidden: float
    expert: float
    mean: MicroBatchTime

    @property
    def total(self) -> float:
        return self.compute + self.bubble


def dualpipe_rank_time(
    spec: ModelSpec,
    gpu: GPU,
    rank: int,
    own: MicroBatchTime,
    mirror: MicroBatchTime,
    weight: float,
) -> DualPipeRank:
    """One iteration of DualPipe rank `rank`, its own stage's micro-batch time `own` and its
    mirror's `mirror`, `weight` its W (`_rank_weight_seconds`). Its `paired_chunks` run as
    F&B pairs (`forward_backward_seconds`), half a forward of its own stage beside a backward
    of its mirror's and half the other way round (deepseek-ai/DualPipe at 3da1bbe,
    `DualPipe.step` step 4: `_forward_backward_chunk(0, 1)` then `(1, 0)`; taken half and
    half); the others alone, communication exposed. Bubble: DeepSeek-V3 report Table 2,
    (PP/2 - 1)(F&B + B - 3W), F&B the mean pair, B a backward chunk alone."""
    p2p = pipeline_p2p_seconds(spec, gpu)
    m = spec.microbatches
    mean = _mean_micro_batch(own, mirror)
    sms = gpu.sm_count
    own_f, own_b = dualpipe_chunks(own, p2p)
    mirror_f, mirror_b = dualpipe_chunks(mirror, p2p)
    pairs = ((own_f, mirror_b), (mirror_f, own_b))
    overlapped = sum(forward_backward_seconds(f, b, sms) for f, b in pairs) / 2
    saved = [hidden_in_pair(f, b, sms, COMMUNICATION_SMS) for f, b in pairs]
    hidden = sum(s[0] for s in saved) / 2
    expert = sum(s[1] for s in saved) / 2
    count = paired_chunks(spec.pp, m, rank)
    alone = mean.total + p2p
    backward = dualpipe_chunks(mean, p2p)[1].alone
    return DualPipeRank(
        compute=m * alone - count * hidden,
        bubble=dualpipe_bubble_seconds(spec.pp, overlapped, backward, weight),
        p2p=m * p2p,
        hidden=count * hidden,
        expert=count * expert,
        mean=mean,
    )


def combined_1f1b_chunks(busiest: MicroBatchTime, p2p: float) -> tuple[Chunk, Chunk]:
    """A micro-batch's forward and backward chunk under Megatron-Core's combined 1F1B
    (`hardware.combined_1f1b`): `dualpipe_chunks`, but the backward's pipeline send stays
    exposed (core_v0.14.0 model_chunk_schedule_plan.py: `post_backward` runs on the compute
    stream; the forward's `post_forward` on the communication stream)."""
    forward, backward = dualpipe_chunks(busiest, p2p)
    return forward, dataclasses.replace(
        backward, pipeline=0.0, other=backward.other + backward.pipeline
    )


def combined_1f1b_hidden(
    spec: ModelSpec, gpu: GPU, busiest: MicroBatchTime, stage: int
) -> tuple[float, float]:
    """(communication, expert-parallel communication) seconds the combined 1F1B hides in one
    iteration of pipeline stage `stage`, `busiest` its micro-batch: each of its
    `combined_1f1b.paired_chunks` merged steps pairs a forward and a backward chunk of 1/v of
    a micro-batch (derived: each virtual stage a v-th of the stage) and hides what
    `chunk_pairs.hidden_in_pair` finds, the communication holding
    `combined_1f1b.communication_sms`; warm-up and cool-down chunks keep theirs exposed.
    (0, 0) without overlap_moe_expert_parallel_comm."""
    if not spec.overlap_moe_expert_parallel_comm:
        return 0.0, 0.0
    forward, backward = combined_1f1b_chunks(busiest, pipeline_p2p_seconds(spec, gpu))
    v = spec.virtual_stages
    taken = combined_1f1b.communication_sms(spec.moe_token_dispatcher_type, gpu.nccl_channels)
    share = 1 / v
    saved, expert = hidden_in_pair(
        forward.scaled(share), backward.scaled(share), gpu.sm_count, taken
    )
    count = combined_1f1b.paired_chunks(spec.pp, v, spec.microbatches, spec.microbatch_group, stage)
    return count * saved, count * expert


def _mean_micro_batch(a: MicroBatchTime, b: MicroBatchTime) -> MicroBatchTime:
    """One micro-batch of a DualPipe rank: half its micro-batches run each of its two stages
    (deepseek-ai/DualPipe at 3da1bbe, `half_num_chunks` from each end)."""
    return MicroBatchTime(
        _scale(_add(a.forward, b.forward), 0.5),
        _scale(_add(a.backward, b.backward), 0.5),
        _scale(_add(a.recompute, b.recompute), 0.5),
        (a.forward_comm + b.forward_comm) / 2,
        (a.backward_comm + b.backward_comm) / 2,
        (a.recompute_comm + b.recompute_comm) / 2,
        (a.expert_comm + b.expert_comm) / 2,
        (a.expert_forward_comm + b.expert_forward_comm) / 2,
    )


def _busiest_dualpipe_rank(
    spec: ModelSpec, gpu: GPU, stages: list[int], times: list[MicroBatchTime]
) -> tuple[int, DualPipeRank]:
    """The DualPipe rank (of those both of whose stages are timed) whose iteration, chunks and
    bubble (`dualpipe_rank_time`), takes longest; rank r and p - 1 - r run the same."""
    by_stage = dict(zip(stages, times, strict=True))
    ranks = sorted({min(stage, spec.pp - 1 - stage) for stage in stages})
    timed = [
        (
            rank,
            dualpipe_rank_time(
                spec,
                gpu,
                rank,
                by_stage[rank],
                by_stage[spec.pp - 1 - rank],
                _rank_weight_seconds(spec, gpu, rank),
            ),
        )
        for rank in ranks
        if rank in by_stage and spec.pp - 1 - rank in by_stage
    ]
    return max(timed, key=lambda r: r[1].total)


def step_time_from_forwards(
    spec: ModelSpec,
    gpu: GPU,
    stage_forwards: tuple[tuple[int, tuple[int, ...]], ...],
    groups: tuple[str, ...] | bool,
    flop_overhead: float = 0.0,
    stage_offloads: tuple = (),
    stage_prefetch: tuple = (),
    stage_policy: tuple = (),
) -> StepTime:
    """The iteration's time from each pipeline stage's forward counts per chain stage
    ((pipeline stage, layer_forwards) as the schedule replay gives them), `groups` the recompute
    groups re-run inside stored layers (True: the attention core); `flop_overhead`
    (recompute / (forward + backward) FLOPs) turns MFU into HFU. `stage_policy`: (pipeline
    stage, one flag per chain stage), which stages re-run `groups` (`sac+mixed`); without it,
    every stage does."""
    if isinstance(groups, bool):
        groups = (ATTENTION_CORE,) if groups else ()
    masks = dict(stage_policy)
    times = [
        _stage_micro_batch(spec, gpu, stage, tuple(forwards), groups, masks.get(stage))
        for stage, forwards in stage_forwards
    ]
    plain = [
        _stage_micro_batch(spec, gpu, stage, (1,) * len(forwards), ())
        for stage, forwards in stage_forwards
    ]
    exposed = dict.fromkeys(range(len(times)), 0.0)
    offloads, prefetches = dict(stage_offloads), dict(stage_prefetch)
    for index, (stage, _) in enumerate(stage_forwards):
        if offloads.get(stage):
            exposed[index] = offload_exposed_seconds(
                spec, gpu, stage, offloads[stage], groups, prefetches.get(stage)
            )
    index = max(range(len(times)), key=lambda k: times[k].total + exposed[k])
    busiest = times[index]
    m = spec.microbatches
    stages = [stage for stage, _ in stage_forwards]
    hidden = hidden_expert = 0.0  # communication paired chunks hide (DualPipe, combined 1F1B)
    if spec.pipeline_schedule == "dualpipe":  # a rank runs two stages (no offload here)
        _, timed = _busiest_dualpipe_rank(spec, gpu, stages, times)
        busiest, compute, bubble, p2p = timed.mean, timed.compute, timed.bubble, timed.p2p
        hidden, hidden_expert = timed.hidden, timed.expert
        _, plain_timed = _busiest_dualpipe_rank(spec, gpu, stages, plain)
        plain_busiest = plain_timed.mean
        plain_compute, plain_bubble = plain_timed.compute, plain_timed.bubble
    else:
        compute, bubble, p2p = _pipeline(spec, gpu, busiest, stage_forwards[index][0])
        hidden, hidden_expert = combined_1f1b_hidden(spec, gpu, busiest, stage_forwards[index][0])
        compute -= hidden
        plain_index = max(range(len(plain)), key=lambda k: plain[k].total)
        plain_busiest = plain[plain_index]
        plain_compute, plain_bubble, _ = _pipeline(
            spec, gpu, plain_busiest, stage_forwards[plain_index][0]
        )
        plain_compute -= combined_1f1b_hidden(
            spec, gpu, plain_busiest, stage_forwards[plain_index][0]
        )[0]
    regathered = regathered_elements(spec, stage_forwards[index][0], stage_forwards[index][1])
    dp = data_parallel_exposed(spec, gpu, busiest, regathered, stage_forwards[index][1])
    optimizer = optimizer_seconds(spec, gpu)
    offload = m * exposed[index]
    states = state_copy_seconds(spec, gpu, busiest)
    step = compute + bubble + dp + optimizer + offload + states
    step_without = (
        plain_compute
        + plain_bubble
        # the weights ZeRO-3 gathers again for the re-run forwards are recomputation's cost
        + data_parallel_exposed(spec, gpu, busiest)
        + optimizer
        + state_copy_seconds(spec, gpu, plain_busiest)
    )

    gpus = spec.tp * spec.pp * spec.cp * spec.dp
    global_batch = spec.micro_batch * m * spec.dp
    mfu = _model_flops(spec, global_batch) / (step * gpus * gpu.bf16_flops)
    tokens = global_batch * spec.seq
    communication = m * (busiest.forward_comm + busiest.backward_comm) + p2p + dp - hidden
    expert_parallel = m * busiest.expert_comm - hidden_expert
    breakdown = {
        "matmul_seconds": m
        * (busiest.forward.matmul + busiest.backward.matmul + busiest.recompute.matmul),
        "memory_bound_seconds": m
        * (busiest.forward.memory + busiest.backward.memory + busiest.recompute.memory),
        "communication_seconds": communication + m * busiest.recompute_comm,
        "bubble_seconds": bubble,
        "optimizer_seconds": optimizer,
    }
    return StepTime(
        step_seconds=step,
        forward_seconds=m * busiest.forward.total,
        backward_seconds=m * busiest.backward.total,
        recompute_seconds=m * (busiest.recompute.total + busiest.recompute_comm),
        communication_seconds=communication,
        bubble_seconds=bubble,
        optimizer_seconds=optimizer,
        overhead=step / step_without - 1,
        mfu=mfu,
        hfu=mfu * (1 + flop_overhead),
        tokens_per_second_per_gpu=tokens / step / gpus,
        breakdown=breakdown,
        expert_parallel_seconds=expert_parallel,
        offload_exposed_seconds=offload,
        state_copy_seconds=states,
    )


def _rank_weight_seconds(spec: ModelSpec, gpu: GPU, rank: int) -> float:
    """W of a DualPipe rank's micro-batch: the mean of its two stages' (`_mean_micro_batch`)."""
    mirror = spec.pp - 1 - rank
    return (
        stage_weight_gradient_seconds(spec, gpu, rank)
        + stage_weight_gradient_seconds(spec, gpu, mirror)
    ) / 2


def state_copy_seconds(spec: ModelSpec, gpu: GPU, busiest: MicroBatchTime) -> float:
    """The exposed host copies of the offloaded model states in one step
    (`host_states.exposed_state_copy_seconds` beside the busiest stage's forward and backward,
    communication and re-forwards included, over every micro-batch where hf's no_sync gathers
    for each); 0 without optimizer_offload."""
    if spec.optimizer_offload == "none":
        return 0.0
    forward = busiest.forward.total + busiest.forward_comm
    backward = (
        busiest.backward.total
        + busiest.backward_comm
        + busiest.recompute.total
        + busiest.recompute_comm
    )
    traffic = host_states.state_traffic(spec)
    passes = spec.microbatches if frameworks.offload_accumulates_on_device(spec) else 1
    return host_states.exposed_state_copy_seconds(traffic, gpu, forward, backward, passes)


def offload_exposed_seconds(
    spec: ModelSpec,
    gpu: GPU,
    stage: int,
    offloaded: tuple[tuple[int, int], ...],
    groups: tuple[str, ...] = (),
    prefetch: tuple[int, ...] | None = None,
) -> float:
    """One micro-batch's exposed host copies on pipeline stage `stage`: each offloaded (chain
    stage i, bytes) copies out beside the forward of chain stage i + 1 and back beside the
    backward of chain stage `prefetch[k]` (default i + 1; hardware.host_link.
    exposed_copy_seconds), with this model's stage times
    (communication included; the backward with the recompute groups' re-forward).

    derived: ckplan.schedules.offload (rules O1, O2). The exposure is added to the step (it
    delays the compute stream of every micro-batch); the pipeline bubble is not scaled by it.
    """
    from ckplan.hardware.host_link import exposed_copy_seconds

    forward, backward = chain_compute_seconds(spec, gpu, stage, groups)
    return exposed_copy_seconds(forward, backward, offloaded, gpu, prefetch)


def chain_compute_seconds(
    spec: ModelSpec, gpu: GPU, stage: int, groups: tuple[str, ...] = ()
) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of each chain stage of pipeline stage `stage`, communication
    included, the backward with the recompute groups' re-forward (as `micro_batch_time` counts
    them): what a host copy beside them can hide behind."""
    times = chain_stage_times(spec, gpu, stage, groups or (ATTENTION_CORE,))
    forward = [t.forward.total + t.forward_comm for t in times]
    backward = [
        t.backward.total + t.backward_comm + ((t.core_forward.total + t.core_comm) if groups else 0)
        for t in times
    ]
    return forward, backward


@lru_cache(maxsize=256)
def _model_flops(spec: ModelSpec, global_batch: int) -> int:
    """Model FLOPs of one iteration (Korthikanti App. A); the NumPy MLP: 3 x its layers' forward
    matmuls."""
    if spec.kind == "transformer":
        return model_flops_per_iteration(spec, global_batch)
    layer = sum(op.forward_flops for op in model_layer_ops(spec))
    return 3 * layer * spec.layers * global_batch


def in_mfu_convention(time: StepTime, spec: ModelSpec, convention: str) -> StepTime:
    """`time` with its MFU counted in `convention` (FLOP_CONVENTIONS): the same step, the FLOPs
    another publisher would count in it. The NumPy MLP has one count only."""
    if convention == time.mfu_convention or spec.kind != "transformer":
        return time
    global_batch = spec.micro_batch * spec.microbatches * spec.dp
    ratio = iteration_flops(spec, global_batch, convention) / iteration_flops(
        spec, global_batch, time.mfu_convention
    )
    return dataclasses.replace(time, mfu=time.mfu * ratio, mfu_convention=convention)


def step_time(plan, gpu: GPU) -> StepTime | None:
    """The step time of a `plan.Plan` on `gpu`; None for plans without a schedule replay (the
    simple formula set)."""
    if not plan.stage_forwards:
        return None
    return step_time_from_forwards(
        plan.spec,
        gpu,
        plan.stage_forwards,
        plan.recompute_groups,
        plan.flops.overhead,
        getattr(plan, "stage_offloads", ()),
        getattr(plan, "stage_prefetch", ()),
        getattr(plan, "stage_policy", ()),
    )
