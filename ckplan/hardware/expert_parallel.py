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

Overlap: Megatron's default alltoall dispatcher runs these collectives on the compute stream,
between the layer's kernels, so nothing hides them: `ep_overlap` 0 (the GPU file's default).
`--overlap-moe-expert-parallel-comm` (MCore v0.14, batch-level overlap of one micro-batch's
all-to-all with another's compute) is `ep_overlap` 1: the communication is hidden up to the
compute of the layer it runs beside (`exposed_fraction`). DeepSeek-V3's DualPipe (report §3.2.1:
"both all-to-all and PP communication can be fully hidden") hides what is left exposed here
behind the paired chunk's compute: `pipeline_schedule: dualpipe` (`hardware.dualpipe`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.hardware import communication as comm
from ckplan.hardware.gpus import GPU
from ckplan.model.moe import received_rows, routed_rows, sent_rows
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
        """The transposed collectives move the same bytes (derived)."""
        return self.forward


def dispatch_bytes(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the dispatch all-to-all moves on the busiest rank: max(S, R/etp) rows of h values
    and one probability each, B bytes (the probabilities have the logits' dtype)."""
    rows = max(sent_rows(spec, shapes), received_rows(spec, shapes))
    return shapes.B * rows * (spec.hidden + 1)


def combine_bytes(spec: ModelSpec, shapes: LayerShapes) -> int:
    """Bytes the combine all-to-all moves on the busiest rank: max(S, R/etp) rows of h values."""
    rows = max(sent_rows(spec, shapes), received_rows(spec, shapes))
    return shapes.B * rows * spec.hidden


def expert_parallel_comm(spec: ModelSpec, gpu: GPU) -> ExpertParallelComm:
    """One MoE layer's dispatcher collectives on `gpu` (module docstring): all-to-alls over the
    ep group, all-gather and reduce-scatter of the R gathered rows over the etp group (etp
    consecutive ranks). Zero at ep = etp = 1, and for a model without experts."""
    if not spec.experts or (spec.ep == 1 and spec.etp == 1):
        return ExpertParallelComm()
    shapes = LayerShapes.of(spec)
    dispatch = comm.hierarchical_all_to_all_seconds(
        dispatch_bytes(spec, shapes), spec.ep, spec.etp, gpu
    )
    combine = comm.hierarchical_all_to_all_seconds(
        combine_bytes(spec, shapes), spec.ep, spec.etp, gpu
    )
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
