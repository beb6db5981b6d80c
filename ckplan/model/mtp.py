"""Multi-token prediction (MTP): DeepSeek-V3's extra depths that predict the tokens after the
next (DeepSeek-V3 technical report, arXiv 2412.19437, §2.2), as Megatron-Core runs them.

Each MTP depth k holds one transformer block TRM_k and a projection M_k of 2h to h; it reads
the previous depth's hidden state h^(k-1) (the main model's output for k = 1) and the shared
embedding of the token k places ahead, and feeds the shared output head and its own
cross-entropy loss: h'^k = M_k [RMSNorm(h^(k-1)); RMSNorm(Emb(t_(i+k)))], h^k = TRM_k(h'^k),
P^k = OutHead(h^k) (report Eq. 21-23). Megatron-Core's MultiTokenPredictionLayer
(megatron/core/transformer/multi_token_prediction.py at core_v0.14.0) runs it as `enorm` and
`hnorm` (the two norms), a torch.cat, `eh_proj` (a ColumnParallelLinear of 2h to h without bias,
gather_output=False, its output gathered over TP and scattered back to the sequence-parallel
region), the transformer layer (the decoder's last layer spec), and `final_layernorm` before
the shared output layer. The MTP layers sit on the stage that holds the loss, which also keeps a
copy of the word embedding (GPTModel builds `self.embedding` where `pre_process or
mtp_process`, megatron/core/models/gpt/gpt_model.py at core_v0.14.0). Megatron's key is
`--mtp-num-layers`; Hugging Face's config.json calls it `num_nextn_predict_layers`.
"""

from __future__ import annotations

from ckplan.model.layers import LayerKind, layer_kinds
from ckplan.model.op import split_share


def mtp_kind(spec) -> LayerKind:
    """The kind of an MTP depth's transformer block: the decoder's last layer's (Megatron's
    pretrain_gpt.py builds the MTP block from the last layer spec; DeepSeek-V3's is MoE)."""
    return layer_kinds(spec)[-1]


def norm_parameters(spec) -> int:
    """One norm's weights over h: RMSNorm a scale, LayerNorm a scale and a bias."""
    return spec.hidden * (1 if spec.norm == "rmsnorm" else 2)


def projection_parameters_per_rank(spec) -> int:
    """An MTP depth's weights besides its transformer block, on one TP rank: eh_proj's 2h x h
    split over t (column-parallel), and enorm, hnorm and final_layernorm whole."""
    return split_share(2 * spec.hidden * spec.hidden, spec.tp) + 3 * norm_parameters(spec)


def projection_forward_flops(spec) -> int:
    """eh_proj's forward on one TP rank: 2 x tokens x 2h x h/t (the sequence gathered under
    sequence parallelism, each rank its h/t output columns)."""
    tokens = (spec.seq // spec.cp) * spec.micro_batch
    return 2 * tokens * 2 * spec.hidden * split_share(spec.hidden, spec.tp)


def projection_backward_flops(spec) -> int:
    """eh_proj's backward: the input's and the weight's gradients, twice its forward (the input
    gradient alone when the base weights are frozen)."""
    return (2 if spec.training == "full" else 1) * projection_forward_flops(spec)


def projection_saved_bytes(stream: int, token_ids: int) -> int:
    """What an MTP depth keeps beside its transformer block's tape, for the backward (derived
    from MultiTokenPredictionLayer at core_v0.14.0, `stream` the residual stream s·b·h·B of one
    rank): the shifted token ids its embedding lookup keeps; enorm's and hnorm's inputs, a
    stream each; eh_proj's input, the concatenation (two streams; under sequence parallelism
    the rank's shard, gathered again in the backward); final_layernorm's input. A norm keeps
    its input as the layers' norms do in ckplan's fused op table (`ckplan.model.ops`, norm1;
    Korthikanti et al. 2022 §4.1), its per-token statistics not counted."""
    return token_ids + 5 * stream
