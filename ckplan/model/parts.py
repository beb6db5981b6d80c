"""The parts of a model description, each its own frozen record.

A run is described by what the network is (`Architecture`), the shape of one micro-batch
(`RunShape`), how one model replica is split over GPUs (`Parallelism`), how replicas share the
work (`DataParallel`) and what each parameter costs in memory (`TrainingState`). Users write
them as one flat YAML mapping (README, docs/models.md); `ckplan.model.spec` validates the mapping
into these records. Consumers take only the parts they depend on: one GPU's op table and chain
depend on the architecture, the run shape and the parallelism (`ChainSpec`), never on dp, ZeRO or
the micro-batch count, so layouts that differ only there share them.

Each record resolves its own defaults that derive from its own keys (kv_heads = heads,
ffn_hidden = 4h, head_dim = h / a, etp = tp, ...) after checking the ranges those defaults divide
by; rules across keys and parts are `ckplan.model.spec`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckplan.errors import InputError
from ckplan.model.context_parallel import CP_ATTENTIONS
from ckplan.model.frameworks import (
    BACKWARD_PREFETCHES,
    FSDP_REDUCE_DTYPES,
    GRAD_SYNCS,
    OFFLOAD_DEVICES,
    OPTIMIZER_IMPLEMENTATIONS,
    ZERO_GRADS,
)
from ckplan.model.optimizers import OPTIMIZERS
from ckplan.model.pipeline_layout import LayoutError, PipelineLayout, parse_layout
from ckplan.quoting import quote


class SpecError(InputError):
    """Invalid model description; the message is one line and names the offending key."""


# The documented range of every size key (docs/models.md "Ranges"). Generous: a model 100x larger
# than any trained today fits (today's largest: ~130 layers, hidden 25,600, FFN 73,728, 160 heads,
# vocab 262k, contexts of 10M tokens, ~100k GPUs), and a typo beyond it is an error instead of a
# minutes-long run or an exhausted memory. vocab and zero may be 0.
SIZE_RANGES: dict[str, tuple[int, int]] = {
    "layers": (1, 100_000),
    "hidden": (1, 2**20),
    "seq": (1, 2**24),
    "micro_batch": (1, 2**20),
    "heads": (1, 2**16),
    "kv_heads": (1, 2**16),
    "ffn_hidden": (1, 2**22),
    "vocab": (0, 2**24),
    "dtype_bytes": (1, 8),
    "tp": (1, 2**16),
    "pp": (1, 2**16),
    "cp": (1, 2**20),
    "cp_a2a_size": (1, 2**20),
    "dp": (1, 2**24),
    "zero": (0, 3),
    "virtual_stages": (1, 2**16),
    "microbatches": (1, 2**20),
    "microbatch_group_size": (1, 2**20),
    "mlp_tiles": (1, 2**20),
    "weight_bytes": (0, 64),
    "grad_bytes": (0, 64),
    "master_bytes": (0, 64),
    "optimizer_bytes": (0, 64),
    # mixed layers, MoE, MLA, sliding window (0: not used, where the key allows it)
    "head_dim": (1, 2**16),
    "sliding_window": (0, 2**24),
    "experts": (0, 2**20),
    "top_k": (1, 2**16),
    "moe_ffn_hidden": (1, 2**22),
    "shared_experts": (0, 2**16),
    "shared_ffn_hidden": (0, 2**22),
    "ep": (1, 2**20),
    "etp": (1, 2**16),
    "q_lora_rank": (0, 2**20),
    "kv_lora_rank": (0, 2**20),
    "qk_nope_head_dim": (0, 2**16),
    "qk_rope_head_dim": (0, 2**16),
    "v_head_dim": (0, 2**16),
    "mtp_layers": (0, 64),
    "first_stage_layers": (1, 99_999),  # the other stages hold at least one layer
    "last_stage_layers": (1, 99_999),
    "lora_rank": (1, 2**20),
    "moe_router_num_groups": (0, 2**20),
    "moe_router_group_topk": (0, 2**20),
    "fsdp_version": (1, 2),  # PyTorch's FullyShardedDataParallel (1) or fully_shard (2)
}


def check_ranges(record: Any) -> None:
    """Every size key of `record` inside its documented range (before anything divides by it)."""
    for field in dataclasses.fields(record):
        limits = SIZE_RANGES.get(field.name)
        value = getattr(record, field.name)
        if limits is None or value is None:  # not a size, or a nullable key left to its default
            continue
        low, high = limits
        key = field.name
        range_error(key, value, low, high)


def range_error(key: str, value: int, low: int, high: int) -> None:
    """SpecError when `value` is outside `low..high` (zero's own check says 0-3)."""
    if value < low and low == 1:
        raise SpecError(key=key, rule="must be a positive integer", value=value)
    if value < low:
        raise SpecError(key=key, rule=f"must be >= {low}", value=value)
    if value > high and key != "zero":
        raise SpecError(key=key, rule=f"must be in {low:,}..{high:,}", value=value)


def cached_hash(record: Any) -> int:
    """The hash of a frozen dataclass over its fields, computed once: records are cache keys
    hashed on every lookup."""
    cached = record.__dict__.get("_hash")
    if cached is None:
        cached = hash(tuple(getattr(record, f.name) for f in dataclasses.fields(record)))
        object.__setattr__(record, "_hash", cached)
    return cached


class _Record:
    """Frozen records used as cache keys: the hash is computed once."""

    def __hash__(self) -> int:
        return cached_hash(self)

    def _derive(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)


@dataclass(frozen=True, eq=True)
class Architecture(_Record):
    """What the network is: its layers, widths, attention, MLP and experts."""

    layers: int  # L
    hidden: int  # h (kind mlp: the width d)
    heads: int = 1  # a
    kv_heads: int | None = None  # g; None -> heads
    ffn_hidden: int | None = None  # F; None -> 4h
    vocab: int = 0  # V; 0 -> no embedding/output layer in the chain
    kind: str = "transformer"  # transformer | mlp (the NumPy MLP that `ckplan verify` runs)
    norm: str = "layernorm"
    mlp: str = "gelu"
    attention: str = "standard"
    positions: str = "learned"
    bias: bool = True
    dropout: float = 0.0
    tied_embeddings: bool = False
    fused_swiglu: bool = True  # Megatron's bias_swiglu saves fc1 output, not silu(gate) too
    # attention details of the Hugging Face families (docs/architectures.md)
    head_dim: int | None = None  # d; None -> h / a (Gemma, Qwen3: a·d != h)
    qkv_bias: bool | None = None  # biases on Q, K, V only (Qwen2); None -> bias
    qk_norm: bool = False  # RMSNorm on each head of Q and K (Qwen3, Gemma 3)
    # the QK-norms' span: each head on its own (head) or all of Q's and all of K's heads as one
    # vector (full: OLMo 2's q_norm over a·d, k_norm over g·d)
    qk_norm_width: str = "head"
    post_norms: bool = False  # norms after attention and MLP too (Gemma 2/3)
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX)
    # a learned logit per head that joins each softmax row and takes no value (gpt-oss;
    # Megatron-Core's softmax_type learnable)
    attention_sinks: bool = False
    # sliding-window attention: the window in tokens (0 = none) and the layers that use it
    sliding_window: int = 0
    sliding_window_layers: str = "all"  # a layer set (ckplan.model.layers)
    # multi-head latent attention (DeepSeek-V2/V3), on when kv_lora_rank > 0
    q_lora_rank: int = 0  # 0: Q projected directly from h
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # mixture of experts, on when experts > 0 (Megatron-LM's names in comments)
    experts: int = 0  # --num-experts
    top_k: int = 2  # --moe-router-topk
    moe_ffn_hidden: int | None = None  # --moe-ffn-hidden-size; None -> ffn_hidden
    shared_experts: int = 0
    shared_ffn_hidden: int | None = None  # all shared experts; None -> shared_experts·F_e
    shared_expert_gate: bool = False  # sigmoid gate on the shared experts (Qwen2-MoE)
    expert_bias: bool = False  # per-expert routing bias (DeepSeek-V3 aux-loss-free balancing)
    capacity_factor: float = 0.0  # --moe-expert-capacity-factor, padded; 0 = dropless
    # group-limited routing (Megatron-Core transformer_config.py core_v0.19.0,
    # `moe_router_num_groups`, `moe_router_group_topk`): the experts in this many equal groups,
    # each token choosing its top_k experts inside its best group_topk groups; 0: no limit.
    # DeepSeek-V3's node-limited routing (report §2.1.2, HF config n_group 8, topk_group 4)
    moe_router_num_groups: int = 0
    moe_router_group_topk: int = 0
    moe_layers: str = "all"  # a layer set; --moe-layer-freq N is 0-:N
    # multi-token prediction depths (DeepSeek-V3 §2.2; Megatron's --mtp-num-layers), each a
    # transformer block and a 2h-to-h projection on the stage with the loss (ckplan.model.mtp)
    mtp_layers: int = 0

    __hash__ = _Record.__hash__

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self._derive("kv_heads", self.heads)
        check_ranges(self)
        if self.ffn_hidden is None:
            self._derive("ffn_hidden", 4 * self.hidden)
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise SpecError(
                    f"key 'heads' ({self.heads}) must divide hidden ({self.hidden}), "
                    "or give head_dim"
                )
            self._derive("head_dim", self.hidden // self.heads)
        if self.qkv_bias is None:
            self._derive("qkv_bias", self.bias)
        if self.moe_ffn_hidden is None:
            self._derive("moe_ffn_hidden", self.ffn_hidden)
        if self.shared_ffn_hidden is None:
            self._derive("shared_ffn_hidden", self.shared_experts * self.moe_ffn_hidden)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 §2.1), on when kv_lora_rank > 0."""
        return self.kv_lora_rank > 0

    def derived_defaults(self) -> dict[str, Any]:
        """The keys whose default derives from other keys, at the value it would derive to."""
        return {
            "head_dim": self.hidden // self.heads,
            "qkv_bias": self.bias,
            "moe_ffn_hidden": self.ffn_hidden,
            "shared_ffn_hidden": self.shared_experts * self.moe_ffn_hidden,
        }


@dataclass(frozen=True, eq=True)
class RunShape(_Record):
    """One micro-batch as one model replica sees it: tokens, rows, the activation dtype, and how
    evenly a mixture of experts routes them."""

    seq: int  # s (kind mlp: unused, 1)
    micro_batch: int  # b (kind mlp: rows per step)
    dtype_bytes: int = 2  # B: bytes per activation value
    moe_imbalance: str = "average"  # average | worst | a factor >= 1 (tokens on the busiest rank)

    __hash__ = _Record.__hash__

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass(frozen=True, eq=True)
class Parallelism(_Record):
    """How one model replica is split over GPUs: what one GPU's layers, ops and chain depend on."""

    tp: int = 1
    pp: int = 1
    sp: bool = False
    cp: int = 1
    virtual_stages: int = 1
    ep: int = 1  # --expert-model-parallel-size
    etp: int | None = None  # --expert-tensor-parallel-size; None -> tp (Megatron's default)
    # uneven pipelines: layers of the first / last stage (Megatron's
    # --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers); the other
    # stages share the rest evenly. None: L/p on every stage.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    # Megatron's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-
    # split: the embedding (the loss) counts as one layer when the L (+1, +2) layers are split
    # over the p stages, so the first (last) stage holds one transformer layer fewer
    # (Llama 3's 126 layers over p 16: 7, 8 x 14, 7).
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Megatron-Core's --pipeline-model-parallel-layout (ckplan.model.pipeline_layout): the
    # items of every (pipeline stage, virtual chunk); it sets virtual_stages (chunks / pp).
    pipeline_layout: str | None = None
    # the pipeline schedule: 1f1b (Megatron's 1F1B, interleaved with virtual_stages > 1) or
    # dualpipe (DeepSeek-V3 §3.2.1: each rank holds stage r and stage p - 1 - r and runs
    # micro-batches from both ends; ckplan.model.memory.rank_stages)
    pipeline_schedule: str = "1f1b"
    # how the attention runs under cp > 1: ring (PyTorch's ring attention, Transformer
    # Engine's p2p), allgather (K and V all-gathered, one kernel call), a2a (Ulysses'
    # all-to-alls) or a2a+p2p (both, Megatron-Core); None -> ring
    # (ckplan.model.context_parallel)
    cp_attention: str | None = None
    # a2a+p2p's all-to-all groups' size, the first of Megatron's
    # --hierarchical-context-parallel-sizes (the ring runs over cp / cp_a2a_size)
    cp_a2a_size: int | None = None

    __hash__ = _Record.__hash__

    def __post_init__(self) -> None:
        if self.etp is None:
            self._derive("etp", self.tp)
        check_ranges(self)
        if self.cp_attention is not None and self.cp_attention not in CP_ATTENTIONS:
            rule = f"must be one of {', '.join(CP_ATTENTIONS)}"
            raise SpecError(key="cp_attention", rule=rule, value=self.cp_attention)
        if self.pipeline_layout is not None:
            detected = self.parsed_layout.virtual_stages
            high = SIZE_RANGES["virtual_stages"][1]
            if detected > high:
                raise SpecError(
                    f"key 'pipeline_layout' gives {detected:,} virtual stages per pipeline "
                    f"stage; at most {high:,} are accepted (virtual_stages' range)"
                )
            if self.virtual_stages not in (1, detected):
                raise SpecError(
                    f"key 'virtual_stages' ({self.virtual_stages}) conflicts with "
                    f"pipeline_layout, whose {detected * self.pp} chunks over pp ({self.pp}) "
                    f"give {detected} virtual stages"
                )
            self._derive("virtual_stages", detected)

    @property
    def parsed_layout(self) -> PipelineLayout | None:
        """The parsed pipeline_layout (None without one); SpecError naming the key when
        Megatron-Core would refuse its syntax or its chunk count."""
        if self.pipeline_layout is None:
            return None
        try:
            return parse_layout(self.pipeline_layout, self.pp)
        except LayoutError as error:
            raise SpecError(
                f"key 'pipeline_layout' ({quote(self.pipeline_layout)}) {error}"
            ) from None

    @property
    def pipeline_split_extras(self) -> tuple[int, int]:
        """(embedding, loss): 1 where Megatron counts it as a layer of the pipeline split."""
        return (
            int(self.account_for_embedding_in_pipeline_split),
            int(self.account_for_loss_in_pipeline_split),
        )

    def stage_layer_counts(self, layers: int) -> tuple[int, ...]:
        """Layers of each pipeline stage: L/p each, or first_stage_layers, last_stage_layers
        and the rest split evenly over the stages between (Megatron-LM's uneven split), or the
        decoder layers (t) pipeline_layout places on each stage."""
        p = self.pp
        if self.parsed_layout is not None:
            return tuple(sum(self.parsed_layout.chunk_counts(stage)) for stage in range(p))
        if self.first_stage_layers is None and self.last_stage_layers is None:
            embedding, loss = self.pipeline_split_extras
            each = (layers + embedding + loss) // p
            return (each - embedding, *(each,) * (p - 2), each - loss) if p > 1 else (each,)
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = p - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        each = rest // middle_stages if middle_stages else 0
        counts = [each] * p
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return tuple(counts)


@dataclass(frozen=True, eq=True)
class DataParallel(_Record):
    """How model replicas share the work of an iteration: their number, how they shard the
    model states (ZeRO stage), and the micro-batches each pipeline runs per iteration."""

    dp: int = 1
    zero: int = 0
    microbatches: int = 1  # per iteration per pipeline
    # interleaved pipelines: micro-batches each virtual stage runs back to back (Megatron's
    # --microbatch-group-size-per-virtual-pipeline-stage, the Llama 3 paper's N);
    # None -> pp, Megatron's default (ckplan.model.spec.ModelSpec.microbatch_group)
    microbatch_group_size: int | None = None
    # when the gradients are reduced under gradient accumulation (framework hf):
    # micro_batch | step; None -> the framework's (ckplan.model.frameworks.gradient_sync)
    grad_sync: str | None = None

    __hash__ = _Record.__hash__

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.grad_sync is not None and self.grad_sync not in GRAD_SYNCS:
            rule = f"must be one of {', '.join(GRAD_SYNCS)}"
            raise SpecError(key="grad_sync", rule=rule, value=self.grad_sync)


@dataclass(frozen=True, eq=True)
class TrainingState(_Record):
    """What each parameter costs in memory beside the activations, bytes per parameter
    (Megatron-LM's mixed-precision Adam: 2 + 4 + 4 + 4 + 4)."""

    weight_bytes: int = 2
    grad_bytes: int = 4
    master_bytes: int = 4
    optimizer_bytes: int = 8
    optimizer: str = "adamw"  # ckplan.model.optimizers.OPTIMIZERS
    optimizer_in_backward: bool = False  # step each parameter in backward, free its gradient
    # torch.optim.AdamW's code path: fused | foreach; None -> the framework's
    # (ckplan.model.frameworks `optimizer_implementation`)
    optimizer_implementation: str | None = None
    # what zero_grad leaves between steps: none (set_to_none=True, PyTorch's default since 2.0)
    # | zeros (set_to_none=False, the default before 2.0: every gradient held all step)
    zero_grad: str = "none"
    # model states in host memory (ckplan.model.frameworks.state_offload_error): the fp32
    # master weights, optimizer states and gradients, the step on the CPU; and the weights
    optimizer_offload: str = "none"  # none | cpu
    param_offload: str = "none"  # none | cpu

    __hash__ = _Record.__hash__

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.optimizer not in OPTIMIZERS:
            rule = f"must be one of {', '.join(OPTIMIZERS)}"
            raise SpecError(key="optimizer", rule=rule, value=self.optimizer)
        implementation = self.optimizer_implementation
        if implementation is not None and implementation not in OPTIMIZER_IMPLEMENTATIONS:
            rule = f"must be one of {', '.join(OPTIMIZER_IMPLEMENTATIONS)}"
            raise SpecError(key="optimizer_implementation", rule=rule, value=implementation)
        if self.zero_grad not in ZERO_GRADS:
            rule = f"must be one of {', '.join(ZERO_GRADS)}"
            raise SpecError(key="zero_grad", rule=rule, value=self.zero_grad)
        if self.zero_grad == "zeros" and self.optimizer_in_backward:
            raise SpecError(
                "key 'zero_grad' (zeros) conflicts with optimizer_in_backward, whose hooks free "
                "each gradient after its step; use zero_grad: none"
            )
        for key in ("optimizer_offload", "param_offload"):
            if getattr(self, key) not in OFFLOAD_DEVICES:
                rule = f"must be one of {', '.join(OFFLOAD_DEVICES)}"
                raise SpecError(key=key, rule=rule, value=getattr(self, key))


TRAININGS = ("full", "frozen", "lora", "qlora")
RELEASE = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}")  # bitsandbytes_version: 0.43.0
WEIGHT_FORMATS = ("bf16", "fp16", "fp32", "nf4", "fp4", "int8")
# PEFT's module names of a Llama-style layer, in layer order (peft/utils/constants.py at v0.17.0)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"
# PEFT's default for Llama (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"])
DEFAULT_LORA_TARGETS = "q_proj,v_proj"


@dataclass(frozen=True, eq=True)
class FineTuning(_Record):
    """Which weights train: all of them (`full`), none of the layers' (`frozen`: the base model
    frozen, e.g. a linear probe beyond it), or low-rank adapters beside frozen linear layers
    (LoRA, Hu et al. 2021; QLoRA over 4-bit weights, Dettmers et al. 2023). Its keys change
    what each linear layer saves for backward, so one GPU's op table depends on it."""

    training: str = "full"  # full | frozen | lora | qlora
    lora_rank: int = 16  # r
    lora_alpha: float | None = None  # the scaling alpha/r: no effect on memory or FLOPs
    lora_targets: str = DEFAULT_LORA_TARGETS  # PEFT module names, comma-separated, or all-linear
    lora_dropout: float = 0.0  # PEFT's lora_dropout (nn.Dropout on each adapter's input)
    use_dora: bool = False  # PEFT's use_dora: DoRA's magnitude vector and weight norm per adapter
    weight_format: str | None = None  # the frozen linear weights; None -> nf4 for qlora, else
    # weight_bytes
    # the bitsandbytes release running the 4-bit layers (its autograd function's saved input);
    # None: a current one (ckplan.model.finetune `matmul_4bit_keeps_input`)
    bitsandbytes_version: str | None = None

    __hash__ = _Record.__hash__

    def __post_init__(self) -> None:
        check_ranges(self)
        for key, allowed in (("training", TRAININGS), ("weight_format", WEIGHT_FORMATS)):
            value = getattr(self, key)
            if value is not None and value not in allowed:
                raise SpecError(key=key, rule=f"must be one of {', '.join(allowed)}", value=value)
        if not 0.0 <= self.lora_dropout < 1.0:
            raise SpecError(key="lora_dropout", rule="must be in [0, 1)", value=self.lora_dropout)
        version = self.bitsandbytes_version
        if version is not None and not RELEASE.fullmatch(version):
            raise SpecError(
                key="bitsandbytes_version", rule="expects a release such as 0.43.0", value=version
            )
        if self.lora_alpha is not None and not 0.0 < self.lora_alpha <= 1e9:
            raise SpecError(key="lora_alpha", rule="must be > 0", value=self.lora_alpha)
        self._derive("lora_targets", _targets(self.lora_targets))
        if self.weight_format is None and self.training == "qlora":
            self._derive("weight_format", "nf4")

    @property
    def adapters(self) -> tuple[str, ...]:
        """The targeted PEFT module names, in layer order; none without LoRA."""
        if self.training not in ("lora", "qlora"):
            return ()
        if self.lora_targets == ALL_LINEAR:
            return LORA_TARGETS
        return tuple(self.lora_targets.split(","))

    def derived_defaults(self) -> dict[str, Any]:
        return {"weight_format": "nf4" if self.training == "qlora" else None}


def _targets(text: str) -> str:
    """lora_targets in one spelling: all-linear, or known names in layer order, once each."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if [name.lower() for name in names] == [ALL_LINEAR]:
        return ALL_LINEAR
    unknown = [name for name in names if name not in LORA_TARGETS]
    if unknown or not names:
        raise SpecError(
            key="lora_targets",
            rule=f"must be {ALL_LINEAR} or names from {', '.join(LORA_TARGETS)}",
            value=text,
        )
    return ",".join(name for name in LORA_TARGETS if name in names)


FRAMEWORKS = ("megatron", "torchtitan", "deepspeed", "hf")
KERNELS = ("fused", "eager", "compiled")
ATTENTION_KERNELS = ("flash2", "flash3", "cudnn", "triton", "sdpa")
PRECISIONS = ("bf16", "fp16", "fp8", "float8", "fp32")
# Full-fp32 training (`precision: fp32`): weights, gradients and activations are fp32 and no
# master copy is kept, since the weights the optimizer updates are already fp32 (PyTorch trains
# in the parameters' dtype unless autocast or a framework's mixed-precision flag says otherwise:
# the Hugging Face Trainer without --fp16/--bf16, Megatron-LM without --fp16/--bf16, whose
# params_dtype stays torch.float). The optimizer keeps its own states (AdamW's 8 bytes).
FP32_BYTES_PER_VALUE = 4
FP32_DEFAULTS: dict[str, int] = {
    "dtype_bytes": FP32_BYTES_PER_VALUE,
    "weight_bytes": FP32_BYTES_PER_VALUE,
    "grad_bytes": FP32_BYTES_PER_VALUE,
    "master_bytes": 0,
}
# Transformer Engine's FP8 scaling recipes that ckplan models (`fp8_recipe`, precision fp8 only;
# ckplan.hardware.code_path): DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling and
# Float8BlockScaling (NVIDIA/TransformerEngine v2.9 transformer_engine/common/recipe/
# __init__.py), as Megatron-LM's --fp8-recipe names them delayed, tensorwise, mxfp8 and
# blockwise (megatron/training/arguments.py, core_v0.15.3). NVFP4BlockScaling is not modelled.
FP8_RECIPES = ("delayed", "current", "mxfp8", "blockwise")
# Megatron-LM's --fp8-recipe default (megatron/training/arguments.py, core_v0.15.3 and
# core_v0.19.0: default='delayed'); Transformer Engine itself picks DelayedScaling on Hopper
# when no recipe is passed (v2.9 transformer_engine/pytorch/quantization.py,
# `get_default_fp8_recipe`), MXFP8BlockScaling on Blackwell.
DEFAULT_FP8_RECIPE = "delayed"
# What each framework does when the model file does not say (docs/frameworks.md): Megatron-LM's
# fused CUDA kernels and TE/flash attention, no DP overlap unless asked (--overlap-grad-reduce is
# off by default); torchtitan's eager PyTorch (torch.compile off by default), FSDP2's prefetch;
# DeepSpeed's overlap_comm; Hugging Face Trainer's eager modules and DDP's bucketed all-reduce.
FRAMEWORK_DEFAULTS: dict[str, dict[str, Any]] = {
    "megatron": {
        "kernels": "fused",
        "dp_comm_overlap": False,
        "loss": "fused",
        "expandable_segments": False,
    },
    # torchtitan's launcher sets PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
    # (run_llama_train.sh at 9dec370, run_train.sh since)
    "torchtitan": {
        "kernels": "eager",
        "dp_comm_overlap": True,
        "loss": "eager",
        "expandable_segments": True,
    },
    "deepspeed": {
        "kernels": "fused",
        "dp_comm_overlap": True,
        "loss": "fused",
        "expandable_segments": False,
    },
    "hf": {
        "kernels": "eager",
        "dp_comm_overlap": True,
        "loss": "eager",
        "expandable_segments": False,
    },
}
MAX_LOSS_CHUNKS = 2**16


def _is_chunked(loss: str) -> bool:
    kind, _, count = loss.partition(":")
    return (
        kind in ("chunked", "chunked-output")
        and count.isascii()
        and count.isdigit()
        and (2 <= int(count[:8]) <= MAX_LOSS_CHUNKS)
    )


def default_attention_kernel(precision: str) -> str:
    """The fused attention kernel when the model names none: FlashAttention-2, which takes
    fp16 and bf16 only; under fp32 PyTorch's SDPA, which runs fp32 through its memory-efficient
    backend (`ckplan.model.spec.HALF_ONLY_ATTENTION_KERNELS`)."""
    return "sdpa" if precision == "fp32" else "flash2"


@dataclass(frozen=True, eq=True)
class Execution(_Record):
    """How the framework runs the step: which framework, its kernels for the memory-bound ops
    (Megatron's fused CUDA kernels, eager PyTorch, torch.compile), the attention kernel, the GEMM
    precision, and which communication it overlaps with compute."""

    framework: str = "megatron"  # megatron | torchtitan | deepspeed | hf
    # the framework's release whose semantics apply (torchtitan: 2024.12 | 0.3;
    # ckplan.model.frameworks FRAMEWORK_VERSIONS); None -> the newest modelled
    framework_version: str | None = None
    kernels: str | None = None  # fused | eager | compiled; None -> the framework's
    # flash2 | flash3 | cudnn | triton | sdpa (flash2 backend; under fp32 its memory-efficient
    # one); None -> default_attention_kernel(precision)
    attention_kernel: str | None = None
    # the linear layers' GEMMs: bf16 | fp16 | fp8 (Transformer Engine: saves FP8 copies of their
    # inputs) | float8 (torchao's float8 training: saves them in bf16) | fp32 (no mixed
    # precision: fp32 weights, gradients and activations, FP32_DEFAULTS)
    precision: str = "bf16"
    # Transformer Engine's FP8 scaling recipe under precision fp8: delayed | current | mxfp8 |
    # blockwise (FP8_RECIPES); None -> DEFAULT_FP8_RECIPE with precision fp8, else none
    fp8_recipe: str | None = None
    # FP8 primary weights (Megatron-LM --fp8-param-gather, megatron/training/arguments.py
    # core_v0.14.0: "Keep the compute param in fp8 (do not use any other intermediate dtype) and
    # perform the param all-gather in fp8"; Transformer Engine's fp8_model_init): the FP8 linear
    # layers' weights are FP8 tensors, the distributed optimizer's fp32 master shard is cast to
    # them each step and they are all-gathered in FP8 (ckplan.model.frameworks
    # `fp8_primary_weight_bytes`, ckplan.hardware.step_time). precision fp8 (delayed or
    # current), framework megatron, zero 1 only (ckplan.model.spec `_validate_fp8_param_gather`)
    fp8_param_gather: bool = False
    # fused | eager | xentropy | compiled | chunked:N | chunked-output:N (ckplan.model.loss);
    # None -> the framework's
    loss: str | None = None
    tp_comm_overlap: bool = False  # Megatron/TE --tp-comm-overlap, torchtitan async TP
    dp_comm_overlap: bool | None = None  # overlap DP/FSDP traffic with compute; None -> framework's
    # the once-per-step data-parallel collectives one by one (Megatron-Core core_v0.14.0
    # distributed_data_parallel_config.py `overlap_grad_reduce`, `overlap_param_gather`): the
    # gradients' reduction beside the last backward, the updated weights' gather beside the next
    # forward; None -> dp_comm_overlap. Megatron-Core takes them apart, Megatron-LM's arguments do
    # not (--overlap-param-gather needs --overlap-grad-reduce): Megatron-Bridge v0.1.0rc3's
    # DeepSeek-V3 H100 script turns the reduction's off and leaves the gather's on
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; None -> the framework's launcher's
    expandable_segments: bool | None = None
    # TiledMLP (Bekman et al. 2025, ALST): the recomputed dense MLP (the `mlp` strategy word)
    # re-runs its forward and backward in this many tiles of the tokens
    mlp_tiles: int = 1
    # Megatron-Core's fused MoE kernels (Transformer Engine's): --moe-permute-fusion, the token
    # permutation, its inverse and the sort by local expert as Triton kernels over a row map;
    # --moe-router-fusion, top-k with its score function and the aux-loss scores and loss as
    # CUDA kernels. Off by default in Megatron-LM (arguments.py core_v0.14.0 .. core_v0.19.0:
    # store_true; transformer_config.py `moe_permute_fusion: bool = False`,
    # `moe_router_fusion: bool = False`). ckplan.model.moe times both ways.
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    # DeepSeek-V3 Technical Report (arXiv 2412.19437) §3.3.3, "Low-Precision Activation" (2):
    # "we cache the inputs of the SwiGLU operator and recompute its output in the backward
    # pass. These activations are also stored in FP8": the routed experts' activation saves
    # its input, the fc1 output, at 1 byte a value (ckplan.model.moe `expert_act_saved_bytes`);
    # the recompute of its output is the `moe_act` module. Precision fp8 only.
    moe_act_input_fp8: bool = False
    # the MoE token dispatcher (Megatron-Core --moe-token-dispatcher-type): alltoall (each
    # token copy sent to its expert's rank) | flex (DeepEP: each token crosses the network once
    # per destination node, then NVLink to the experts there; hardware.expert_parallel)
    moe_token_dispatcher_type: str = "alltoall"
    # DeepSeek-V3 report §3.3.3, "Low-Precision Communication": the activation before the MoE
    # up-projections quantized to FP8 before the dispatch (1x128 tiles, one FP32 scale each);
    # the combine stays BF16 (ckplan.model.moe `dispatch_row_bytes`). Precision fp8 only.
    moe_dispatch_fp8: bool = False
    # Megatron-Core's --overlap-moe-expert-parallel-comm (core_v0.14.0 model_parallel_config.py
    # `overlap_moe_expert_parallel_comm`, "Overlap EP A2A communications with independent
    # computations of different micro-batches in 1f1b phase"): the steady phase's forward and
    # backward chunks merged, each one's all-to-alls beside the other's compute
    # (ckplan.hardware.combined_1f1b)
    overlap_moe_expert_parallel_comm: bool = False
    # torchao's float8 all-gather under torchtitan's FSDP2 (`enable_fsdp_float8_all_gather`, with
    # `precompute_float8_dynamic_scale_for_fsdp`; tensorwise scaling): each converted linear's
    # weight is cast to float8 on its shard before the all-gather (torchao/float8/fsdp_utils.py
    # at eab345c, `WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`), so the all-gather
    # and the unsharded weight are 1 byte a parameter (ckplan.model.frameworks
    # `fsdp2_gathered_bytes`) and no forward casts the weight again
    # (ckplan.hardware.code_path `float8_weight_cast_bytes`). Precision float8, torchtitan,
    # zero 2 or 3 with dp > 1 (ckplan.model.spec `_validate_fsdp_float8_all_gather`).
    fsdp_float8_all_gather: bool = False
    # The pipeline runtime frees each stage's sent outputs and received inputs once they are used
    # (Dubey et al. 2024, "The Llama 3 Herd of Models" §3.3.2: "we proactively deallocate
    # tensors that will not be used for future computation, including the input and output
    # tensors of each pipeline stage"; Megatron-LM frees what it sends, --deallocate-pipeline-
    # outputs). Under torchtitan ckplan otherwise counts torch.distributed.pipelining's buffers
    # (ckplan.model.memory `pipeline_buffer_bytes`); under Megatron-LM there are none either way.
    deallocate_pipeline_outputs: bool = False
    # torch.utils.checkpoint's use_reentrant for the recomputed layers: True runs each
    # checkpointed forward without an autograd graph, False (non-reentrant) through saved-tensor
    # hooks, which a node's Python attributes escape (ckplan.model.finetune
    # `held_through_checkpoint_bytes`). None -> the framework release's
    # (ckplan.model.frameworks `checkpoint_reentrant`)
    checkpoint_reentrant: bool | None = None
    # FSDP1's backward prefetch under the Hugging Face Trainer (framework hf, zero 3):
    # none | backward_pre | backward_post; None -> none, the Trainer's "NO_PREFETCH"
    # (ckplan.model.frameworks `fsdp1_prefetched_layers`)
    fsdp_backward_prefetch: str | None = None
    # the dtype FSDP reduce-scatters the gradients in under the Hugging Face Trainer or
    # accelerate (framework hf): fp32 | bf16 | fp16; None -> the mixed precision's half dtype,
    # accelerate's (ckplan.model.frameworks `fsdp_reduce_bytes`)
    fsdp_reduce_dtype: str | None = None
    # PyTorch FSDP's version under the Hugging Face Trainer or accelerate (framework hf): 1
    # (FullyShardedDataParallel, flat parameters) | 2 (fully_shard, per-parameter DTensors);
    # None -> the transformers release's default (ckplan.model.frameworks `fsdp_version`)
    fsdp_version: int | None = None

    __hash__ = _Record.__hash__

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.attention_kernel is None:
            self._derive("attention_kernel", default_attention_kernel(self.precision))
        for key, allowed in (
            ("framework", FRAMEWORKS),
            ("attention_kernel", ATTENTION_KERNELS),
            ("precision", PRECISIONS),
        ):
            if getattr(self, key) not in allowed:
                raise SpecError(
                    key=key, rule=f"must be one of {', '.join(allowed)}", value=getattr(self, key)
                )
        defaults = FRAMEWORK_DEFAULTS[self.framework]
        for key in ("kernels", "dp_comm_overlap", "loss", "expandable_segments"):
            if getattr(self, key) is None:
                self._derive(key, defaults[key])
        for key in ("overlap_grad_reduce", "overlap_param_gather"):
            if getattr(self, key) is None:
                self._derive(key, self.dp_comm_overlap)
        self._check_fp8_recipe()
        whole_losses = ("fused", "eager", "xentropy", "compiled")
        if self.loss not in whole_losses and not _is_chunked(self.loss):
            raise SpecError(
                "key 'loss' must be fused, eager, xentropy, compiled, chunked:N or "
                "chunked-output:N "
                f"(N in 2..{MAX_LOSS_CHUNKS:,}), got {quote(self.loss)}"
            )
        if self.kernels not in KERNELS:
            raise SpecError(
                f"key 'kernels' must be one of {', '.join(KERNELS)}, got {quote(self.kernels)}"
            )
        prefetch = self.fsdp_backward_prefetch
        if prefetch is not None and prefetch not in BACKWARD_PREFETCHES:
            rule = f"must be one of {', '.join(BACKWARD_PREFETCHES)}"
            raise SpecError(key="fsdp_backward_prefetch", rule=rule, value=prefetch)
        reduce = self.fsdp_reduce_dtype
        if reduce is not None and reduce not in FSDP_REDUCE_DTYPES:
            rule = f"must be one of {', '.join(FSDP_REDUCE_DTYPES)}"
            raise SpecError(key="fsdp_reduce_dtype", rule=rule, value=reduce)

    def _check_fp8_recipe(self) -> None:
        """`fp8_recipe` is Transformer Engine's (precision fp8): torchao's float8 and the
        16-bit precisions have none."""
        if self.fp8_recipe is None:
            if self.precision == "fp8":
                self._derive("fp8_recipe", DEFAULT_FP8_RECIPE)
            return
        if self.precision != "fp8":
            raise SpecError(
                "key 'fp8_recipe' is Transformer Engine's FP8 scaling recipe: it needs precision "
                f"fp8, got {quote(self.precision)}"
            )
        if self.fp8_recipe not in FP8_RECIPES:
            raise SpecError(
                key="fp8_recipe",
                rule=f"must be one of {', '.join(FP8_RECIPES)}",
                value=self.fp8_recipe,
            )

    def derived_defaults(self) -> dict[str, Any]:
        defaults = dict(FRAMEWORK_DEFAULTS[self.framework])
        defaults["attention_kernel"] = default_attention_kernel(self.precision)
        defaults["overlap_grad_reduce"] = self.dp_comm_overlap
        defaults["overlap_param_gather"] = self.dp_comm_overlap
        if self.precision == "fp8":
            defaults["fp8_recipe"] = DEFAULT_FP8_RECIPE
        return defaults


PARTS: dict[str, type] = {
    "architecture": Architecture,
    "shape": RunShape,
    "parallel": Parallelism,
    "data_parallel": DataParallel,
    "states": TrainingState,
    "execution": Execution,
    "finetune": FineTuning,
}


def cached_by_chain(maxsize: int) -> Callable:
    """Cache a function of one GPU's model by the parts it depends on (`spec.chain`): layouts
    that differ only in dp, ZeRO, the micro-batch count or the training state share entries."""

    def wrap(function: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(function)

        @functools.wraps(function)
        def call(spec, *args, **kwargs):
            return cached(spec.chain, *args, **kwargs)

        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return call

    return wrap
