"""Megatron-LM command-line flags for a plan, and the flags read back into a strategy.

The rules, as Megatron-LM states them (megatron/training/arguments.py and
megatron/core/transformer/transformer_config.py, NVIDIA/Megatron-LM core_v0.19.0, the release of
tests/megatron_flags.py; from core_v0.16.0 many of these flags are built by ArgumentGroupFactory
from the TransformerConfig fields, megatron/training/argument_utils.py, under the same names):

- `--recompute-granularity` is `full` or `selective`; `--recompute-method` is `uniform` or
  `block` (argparse choices).
- `selective` takes no method: `validate_args` asserts "recompute method is not yet supported
  for selective recomputing granularity", and `TransformerConfig.__post_init__` requires
  `recompute_num_layers` to be None. It recomputes the core attention (QKᵀ, softmax, dropout,
  ·V), Korthikanti et al. 2022 §5; newer versions name the modules with `--recompute-modules`
  (default `core_attn`).
- `full` needs a method ("recompute_method must be block or uniform") and
  `--recompute-num-layers` ("must be between 1 and num_layers_per_pipeline_rank").
- `uniform` (TransformerBlock._checkpointed_forward): the layers of a model chunk are split into
  chunks of recompute-num-layers from the first, the last one shorter; each chunk's input is
  kept and the chunk re-run in backward; every layer is recomputed. `block`: the first
  recompute-num-layers layers of each model chunk are checkpointed one by one, the rest stored.
  A model chunk is a pipeline stage, or one of its virtual stages when interleaving.
- `--sequence-parallel` is switched off when tp = 1; `--context-parallel-size` > 1 needs
  seq-length a multiple of 2·cp; `--num-layers-per-virtual-pipeline-stage` must divide the layers
  per pipeline stage and needs pp > 1 (pp > 2 with `--no-overlap-p2p-communication`).
- `--use-distributed-optimizer` shards fp32 master weights and Adam states over data parallel,
  6 + 12/dp bytes per parameter (docs/user-guide/features/dist_optimizer.md): ckplan's `zero:
  1`; zero 2 and 3 are Megatron-FSDP (`--use-megatron-fsdp --data-parallel-sharding-strategy
  optim_grads` or `optim_grads_params`). The data-parallel size is world size / (tp·pp·cp): no flag.
- The model: `--hidden-size`, `--ffn-hidden-size`, `--num-attention-heads`,
  `--group-query-attention --num-query-groups`, `--kv-channels` (a·d ≠ h), `--normalization`,
  `--swiglu`, `--position-embedding-type`, `--disable-bias-linear`, `--add-qkv-bias`,
  `--qk-layernorm`, `--softmax-type learnable` (attention sinks),
  `--untie-embeddings-and-output-weights`, dropouts, `--window-size` (with
  `--window-attn-skip-freq` as a pattern where windows are on some layers); MoE
  (`--num-experts`, `--moe-router-topk`, `--moe-ffn-hidden-size`, `--moe-layer-freq` as a
  pattern such as `[0]*3+[1]*58`, shared experts and their sigmoid gate
  (`--moe-shared-expert-gate`, from core_v0.16.0: sigmoid(x·w_g) with w_g of shape 1×h scales the
  shared experts' output, megatron/core/transformer/moe/shared_experts.py), expert bias, capacity
  (`--moe-expert-capacity-factor` with `--moe-pad-expert-input-to-capacity`, ckplan's padded
  buffers), Transformer Engine's fused permutation and routing kernels (`--moe-permute-fusion`,
  `--moe-router-fusion`, store_true, off by default),
  `--expert-model-parallel-size`, `--expert-tensor-parallel-size`), MLA
  (`--multi-latent-attention` and its ranks and head dims); uneven stages
  (`--decoder-first/last-pipeline-num-layers`, with `--num-virtual-stages-per-pipeline-rank`
  when interleaved, which validate_args requires), the
  embedding or loss counted as a layer; `--bf16`/`--fp16`, `--fp8-format hybrid`,
  `--fp8-recipe`, `--fp8-param-gather` (FP8 primary weights, with the distributed optimizer); the
  attention backend; `--overlap-grad-reduce`/`--overlap-param-gather`, `--tp-comm-overlap`.
  The vocabulary comes from the tokenizer, so it is a note, not a flag.
- Activation offload is refused (`offload_reason`): `--cpu-offloading-num-layers` and
  `--offload-modules` move less than ckplan's offload plans do.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Collection
from itertools import groupby

from ckplan.exports.segments import LayerSegments
from ckplan.model.context_parallel import MEGATRON_CP_COMM_TYPES
from ckplan.model.layers import parse_layer_set, stage_chunk_layers
from ckplan.model.op_policy import parse_policy
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan
from ckplan.plan.strategies import MODULES

NAME = "megatron"


def offload_reason(recomputes: bool) -> str:
    """Why no Megatron-LM flags write an offload plan.

    Source: NVIDIA/Megatron-LM at core_v0.19.0 (commit 5be96267, the release of
    tests/megatron_flags.py). Megatron-LM has two activation offloads, and neither moves what
    ckplan's offload plans move:

    - `--cpu-offloading-num-layers N` (validate_args in megatron/training/arguments.py sets
      `cpu_offloading` when N > 0): TransformerBlock (megatron/core/transformer/
      transformer_block.py) wraps its layers in Transformer Engine's `get_cpu_offload_context(
      enabled, N, num_layers, ...)`, which offloads saved tensors of N of the block's layers
      (Megatron-Core marks the inputs of its tensor-parallel linears, megatron/core/
      tensor_parallel/layers.py, and of the fused SwiGLU, megatron/core/fusions/
      fused_bias_swiglu.py, `activation_offloading` for it; which saved tensors move is
      Transformer Engine's, by its release); the embedding is outside the block.
      TransformerConfig.__post_init__ (megatron/core/transformer/transformer_config.py)
      requires N < num_layers and refuses pipeline parallelism and recomputation ("CPU
      offloading does not work when activation recomputation is enabled"). ckplan's `offload`
      moves the whole tape of every stage but the last: the embedding's and every layer's.
    - `--fine-grained-activation-offloading --offload-modules ...` (same file): the inputs of
      named submodules (attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1,
      moe_act, fused_group_mlp), not whole tapes nor the inputs a full recomputation keeps.
    """
    if recomputes:
        return (
            "Megatron-LM core_v0.19.0 refuses CPU offloading beside recomputation "
            "(transformer_config.py) and --offload-modules moves submodule inputs, not "
            "checkpointed layer inputs or tapes"
        )
    return (
        "Megatron-LM core_v0.19.0 offloads at most num_layers - 1 layers, never the embedding "
        "(--cpu-offloading-num-layers), or submodule inputs (--offload-modules): not every "
        "layer's and the embedding's tape"
    )


# A scoped policy's regions that are Megatron-Core recompute modules when they keep nothing,
# as ckplan's strategy words: the `recompute_modules` docstring in
# megatron/core/transformer/transformer_config.py (core_v0.19.0) says "core_attn", "mlp", "moe"
# and "shared_experts" use normal checkpointing (a torch checkpoint region); "moe_act",
# "layernorm" and "mla_up_proj" output-discarding checkpointing, which no region is.
SCOPED_MODULES = {"core_attn": "selective", "mlp": "mlp", "moe": "moe",
                  "shared_experts": "shared_experts"}  # fmt: skip


def module_strategy(policy_word: str) -> str | None:
    """The module strategy a scoped policy is exactly (every region a Megatron-Core module,
    nothing kept), or None."""
    policy = parse_policy(policy_word)
    if not policy.scopes or any(kept or name not in SCOPED_MODULES for name, kept in policy.scopes):
        return None
    return "+".join(SCOPED_MODULES[name] for name, _ in policy.scopes)


def reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """Why Megatron-LM cannot run these layer segments on this layout (None: it can)."""
    if spec.kind != "transformer":
        return f"Megatron-LM trains transformers, not model kind {spec.kind!r}"
    if spec.pipeline_schedule == "dualpipe":
        # megatron/core/pipeline_parallel/schedules.py `get_forward_backward_func` at
        # core_v0.19.0 returns the no-pipelining, 1F1B or interleaved 1F1B schedule
        return "pipeline_schedule dualpipe: Megatron-LM runs 1F1B or interleaved 1F1B, no DualPipe"
    if spec.moe_act_input_fp8:
        # moe/experts.py at core_v0.19.0: the moe_act checkpoint keeps the fc1 output as the
        # GEMM returned it (BF16)
        return "moe_act_input_fp8: Megatron-LM keeps the experts' activation input in BF16"
    if spec.moe_dispatch_fp8:
        # moe/fused_a2a.py at core_v0.19.0: the DeepEP dispatch gets the BF16 hidden states,
        # HybridEP asserts "HybridEP dispatcher does not support fp8 dispatch now"
        return "moe_dispatch_fp8: Megatron-LM dispatches the tokens in BF16"
    if spec.overlap_moe_expert_parallel_comm and not layers.modules and not layers.stores_all:
        # transformer_config.py __post_init__ at core_v0.14.0 and core_v0.19.0
        return (
            "overlap_moe_expert_parallel_comm: Megatron-Core asserts 'disable full "
            "recomputation when enabling overlap_moe_expert_parallel_comm'"
        )
    if spec.overlap_moe_expert_parallel_comm and layers.modules and layers.moe == "moe":
        # transformer_config.py __post_init__ at core_v0.19.0
        return (
            "overlap_moe_expert_parallel_comm: Megatron-Core asserts 'disable moe in "
            "recompute_modules when enabling overlap_moe_expert_parallel_comm'"
        )
    if spec.training in ("lora", "qlora"):
        # megatron/training/arguments.py at core_v0.19.0 has no adapter argument (its
        # --q-lora-rank and --kv-lora-rank are MLA's projections); NeMo and Megatron-Bridge add
        # LoRA in their own recipes, outside these flags
        return (
            f"training {spec.training}: Megatron-LM's arguments have no adapters (NeMo and "
            "Megatron-Bridge add LoRA in their recipes); --to peft, torchtune or torch write it"
        )
    if layers.policy:
        same = module_strategy(layers.policy)
        if same:
            return (
                f"the scoped policy {layers.policy} keeps nothing inside its regions, which are "
                f"Megatron-LM's modules: export the strategy {same} (--recompute-modules)"
            )
        return (
            f"the per-op policy {layers.policy}: Megatron-LM recomputes whole layers or the "
            "modules of --recompute-modules, not ops chosen by a policy"
        )
    if spec.zero > 1 and spec.pp > 1:
        return (
            f"zero={spec.zero} with pp {spec.pp}: Megatron-LM shards gradients and weights "
            "through Megatron-FSDP, which ckplan runs without pipeline parallelism"
        )
    if spec.kind == "transformer" and (why := _architecture_reason(spec)):
        return why
    if spec.cp > 1 and spec.seq % (2 * spec.cp):
        return f"seq {spec.seq}: Megatron-LM needs a multiple of 2·cp = {2 * spec.cp}"
    if spec.virtual_stages > 1 and spec.pp == 1:
        return "virtual pipeline stages: Megatron-LM interleaves only with pp > 1"
    if layers.moe == "experts":
        return (
            "recomputing only the routed expert MLPs: Megatron-LM's --recompute-modules has moe "
            "(the whole MoE layer) and moe_act (the activation), no experts-only module"
        )
    discarding = [word for word in layers.extra if word in ("layernorm", "moe_act")]
    if discarding and spec.precision == "fp8" and spec.fp8_recipe == "delayed":
        return (
            f"{discarding[0]} with FP8: Megatron-Core refuses it under delayed scaling "
            "(transformer_config.py core_v0.19.0); fp8_recipe current, mxfp8 or blockwise "
            "allows it"
        )
    if (layers.moe or layers.mlp or layers.extra) and layers.recomputed:
        return (
            "module recomputation together with whole layers: Megatron-LM's --recompute-modules "
            "need the selective granularity, which takes no --recompute-method"
        )
    if layers.stores_all:
        return None
    if layers.selective:
        if layers.recomputed:
            return (
                "selective recomputation together with whole layers: Megatron-LM's selective "
                "granularity takes no --recompute-method"
            )
        return None
    chunk = spec.layers_per_stage // spec.virtual_stages
    size = layers.uniform_size()
    if spec.mtp_layers and size not in (None, 1):
        return (
            f"uniform segments of {size} layers with MTP layers: Megatron-Core recomputes an MTP "
            "layer only with --recompute-num-layers 1 (multi_token_prediction.py, core_v0.14.0)"
        )
    if spec.mtp_layers and size is None and layers.block_count() is not None:
        return (
            "block recomputation with MTP layers: Megatron-Core skips recomputing the MTP layers "
            "under the block method (multi_token_prediction.py, core_v0.14.0)"
        )
    if size is not None and spec.parsed_layout is not None and spec.virtual_stages > 1:
        chunks = sorted({n for k in range(spec.pp) for n in stage_chunk_layers(spec, k) if n})
        if any(n % size for n in chunks):
            return (
                f"uniform segments of {size} layers: Megatron-LM segments each model chunk of "
                f"the pipeline layout ({', '.join(map(str, chunks))} layers), so {size} must "
                "divide each"
            )
        return None
    if size is not None:
        if spec.virtual_stages > 1 and chunk % size:
            return (
                f"uniform segments of {size} layers: with {spec.virtual_stages} virtual stages "
                f"Megatron-LM segments each model chunk of {chunk} layers, so {size} must divide "
                f"{chunk}"
            )
        return None
    if layers.block_count() is not None:
        if spec.virtual_stages > 1:
            return (
                "block recomputation with virtual stages: Megatron-LM recomputes the first "
                "layers of each model chunk, ckplan's block the first layers of the stage"
            )
        return None
    if layers.recomputed and layers.segments[-1][2] is False:
        return (
            "the last segment stored: Megatron-LM's uniform method recomputes every segment "
            "and its block method single layers"
        )
    return (
        f"no Megatron-LM flag recomputes its layer segments {_describe(layers)}: the uniform "
        "method recomputes equal segments from the first layer, the block method the first "
        "layers one by one"
    )


def _architecture_reason(spec: ModelSpec) -> str | None:
    """What of the model's architecture no Megatron-LM flag (core_v0.19.0) expresses."""
    if spec.mlp == "geglu":
        return "mlp geglu: Megatron-LM's gated MLP is SwiGLU (--swiglu); it has no GeGLU flag"
    if spec.post_norms:
        return "post_norms: Megatron-LM's GPT layer has no norms after attention and the MLP"
    if spec.parallel_residual:
        return "parallel_residual: Megatron-LM's GPT layer runs attention and the MLP in sequence"
    if spec.qk_norm and spec.qk_norm_width == "full":
        return (
            "qk_norm_width full: Megatron-LM's --qk-layernorm norms each head on its own; no "
            "flag norms all heads together"
        )
    if spec.precision == "float8":
        return (
            "precision float8 (torchao): Megatron-LM runs FP8 through Transformer Engine, "
            "precision fp8"
        )
    return None


def _describe(layers: LayerSegments) -> str:
    parts = [f"{start}-{end - 1}" for start, end in layers.recomputed]
    shown = ", ".join(parts[:4]) + (", ..." if len(parts) > 4 else "")
    return f"(recomputed: {shown})"


def flags(plan: Plan, layers: LayerSegments, recompute_modules: bool = True) -> list[list[str]]:
    """The flags, one `[flag, value...]` list per flag, in a fixed order."""
    spec = plan.spec
    out = [
        ["--num-layers", str(spec.layers)],
        *([["--mtp-num-layers", str(spec.mtp_layers)]] if spec.mtp_layers else []),
        ["--seq-length", str(spec.seq)],
        ["--micro-batch-size", str(spec.micro_batch)],
        ["--global-batch-size", str(spec.micro_batch * spec.microbatches * spec.dp)],
        ["--tensor-model-parallel-size", str(spec.tp)],
        ["--pipeline-model-parallel-size", str(spec.pp)],
        ["--context-parallel-size", str(spec.cp)],
    ]
    if spec.cp > 1 and spec.cp_attention not in (None, "ring"):
        # Megatron-LM's default is p2p (arguments.py, core_v0.19.0), ckplan's ring
        out.append(["--cp-comm-type", MEGATRON_CP_COMM_TYPES[spec.cp_attention]])
    if spec.cp > 1 and spec.cp_attention == "a2a+p2p":
        # the all-to-all level first, then the ring's (TE's cp_group = [a2a, p2p])
        sizes = [str(spec.cp_a2a_size), str(spec.cp // spec.cp_a2a_size)]
        out.append(["--hierarchical-context-parallel-sizes", *sizes])
    uneven = spec.first_stage_layers is not None or spec.last_stage_layers is not None
    if spec.first_stage_layers is not None:
        out.append(["--decoder-first-pipeline-num-layers", str(spec.first_stage_layers)])
    if spec.last_stage_layers is not None:
        out.append(["--decoder-last-pipeline-num-layers", str(spec.last_stage_layers)])
    if spec.account_for_embedding_in_pipeline_split:
        out.append(["--account-for-embedding-in-pipeline-split"])
    if spec.account_for_loss_in_pipeline_split:
        out.append(["--account-for-loss-in-pipeline-split"])
    if spec.pipeline_layout is not None:
        # it fixes the virtual stages and every stage's layers: Megatron-Core takes no
        # --num-virtual-stages-per-pipeline-rank, --num-layers-per-virtual-pipeline-stage,
        # --decoder-first/last-pipeline-num-layers or --account-for-*-in-pipeline-split
        # beside it (validate_args and TransformerConfig.__post_init__, core_v0.19.0)
        out.append(["--pipeline-model-parallel-layout", spec.pipeline_layout])
        if spec.microbatch_group_size is not None:
            group = str(spec.microbatch_group_size)
            out.append(["--microbatch-group-size-per-virtual-pipeline-stage", group])
    elif spec.virtual_stages > 1:
        if uneven or _accounted(spec):
            out.append(["--num-virtual-stages-per-pipeline-rank", str(spec.virtual_stages)])
        else:
            chunk = spec.layers_per_stage // spec.virtual_stages
            out.append(["--num-layers-per-virtual-pipeline-stage", str(chunk)])
        if spec.microbatch_group_size is not None:  # Megatron's default is pp, as ckplan's
            group = str(spec.microbatch_group_size)
            out.append(["--microbatch-group-size-per-virtual-pipeline-stage", group])
    if spec.sp:
        out.append(["--sequence-parallel"])
    if spec.zero == 1:
        out.append(["--use-distributed-optimizer"])
    elif spec.zero > 1:
        strategy = "optim_grads" if spec.zero == 2 else "optim_grads_params"
        out += [["--use-megatron-fsdp"], ["--data-parallel-sharding-strategy", strategy]]
    if spec.kind == "transformer":
        out += model_flags(spec)
    if layers.modules:
        modules = (
            (["core_attn"] if layers.selective else [])
            + (["mlp"] if layers.mlp else [])
            + ([layers.moe] if layers.moe else [])
            + list(layers.extra)
        )
        out.append(["--recompute-granularity", "selective"])
        if recompute_modules:
            out.append(["--recompute-modules", *modules])
        elif layers.moe and not layers.extra:  # older Megatron-LM: the MoE layer's own switch
            out.append(["--moe-layer-recompute"])
    elif not layers.stores_all:
        size = layers.uniform_size()
        method, count = ("uniform", size) if size is not None else ("block", layers.block_count())
        if spec.virtual_stages > 1 and method == "block":  # reason() refuses it; never reached
            raise AssertionError("block with virtual stages")
        out += [
            ["--recompute-granularity", "full"],
            ["--recompute-method", method],
            ["--recompute-num-layers", str(count)],
        ]
    return out


def _accounted(spec: ModelSpec) -> bool:
    return spec.account_for_embedding_in_pipeline_split or spec.account_for_loss_in_pipeline_split


ATTENTION_BACKENDS = {"flash2": "flash", "flash3": "flash", "cudnn": "fused"}


def model_flags(spec: ModelSpec) -> list[list[str]]:
    """The model, its precision and the runtime switches, as Megatron-LM's flags (module
    docstring)."""
    out = [
        ["--hidden-size", str(spec.hidden)],
        ["--ffn-hidden-size", str(spec.ffn_hidden)],
        ["--num-attention-heads", str(spec.heads)],
    ]
    if spec.kv_heads != spec.heads:
        out += [["--group-query-attention"], ["--num-query-groups", str(spec.kv_heads)]]
    if spec.head_dim * spec.heads != spec.hidden:
        out.append(["--kv-channels", str(spec.head_dim)])
    out.append(["--max-position-embeddings", str(spec.seq)])
    positions = "rope" if spec.positions == "rope" else "learned_absolute"
    out.append(["--position-embedding-type", positions])
    out.append(["--normalization", "RMSNorm" if spec.norm == "rmsnorm" else "LayerNorm"])
    if spec.mlp == "swiglu":
        out.append(["--swiglu"])
    if not spec.bias:
        out.append(["--disable-bias-linear"])
        if spec.qkv_bias:
            out.append(["--add-qkv-bias"])
    if spec.qk_norm:
        out.append(["--qk-layernorm"])
    if spec.attention_sinks:
        # a learned logit per head in every softmax (dot_product_attention.py and
        # transformer_engine.py, core_v0.19.0: softmax_offset)
        out.append(["--softmax-type", "learnable"])
    if not spec.tied_embeddings:
        out.append(["--untie-embeddings-and-output-weights"])
    dropout = f"{spec.dropout:g}"
    out += [["--attention-dropout", dropout], ["--hidden-dropout", dropout]]
    if spec.sliding_window:
        out.append(["--window-size", f"{spec.sliding_window},0"])  # tuple_type reads "W,0"
        if spec.sliding_window_layers != "all":
            # 1 a windowed layer, 0 full attention (transformer/utils.py core_v0.19.0,
            # is_layer_window_attention: `window_attn_skip_freq[layer_number - 1]`)
            windowed = parse_layer_set(spec.sliding_window_layers, spec.layers)
            out.append(["--window-attn-skip-freq", layer_pattern(windowed, spec.layers)])
    if spec.mla:
        out.append(["--multi-latent-attention"])
        if spec.q_lora_rank:
            out.append(["--q-lora-rank", str(spec.q_lora_rank)])
        out += [
            ["--kv-lora-rank", str(spec.kv_lora_rank)],
            ["--qk-head-dim", str(spec.qk_nope_head_dim)],
            ["--qk-pos-emb-head-dim", str(spec.qk_rope_head_dim)],
            ["--v-head-dim", str(spec.v_head_dim)],
        ]
    if spec.experts:
        out += _moe_flags(spec)
    out += _precision_flags(spec)
    if spec.attention == "standard":
        out.append(["--attention-backend", "unfused"])
    else:
        out.append(["--attention-backend", ATTENTION_BACKENDS.get(spec.attention_kernel, "auto")])
    # Megatron-LM's arguments.py (core_v0.14.0) asserts --overlap-param-gather "with
    # --overlap-grad-reduce": a gather overlapped beside an exposed reduction has no flags
    if spec.overlap_grad_reduce and spec.dp > 1:
        out.append(["--overlap-grad-reduce"])
        if spec.zero == 1 and spec.overlap_param_gather:
            out.append(["--overlap-param-gather"])
    if spec.tp_comm_overlap and spec.sp:
        out.append(["--tp-comm-overlap"])
    return out


def _moe_flags(spec: ModelSpec) -> list[list[str]]:
    out = [
        ["--num-experts", str(spec.experts)],
        ["--moe-router-topk", str(spec.top_k)],
        ["--moe-ffn-hidden-size", str(spec.moe_ffn_hidden)],
        ["--moe-layer-freq", moe_layer_pattern(spec)],
        ["--moe-grouped-gemm"],
        ["--expert-model-parallel-size", str(spec.ep)],
        ["--expert-tensor-parallel-size", str(spec.etp)],
    ]
    if spec.shared_experts:
        out.append(["--moe-shared-expert-intermediate-size", str(spec.shared_ffn_hidden)])
        if spec.shared_expert_gate:
            out.append(["--moe-shared-expert-gate"])
    if spec.expert_bias:
        out.append(["--moe-router-enable-expert-bias"])
    if spec.capacity_factor:
        out += [
            ["--moe-expert-capacity-factor", f"{spec.capacity_factor:g}"],
            ["--moe-pad-expert-input-to-capacity"],
        ]
    if spec.moe_router_num_groups:
        # transformer_config.py at core_v0.19.0: moe_router_num_groups, moe_router_group_topk
        out += [
            ["--moe-router-num-groups", str(spec.moe_router_num_groups)],
            ["--moe-router-group-topk", str(spec.moe_router_group_topk)],
        ]
    if spec.moe_token_dispatcher_type == "flex":
        # moe_token_dispatcher_type 'flex', its backend DeepEP by default (core_v0.19.0)
        out.append(["--moe-token-dispatcher-type", "flex"])
    if spec.overlap_moe_expert_parallel_comm:
        # megatron/training/arguments.py at core_v0.14.0 and core_v0.19.0: the combined 1F1B
        # (pipeline_parallel/combined_1f1b.py)
        out.append(["--overlap-moe-expert-parallel-comm"])
    if spec.moe_permute_fusion:
        out.append(["--moe-permute-fusion"])
    if spec.moe_router_fusion:
        out.append(["--moe-router-fusion"])
    return out


def moe_layer_pattern(spec: ModelSpec) -> str:
    """The MoE layers as Megatron-LM's `--moe-layer-freq` list expression: DeepSeek-V3's
    three dense layers first are "[0]*3+[1]*58" (`layer_pattern`)."""
    return layer_pattern(parse_layer_set(spec.moe_layers, spec.layers), spec.layers)


def layer_pattern(chosen: Collection[int], layers: int) -> str:
    """A 1 for each layer in `chosen` (0-based), a 0 for the others, as the list expression
    Megatron-LM's moe_freq_type evaluates for `--moe-layer-freq` and `--window-attn-skip-freq`
    (any text with a `[`), run-length coded and without parentheses, so that a shell reads it
    bare: gpt-oss's windows on the even layers of 24 are "[1]*1+[0]*1+..."."""
    flags = [1 if layer in chosen else 0 for layer in range(layers)]
    runs = [(flag, len(list(group))) for flag, group in groupby(flags)]
    return "+".join(f"[{flag}]*{count}" for flag, count in runs)


def _precision_flags(spec: ModelSpec) -> list[list[str]]:
    """--fp16, --bf16 (with FP8's flags), or none: without either flag Megatron-LM trains in
    fp32 (megatron/training/arguments.py, core_v0.19.0: params_dtype stays torch.float)."""
    if spec.precision == "fp32":
        return []
    if spec.precision == "fp16":
        return [["--fp16"]]
    if spec.precision == "fp8":
        flags = [["--bf16"], ["--fp8-format", "hybrid"]]
        if spec.fp8_recipe != "delayed":  # Megatron-LM's default (arguments.py core_v0.19.0)
            flags.append(["--fp8-recipe", MEGATRON_FP8_RECIPES[spec.fp8_recipe]])
        if spec.fp8_param_gather:  # beside --use-distributed-optimizer (zero 1)
            flags.append(["--fp8-param-gather"])
        return flags
    return [["--bf16"]]


# ckplan's fp8_recipe as Megatron-LM's --fp8-recipe names it (megatron/training/arguments.py,
# core_v0.19.0: choices tensorwise, delayed, mxfp8, blockwise, custom; `tensorwise` builds
# Transformer Engine's Float8CurrentScaling, `blockwise` its Float8BlockScaling with TE 2.3+,
# megatron/core/fp8_utils.py core_v0.15.3; Megatron-Bridge v0.6.0 mixed_precision.py
# `bf16_with_fp8_subchannel_scaling_mixed`: fp8 "hybrid", fp8_recipe "blockwise")
MEGATRON_FP8_RECIPES = {
    "delayed": "delayed",
    "current": "tensorwise",
    "mxfp8": "mxfp8",
    "blockwise": "blockwise",
}


def render(plan: Plan, layers: LayerSegments, recompute_modules: bool = True) -> str:
    """One flag per line (`$(ckplan export ...)` splits them into words)."""
    lines = (" ".join(map(_word, flag)) for flag in flags(plan, layers, recompute_modules))
    return "\n".join(lines) + "\n"


def _word(word: str) -> str:
    """A word as the shell reads it both ways it is used: pasted into a script, and unquoted
    from `$(ckplan export ...)`, which splits on blanks but removes no quotes. So a word is
    quoted only where it must be (a blank, a quote or a shell operator in it); `--moe-layer-freq`'s
    pattern `[0]*3+[1]*58` stays bare: as a glob it matches no file, so the shell keeps it."""
    return shlex.quote(word) if re.search(r"[\s'\"\\$`;&|<>()]", word) else word


def notes(plan: Plan, layers: LayerSegments) -> list[str]:
    spec = plan.spec
    gpus = spec.tp * spec.pp * spec.cp * spec.dp
    lines = [
        f"launch on {gpus} GPU{'s' if gpus > 1 else ''}: data-parallel size {spec.dp} = "
        "world size / (tp·pp·cp)",
    ]
    if layers.stores_all and not layers.modules:
        lines.append("no recompute flags: the plan stores every activation")
    if spec.kind == "transformer" and spec.vocab:
        lines.append(
            f"vocabulary {spec.vocab:,}: set by your tokenizer (--tokenizer-type ...); "
            "Megatron-LM pads it to a multiple of --make-vocab-size-divisible-by (128) x tp"
        )
    if spec.framework != "megatron":
        lines.append(
            f"the model names framework {spec.framework}; these are Megatron-LM's flags for it"
        )
    if spec.pipeline_layout is not None:
        lines.append(
            "--pipeline-model-parallel-layout is quoted for a script (its | and parentheses are "
            "shell operators); Megatron-Core reads it from core_v0.13.0, MTP layers (m) in it "
            "from core_v0.14.0"
        )
    return lines


# ---- flags read back ------------------------------------------------------------------------


def parse_flags(text: str) -> dict[str, list[str]]:
    """`--flag value...` words into {flag: [values]} (a bare switch maps to [])."""
    parsed: dict[str, list[str]] = {}
    current = None
    for word in shlex.split(text):
        if word.startswith("--"):
            current = word
            parsed[current] = []
        elif current is None:
            raise ValueError(f"value {word!r} before any flag")
        else:
            parsed[current].append(word)
    return parsed


def strategy_from_flags(parsed: dict[str, list[str]]) -> str:
    """The ckplan strategy that Megatron-LM flags select (per pipeline stage, no interleaving
    shift): none, selective, mlp, moe and their + combinations, uniform:K or block:N."""
    granularity = parsed.get("--recompute-granularity", [None])[0]
    if granularity is None:
        return "moe" if "--moe-layer-recompute" in parsed else "none"
    if granularity == "selective":
        modules = parsed.get("--recompute-modules", ["core_attn"])
        moe = "moe" in modules or "--moe-layer-recompute" in parsed
        names = (
            (["selective"] if "core_attn" in modules else [])
            + (["mlp"] if "mlp" in modules else [])
            + (["moe"] if moe else [])
            + [word for word in MODULES if word in modules]
        )
        return "+".join(names) or "none"
    method = parsed["--recompute-method"][0]
    count = int(parsed["--recompute-num-layers"][0])
    return f"{method}:{count}"
