"""Expert-parallel communication of one MoE layer: the token dispatcher's collectives.

Megatron-Core's all-to-all token dispatcher (megatron/core/transformer/moe/token_dispatcher.py,
MoEAlltoAllTokenDispatcher: "permute -> A2A(EP) -> AG(TP) -> sort_chunk" to dispatch,
"sort_chunk -> RS(TP) -> A2A(EP) -> unpermute" to combine), per MoE layer and micro-batch:

- dispatch: an all-to-all over the ep ranks of the S permuted token rows (h values each) and
  their S routing probabilities (`all_to_all(ep_group, permutated_local_input_tokens, ...)` and
  the same for `permuted_probs`); S = T·k dropless, E·capacity with a capacity factor
  (`moe.sent_rows`);
- with expert tensor parallelism, an all-gather over the etp ranks of the received rows and
  probabilities (`gather_from_sequence_parallel_region(..., group=self.tp_group)`, the expert
  tensor-parallel group), R rows gathered in all (`moe.routed_rows`);
- combine: a reduce-scatter over etp of the R output rows, then the all-to-all back of the rows
  this rank received.

The backward runs the transposed collective of each (an all-to-all the other way, a
reduce-scatter for the all-gather and an all-gather for the reduce-scatter), moving the same
bytes; every re-forward of the layer runs the forward's again.

Routing imbalance: every rank sends S rows, but the busiest receives R/etp of them
(`moe.received_rows`, `moe_imbalance`); the all-to-all ends when the busiest rank has received
its rows, so each all-to-all moves max(S, R/etp) rows on that rank. Of them (ep - 1)/ep cross
its links, the rest stay local.

Links (`communication.hierarchical_all_to_all_seconds`): an expert-parallel group is ep ranks
etp apart (Megatron's expert rank generator, order "tp-cp-ep-dp-pp" with tp = etp); inside a
node it uses the intra-node link, across nodes the share bound for other nodes goes over the
network.

Dispatcher: `moe_token_dispatcher_type: flex` (DeepEP; DeepSeek-V3's own kernels, report
§3.2.2) sends each token over the network once per destination node and forwards it over
NVLink there (`node_limited_all_to_all_seconds`); with group-limited routing
(`moe_router_num_groups`, `moe_router_group_topk`) a token reaches at most group_topk nodes.
`moe_dispatch_fp8` sends the dispatched rows in FP8 with their scales (report §3.3.3).

Overlap: Megatron's default alltoall dispatcher runs these collectives on the compute stream,
between the layer's kernels, so nothing hides them: `ep_overlap` 0 (the GPU file's default).
`ep_overlap` 1 hides the communication up to the compute of the layer it runs beside
(`exposed_fraction`), at no SM cost: a bound, no framework's mechanism. Megatron-Core's
`--overlap-moe-expert-parallel-comm` (core_v0.14.0, batch-level overlap of one micro-batch's
all-to-all with another's compute) is the key `overlap_moe_expert_parallel_comm`
(`hardware.combined_1f1b`), and DeepSeek-V3's DualPipe (report §3.2.1: "both all-to-all and PP
communication can be fully hidden") `pipeline_schedule: dualpipe` (`hardware.dualpipe`): both
hide what is left exposed here behind a paired chunk's compute (`hardware.chunk_pairs`); under
the former the layer leaves all of it (ep_overlap not applied).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.hardware import communication as comm
from ckplan.hardware.gpus import GPU
from ckplan.model.moe import (
    dispatch_row_bytes,
    node_reach_probability,
    received_rows,
    routed_rows,
    sent_rows,
)
from ckplan.model.op import LayerShapes
from ckplan.model.spec import ModelSpec


@dataclass(frozen=True)
class ExpertParallelComm:
    """Seconds of one MoE layer's dispatcher collectives, one micro-batch, before overlap."""

    dispatch: float = 0.0  # all-to-all of the token rows and their probabilities
    combine: float = 0.0  # all-to-all of the expert outputs back
    gather: float = 0.0  # etp all-gather of the received rows and probabilities
    scatter: float = 0.0  # etp reduce-scatter of the expert outputs

    @property
    def forward(self) -> float:
        return self.dispatch + self.combine + self.gather + self.scatter

    @property
    def backward(self) -> float:
        """The transposed collectives move the same bytes (derived). Under `moe_dispatch_fp8`
        the FP8 one is the combine's transpose and the BF16 one the dispatch's (DeepSeek-V3
        report §3.3.3; `moe.dispatch_row_bytes`): the same sum, the probabilities aside."""
        return self.forward


def dispatch_bytes(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the dispatch all-to-all moves on the busiest rank: max(S, R/etp) rows of h values
    (`moe.dispatch_row_bytes`: B bytes each, or FP8 with its scales under `moe_dispatch_fp8`)
    and one probability each, B bytes (the probabilities have the logits' dtype)."""
    rows = max(sent_rows(spec, shapes), received_rows(spec, shapes))
    return rows * (dispatch_row_bytes(spec, shapes.B) + shapes.B)


def combine_bytes(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the combine all-to-all moves on the busiest rank: max(S, R/etp) rows of h values."""
    rows = max(sent_rows(spec, shapes), received_rows(spec, shapes))
    return shapes.B * rows * spec.hidden


def node_limited_all_to_all_seconds(size_bytes: float, spec: ModelSpec, gpu: GPU) -> float:
    """A dispatch or combine of `size_bytes` (S per-expert copies of token rows) by a dispatcher
    that sends each token once per destination node (`moe_token_dispatcher_type: flex`).

    DeepSeek-V3 report (arXiv 2412.19437) §3.2.2: tokens are dispatched to at most 4 nodes to
    cut InfiniBand traffic, each crossing IB once to a node and forwarded there over NVLink to
    its experts' GPUs ("(1) IB sending, (2) IB-to-NVLink forwarding, and (3) NVLink receiving";
    the combine the reverse, "NVLink-to-IB forwarding and accumulation"). deepseek-ai/DeepEP
    v1.2.1 (9af0e0d) implements it, "kernels optimized for asymmetric-domain bandwidth
    forwarding, such as forwarding data from NVLink domain to RDMA domain" aligned with
    DeepSeek-V3's group-limited gating (README), "the ranks with the same GPU index ... visible
    via RDMA" (deep_ep/buffer.py `Buffer.dispatch`); Megatron-Core runs it as its flex
    dispatcher (--moe-token-dispatcher-type flex, core_v0.19.0 transformer_config.py).

    Derived, per token (S/k bytes each of its k copies): (N - 1)·p rows over the network,
    p = `moe.node_reach_probability` on the N nodes of the ep group, its own node excluded;
    over NVLink, each copy whose expert is on another GPU of its node than the one it enters by
    (the same GPU index), k·(g - 1)/g of them with g ep ranks a node under uniform routing: a
    copy per expert, so two experts on one GPU count twice (DeepEP sends a token once per
    rank: an upper bound). Both links at once, as in
    `communication.hierarchical_all_to_all_seconds`: the slower. The combine moves the same
    counts the reverse way."""
    if spec.ep <= 1:
        return 0.0
    local = comm.ranks_per_node(gpu, spec.ep, spec.etp)
    nodes = max(1, spec.ep // local)
    reach = node_reach_probability(
        spec.experts, spec.top_k, nodes, spec.moe_router_num_groups, spec.moe_router_group_topk
    )
    per_copy = size_bytes / spec.top_k
    link = gpu.link_bytes_per_s * gpu.link_efficiency
    network = gpu.network_bytes_per_s * gpu.network_efficiency
    inter = float((nodes - 1) * reach) * per_copy / network
    intra = spec.top_k * (local - 1) / local * per_copy / link
    return max(intra, inter)


def token_all_to_all_seconds(size_bytes: float, spec: ModelSpec, gpu: GPU) -> float:
    """One dispatch or combine all-to-all over the ep group, by the dispatcher `spec` names:
    alltoall, every copy to its expert's rank (`communication.hierarchical_all_to_all_seconds`),
    or flex, once per node (`node_limited_all_to_all_seconds`)."""
    if spec.moe_token_dispatcher_type == "flex":
        return node_limited_all_to_all_seconds(size_bytes, spec, gpu)
    return comm.hierarchical_all_to_all_seconds(size_bytes, spec.ep, spec.etp, gpu)


def expert_parallel_comm(spec: ModelSpec, gpu: GPU) -> ExpertParallelComm:
    """One MoE layer's dispatcher collectives on `gpu` (module docstring): all-to-alls over the
    ep group, all-gather and reduce-scatter of the R gathered rows over the etp group (etp
    consecutive ranks). Zero at ep = etp = 1, and for a model without experts."""
    if not spec.experts or (spec.ep == 1 and spec.etp == 1):
        return ExpertParallelComm()
    shapes = LayerShapes.of(spec)
    dispatch = token_all_to_all_seconds(dispatch_bytes(spec, shapes), spec, gpu)
    combine = token_all_to_all_seconds(combine_bytes(spec, shapes), spec, gpu)
    gather = scatter = 0.0
    if spec.etp > 1:
        rows = routed_rows(spec, shapes)
        bandwidth = comm.group_bandwidth(gpu, spec.etp, 1)
        gather = comm.all_gather_seconds(shapes.B * rows * (spec.hidden + 1), spec.etp, bandwidth)
        scatter = comm.reduce_scatter_seconds(shapes.B * rows * spec.hidden, spec.etp, bandwidth)
    return ExpertParallelComm(dispatch, combine, gather, scatter)


def exposed_fraction(comm_seconds: float, compute_seconds: float, overlap: float) -> float:
    """Share of the layer's expert-parallel communication left exposed (derived): `overlap` of
    it runs beside compute, but no more than the layer's own compute (forward and backward) can
    hide; 1 - min(overlap, compute / communication)."""
    if comm_seconds <= 0:
        return 0.0
    return 1.0 - min(overlap, compute_seconds / comm_seconds)
