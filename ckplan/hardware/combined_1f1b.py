"""Megatron-Core's combined 1F1B (`--overlap-moe-expert-parallel-comm`): in the steady 1F1B
phase a forward chunk of one micro-batch and the backward chunk of another run merged, layer by
layer, each one's expert-parallel all-to-alls on a communication stream beside the other's
compute; which chunks it pairs, and how many SMs the communication holds.

Megatron-LM core_v0.14.0 (the release Megatron-Bridge v0.1.0rc3 pins, pyproject.toml
"megatron-core>=0.14.0a0,<0.15.0"); core_v0.19.0 keeps the pairing, the extra warm-up step
and the phases below (its layer split names the compute pre_dispatch and mlp):

- megatron/core/models/common/model_chunk_schedule_plan.py, `TransformerLayerSchedulePlan.run`:
  "comm_stream: combine_bwd | dispatch_fwd->dispatch_bwd | combine_fwd / comp_stream:
  attn_fwd->post_attn_fwd | mlp_bwd->mlp_bwd_dw->mlp_fwd | post_attn_bwd->attn_bwd": forward
  layer i beside backward layer n - 1 - i (`TransformerModelChunkSchedulePlan.run`), so each
  chunk's dispatch and combine run beside the other chunk's compute. `delay_wgrad_compute`
  moves the weight-gradient GEMMs (`mlp_bwd_dw`, `attn.backward_dw`) inside the backward's
  compute, which ckplan counts there already. The forward's pipeline send runs on the
  communication stream ("so the p2p comm could be overlapped with the attn backward"), the
  backward's on the compute stream.
- megatron/core/pipeline_parallel/schedules.py, `get_pp_rank_microbatches`: the interleaved
  warm-up of (p - r - 1)·2 + (v - 1)·g forward chunks gets "one extra micro-batch forward step
  before the 1f1b stages" under the flag; the m·v - warm-up steady steps each call
  `forward_backward_helper_wrapper(f_virtual_microbatch_id, b_virtual_microbatch_id)`, merged
  (`combined_1f1b_schedule_for_interleaved_pipelining`); the warm-up forwards and the
  cool-down backwards run alone.
- megatron/core/pipeline_parallel/combined_1f1b.py, `combined_1f1b_schedule_for_no_pipelining`:
  without pipelining "Phases 0: 1st microbatch forward / Phases 1: 1st microbatch backward +
  2nd microbatch forward / ... / Phases 4: 4th microbatch backward": m - 1 pairs.

The pair itself is `hardware.chunk_pairs`'s. Memory is left as interleaved 1F1B's
(derived): the extra warm-up forward takes a rank to warm-up + 1 chunk forwards held, the
peak 1F1B reaches after each steady forward (`plan.evaluate.megatron_in_flight_forwards`), and
a merged step frees the backward's layers as the forward's fill (layer i beside layer n - 1 - i),
so the count stays there, give or take a layer.
"""

from __future__ import annotations

# DeepEP's SMs: Megatron-Core core_v0.14.0 transformer_config.py `moe_deepep_num_sms: int =
# 20` ("Number of SMs to use for DeepEP"), which token_dispatcher.py hands to
# `set_deepep_num_sms` (moe/fused_a2a.py: `Buffer.set_num_sms`); DeepEP's own default is the
# same (deepseek-ai/DeepEP v1.2.1, deep_ep/buffer.py: `num_sms: int = 20`), which
# core_v0.19.0 keeps by leaving `moe_flex_dispatcher_num_sms` None ("historical default 20").
DEEPEP_NUM_SMS = 20


def warmup_chunks(pp: int, virtual_stages: int, microbatches: int, group: int, rank: int) -> int:
    """The forward chunks pipeline rank `rank` runs before its steady phase under the flag
    (core_v0.14.0 schedules.py `get_pp_rank_microbatches`, interleaved: (p - r - 1)·2 +
    (v - 1)·g + 1, g the micro-batch group, at most all m·v chunks); 0 without pipelining."""
    if pp == 1:
        return 0
    warmup = (pp - rank - 1) * 2 + (virtual_stages - 1) * group + 1
    return min(warmup, microbatches * virtual_stages)


def paired_chunks(pp: int, virtual_stages: int, microbatches: int, group: int, rank: int) -> int:
    """How many merged forward-and-backward steps pipeline rank `rank` runs in one iteration:
    the steady phase's m·v - warm-up (`warmup_chunks`), each a forward chunk and a backward
    chunk of 1/v of a micro-batch; without pipelining m - 1 (combined_1f1b.py, the first
    forward and the last backward alone)."""
    if pp == 1:
        return max(0, microbatches - 1)
    total = microbatches * virtual_stages
    return total - warmup_chunks(pp, virtual_stages, microbatches, group, rank)


def communication_sms(dispatcher: str, nccl_channels: int) -> int:
    """SMs the all-to-alls hold while the other chunk computes: DeepEP's 20 under the flex
    dispatcher (`DEEPEP_NUM_SMS`); under alltoall, NCCL's blocks, one per channel (the GPU
    file's nccl_channels, as `communication.overlapped` charges the data-parallel
    collectives)."""
    return DEEPEP_NUM_SMS if dispatcher == "flex" else nccl_channels
