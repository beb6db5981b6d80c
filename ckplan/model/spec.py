"""The model description: a validated, immutable `ModelSpec` built from a YAML-style mapping.

Users write one flat mapping (docs/models.md); `spec_from_mapping` is the one gate every input
passes: unknown keys (with a did-you-mean hint), wrong types, non-positive sizes, heads that do
not divide hidden, and unknown enum values all raise `SpecError` with a one-line message naming
the key. The result holds the mapping in parts (`ckplan.model.parts`): architecture, run shape,
parallelism, data parallelism, training state, and the kernel profile as a value. Every key
also reads flat (`spec.hidden` is `spec.architecture.hidden`), as users name them.

`ChainSpec` is what one GPU's op tables and chain depend on: the architecture, the run shape,
the parallelism and the kernel profile (`spec.chain`). Op tables and chains are cached by it, so
layouts that differ only in dp, ZeRO or the micro-batch count share them. Reading files is the
edge's (`ckplan.inputs`); this module does no I/O.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ckplan.model import context_parallel, frameworks
from ckplan.model.kernel_profile import FUSED, FUSED_NAME, Profile
from ckplan.model.layers import LayerSetError, parse_layer_set
from ckplan.model.parts import (
    FP32_DEFAULTS,
    PARTS,
    SIZE_RANGES,
    Architecture,
    DataParallel,
    Execution,
    FineTuning,
    Parallelism,
    RunShape,
    SpecError,
    TrainingState,
    cached_hash,
    range_error,
)
from ckplan.model.pipeline_layout import PipelineLayout, layout_errors
from ckplan.quoting import quote

__all__ = [
    "SIZE_RANGES",
    "ChainSpec",
    "ModelSpec",
    "SpecError",
    "field_names",
    "model_keys",
    "spec_from_mapping",
]

KINDS = ("transformer", "mlp")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "geglu")  # geglu: gated like swiglu (Gemma), the same shapes
ATTENTIONS = ("standard", "flash")
QK_NORM_WIDTHS = ("head", "full")
POSITIONS = ("learned", "rope")
PIPELINE_SCHEDULES = ("1f1b", "dualpipe")
MOE_TOKEN_DISPATCHERS = ("alltoall", "flex")
DEFAULT_PROFILE = FUSED_NAME  # the op table itself (ckplan.model.ops)

# The flat keys users write, in the order the output lists them, each with the part it lives in.
KEY_ORDER = (
    "name", "layers", "hidden", "seq", "micro_batch", "heads", "kv_heads", "ffn_hidden", "vocab",
    "dtype_bytes", "kind", "source", "norm", "mlp", "attention", "positions", "bias", "dropout",
    "tied_embeddings", "fused_swiglu", "profile", "tp", "pp", "sp", "cp", "dp", "zero",
    "virtual_stages", "microbatches", "microbatch_group_size", "pipeline_schedule", "grad_sync",
    "cp_attention", "cp_a2a_size", "weight_bytes",
    "grad_bytes", "master_bytes", "optimizer_bytes", "head_dim", "qkv_bias", "qk_norm",
    "qk_norm_width", "post_norms", "parallel_residual", "attention_sinks", "sliding_window",
    "sliding_window_layers", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "experts", "top_k",
    "moe_ffn_hidden", "shared_experts", "shared_ffn_hidden", "shared_expert_gate", "expert_bias",
    "capacity_factor", "moe_permute_fusion", "moe_router_fusion", "moe_act_input_fp8",
    "moe_layers", "moe_imbalance", "moe_router_num_groups", "moe_router_group_topk",
    "moe_token_dispatcher_type", "moe_dispatch_fp8", "overlap_moe_expert_parallel_comm",
    "mtp_layers", "ep", "etp", "first_stage_layers", "last_stage_layers",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "pipeline_layout", "framework", "framework_version", "kernels", "attention_kernel", "precision",
    "fp8_recipe", "fp8_param_gather", "loss", "tp_comm_overlap", "dp_comm_overlap",
    "overlap_grad_reduce", "overlap_param_gather", "expandable_segments", "mlp_tiles",
    "training", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "use_dora",
    "weight_format", "bitsandbytes_version", "optimizer", "optimizer_in_backward",
    "optimizer_implementation", "zero_grad",
    "optimizer_offload", "param_offload", "fsdp_float8_all_gather", "deallocate_pipeline_outputs",
    "checkpoint_reentrant", "fsdp_backward_prefetch", "fsdp_reduce_dtype", "fsdp_version",
)  # fmt: skip
PART_OF: dict[str, str] = {
    field.name: part for part, record in PARTS.items() for field in dataclasses.fields(record)
}
CHAIN_PARTS = ("architecture", "shape", "parallel", "execution", "finetune")


def _flat_properties(cls: type, parts: tuple[str, ...]) -> type:
    """Read every key of `parts` flat on `cls`: `spec.hidden` is `spec.architecture.hidden`."""
    for key, part in PART_OF.items():
        if part in parts:
            getter = _part_getter(part, key)
            setattr(cls, key, property(getter, doc=f"`{part}.{key}`"))
    return cls


def _part_getter(part: str, key: str):
    # a C-level getter: the flat keys are read millions of times in one `plan`
    return operator.attrgetter(f"{part}.{key}")


class _Layers:
    """What the layer count and the pipeline split give, for ModelSpec and ChainSpec alike."""

    architecture: Architecture
    parallel: Parallelism

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 §2.1), on when kv_lora_rank > 0."""
        return self.architecture.mla

    @property
    def layers_per_stage(self) -> int:
        """Transformer layers held by one pipeline stage, L / p (the most any stage holds, with
        uneven stages)."""
        return max(self.stage_layer_counts)

    @property
    def stage_layer_counts(self) -> tuple[int, ...]:
        """Layers of each pipeline stage (`Parallelism.stage_layer_counts`)."""
        return self.parallel.stage_layer_counts(self.architecture.layers)

    @property
    def pipeline_split_extras(self) -> tuple[int, int]:
        """(embedding, loss): 1 where Megatron counts it as a layer of the pipeline split."""
        return self.parallel.pipeline_split_extras

    @property
    def parsed_layout(self) -> PipelineLayout | None:
        """The parsed pipeline_layout (`Parallelism.parsed_layout`), None without one."""
        return self.parallel.parsed_layout


@dataclass(frozen=True, eq=True)
class ChainSpec(_Layers):
    """What one GPU's op tables and chain depend on. Built by `ModelSpec.chain`; validated as
    part of the ModelSpec it comes from."""

    architecture: Architecture
    shape: RunShape
    parallel: Parallelism
    execution: Execution = dataclasses.field(default_factory=Execution)
    profile: Profile = FUSED
    finetune: FineTuning = dataclasses.field(default_factory=FineTuning)

    def __hash__(self) -> int:
        return cached_hash(self)

    @property
    def chain(self) -> ChainSpec:
        return self

    def replace(self, **changes: Any) -> ChainSpec:
        """A copy with flat `changes` to its parts (each part checks its own keys; the rules
        across parts were checked on the ModelSpec this came from)."""
        return dataclasses.replace(self, **_part_changes(self, changes, CHAIN_PARTS))


@dataclass(frozen=True, eq=True)
class ModelSpec(_Layers):
    """A model and how it is trained: the parts, the kernel profile, and where it came from."""

    name: str
    architecture: Architecture
    shape: RunShape
    parallel: Parallelism = dataclasses.field(default_factory=Parallelism)
    data_parallel: DataParallel = dataclasses.field(default_factory=DataParallel)
    states: TrainingState = dataclasses.field(default_factory=TrainingState)
    execution: Execution = dataclasses.field(default_factory=Execution)
    profile: Profile = FUSED
    source: str = ""
    finetune: FineTuning = dataclasses.field(default_factory=FineTuning)

    def __post_init__(self) -> None:
        _validate(self)
        chain = ChainSpec(
            self.architecture,
            self.shape,
            self.parallel,
            self.execution,
            self.profile,
            self.finetune,
        )
        object.__setattr__(self, "_chain", chain)

    def __hash__(self) -> int:
        return cached_hash(self)

    @property
    def chain(self) -> ChainSpec:
        """The parts one GPU's op tables and chain depend on."""
        return self.__dict__["_chain"]

    @property
    def expert_data_parallel(self) -> int:
        """Data-parallel size of the expert weights: tp·cp·dp / (ep·etp). Megatron-LM's
        expert_data_parallel_size = world / (etp·ep·pp) with world = tp·cp·dp·pp
        (megatron/core/parallel_state.py; MoE README, "MoE Parallel Folding")."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def microbatch_group(self) -> int:
        """Micro-batches each virtual stage runs back to back in the interleaved schedule:
        microbatch_group_size, else p. Megatron-LM core_v0.19.0,
        megatron/core/model_parallel_config.py: microbatch_group_size_per_vp_stage defaults to
        pipeline_model_parallel_size (the depth-first schedule)."""
        return self.pp if self.microbatch_group_size is None else self.microbatch_group_size

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with flat `changes`, validated again. Keys whose value is still the default
        derived from other keys (head_dim = h/a, etp = tp, ...) are derived again from the
        changed ones."""
        values = self.to_dict()
        values["profile"] = self.profile
        derived = {
            **self.architecture.derived_defaults(),
            "etp": self.tp,
            **self.execution.derived_defaults(),
            **self.finetune.derived_defaults(),
            **frameworks.training_defaults(self.framework, self.zero, self.optimizer),
            **precision_defaults(self.precision),
        }
        for key, default in derived.items():
            if key not in changes and values[key] == default:
                del values[key]
        return spec_from_mapping({**values, **changes})

    def to_dict(self) -> dict[str, Any]:
        """The flat keys, resolved, in the order users read them (the profile by the reference
        the user gave)."""
        values = {}
        for key in KEY_ORDER:
            if key == "profile":
                values[key] = self.profile.reference
            else:
                values[key] = getattr(self, key)
        return values


_flat_properties(ChainSpec, CHAIN_PARTS)
_flat_properties(ModelSpec, tuple(PARTS))


def _part_changes(spec: Any, changes: Mapping[str, Any], parts: tuple[str, ...]) -> dict:
    by_part: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        part = "profile" if key == "profile" else PART_OF.get(key)
        if part is None or (part not in parts and part != "profile"):
            raise SpecError(f"unknown key {quote(key)} for {type(spec).__name__}.replace")
        if part == "profile":
            by_part["profile"] = value
        else:
            by_part.setdefault(part, {})[key] = value
    out: dict[str, Any] = {}
    for part, values in by_part.items():
        out[part] = (
            values if part == "profile" else dataclasses.replace(getattr(spec, part), **values)
        )
    return out


def field_names() -> list[str]:
    """The flat keys of a model description, in output order."""
    return list(KEY_ORDER)


def model_keys() -> dict[str, dataclasses.Field]:
    """Each flat key's field (its type and default) in the part that holds it, in output order;
    `name`, `source` and `profile` from ModelSpec itself."""
    own = {f.name: f for f in dataclasses.fields(ModelSpec)}
    fields = {f.name: f for record in PARTS.values() for f in dataclasses.fields(record)}
    return {key: fields.get(key) or own[key] for key in KEY_ORDER}


_KEYS = model_keys()
_REQUIRED = [
    key for key, f in _KEYS.items() if f.default is dataclasses.MISSING and key not in PARTS
]
_BOOL_FIELDS = {key for key, f in _KEYS.items() if f.type in ("bool", "bool | None")}
_STR_FIELDS = {"name", "source", "kind", "norm", "mlp", "attention", "positions", "profile"}
_STR_FIELDS |= {
    "qk_norm_width",
    "framework",
    "kernels",
    "attention_kernel",
    "precision",
    "fp8_recipe",
    "loss",
}
_STR_FIELDS |= {"training", "lora_targets", "weight_format", "bitsandbytes_version"}
_STR_FIELDS |= {"optimizer", "optimizer_implementation"}
_STR_FIELDS |= {"optimizer_offload", "param_offload", "grad_sync", "framework_version"}
_STR_FIELDS |= {"cp_attention", "fsdp_backward_prefetch", "fsdp_reduce_dtype"}
_STR_FIELDS |= {"pipeline_layout", "zero_grad", "pipeline_schedule", "moe_token_dispatcher_type"}
_LAYER_SET_FIELDS = {"moe_layers", "sliding_window_layers"}
_FLOAT_FIELDS = {"dropout", "capacity_factor", "lora_dropout", "lora_alpha"}
_NULLABLE = {key for key, f in _KEYS.items() if "None" in str(f.type)}
ENUMS = {
    "kind": KINDS,
    "norm": NORMS,
    "mlp": MLPS,
    "attention": ATTENTIONS,
    "qk_norm_width": QK_NORM_WIDTHS,
    "positions": POSITIONS,
    "pipeline_schedule": PIPELINE_SCHEDULES,
    "moe_token_dispatcher_type": MOE_TOKEN_DISPATCHERS,
}
MAX_TEXT_CHARS = 1000  # name and source
# A pipeline_layout's in-flight count walks each rank's m·v chunk forwards (ckplan.plan.
# evaluate.megatron_in_flight_weight): under half a second per rank at this many.
MAX_LAYOUT_FORWARDS = 2**21


def spec_from_mapping(mapping: Mapping[str, Any], origin: str = "model") -> ModelSpec:
    """Validate a YAML-style mapping into a ModelSpec, resolving defaults.

    `origin` prefixes error messages (a file name or preset name) so that the user knows
    which description is wrong. `profile` is a `Profile` value (`ckplan.inputs.load_spec` reads
    a named or file profile into one) or `fused`, the op table itself.
    """
    if not isinstance(mapping, Mapping):
        raise SpecError(
            f"{origin}: expected a mapping of keys to values, got {type(mapping).__name__}"
        )
    values: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or key not in _KEYS:
            raise SpecError(f"{origin}: unknown key {quote(key)}{_did_you_mean(key)}")
        values[key] = value if isinstance(value, Profile) else coerce_value(origin, key, value)
    missing = [key for key in _REQUIRED if key not in values]
    if values.get("kind") == "mlp":
        values.setdefault("seq", 1)
        missing = [key for key in missing if key != "seq"]
    if missing:
        raise SpecError(f"{origin}: missing required key {missing[0]!r}")
    try:
        return _build(values)
    except SpecError as error:
        raise error.within(origin) from None


def _build(values: dict[str, Any]) -> ModelSpec:
    _validate_ranges(values)
    if values.get("framework") is None:
        values["framework"] = frameworks.default_framework(
            *(values.get(key) for key in ("training", "zero", "tp", "pp", "cp", "ep"))
        )
    framework = values["framework"]
    if framework in frameworks.RULES:  # else Execution names the key
        defaults = frameworks.training_defaults(
            framework, values.get("zero") or 0, values.get("optimizer") or "adamw"
        )
        defaults |= precision_defaults(values.get("precision"))
        values = {
            **defaults,
            **{k: v for k, v in values.items() if v is not None or k not in defaults},
        }
    parts: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
    for key, value in values.items():
        if key in PART_OF:
            parts[PART_OF[key]][key] = value
    return ModelSpec(
        name=values["name"],
        source=values.get("source", ""),
        profile=_profile_value(values.get("profile", FUSED)),
        **{part: record(**parts[part]) for part, record in PARTS.items()},
    )


def precision_defaults(precision: Any) -> dict[str, int]:
    """The keys `precision` sets unless the model says otherwise: under fp32 the activations,
    weights and gradients take 4 bytes and there is no master copy (`parts.FP32_DEFAULTS`);
    otherwise 2-byte activations (RunShape's default)."""
    if precision == "fp32":
        return dict(FP32_DEFAULTS)
    return {"dtype_bytes": RunShape.__dataclass_fields__["dtype_bytes"].default}


def _profile_value(value: Any) -> Profile:
    if isinstance(value, Profile):
        return value
    if not isinstance(value, str):
        raise SpecError(f"key 'profile' expects a string, got {quote(value)}")
    if not value.strip():
        raise SpecError(
            "key 'profile' expects a profile name (fused, torch-eager, ...) or a .yaml file"
        )
    if value == FUSED_NAME:
        return FUSED
    raise SpecError(
        f"key 'profile' ({quote(value)}) names a profile to read: load the model with "
        "ckplan.inputs.presets.load_spec, which reads it"
    )


def _validate_ranges(values: Mapping[str, Any]) -> None:
    """Every size key inside its documented range, in one order whatever part holds it (each
    part checks its own again when built)."""
    for key, (low, high) in SIZE_RANGES.items():
        value = values.get(key)
        if value is not None:  # absent, or a nullable key left to its default
            range_error(key, value, low, high)


def _did_you_mean(key: Any) -> str:
    key = key if isinstance(key, str) and len(key) < 100 else ""
    close = difflib.get_close_matches(key, _KEYS, n=1, cutoff=0.6) if key else []
    return f" (did you mean {close[0]!r}?)" if close else f"; valid keys: {', '.join(_KEYS)}"


def coerce_value(origin: str, key: str, value: Any) -> Any:
    if key in _NULLABLE and value is None:
        return None
    if key in _LAYER_SET_FIELDS:
        return _coerce_layer_set(origin, key, value)
    if key == "lora_targets" and isinstance(value, list):  # a YAML list of module names
        if not value or not all(isinstance(item, str) for item in value):
            raise SpecError(
                key=key, rule="expects module names or all-linear", value=value, origin=origin
            )
        value = ",".join(value)
    if key == "moe_imbalance":
        return _coerce_imbalance(origin, value)
    if key in _BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise SpecError(key=key, rule="expects true or false", value=value, origin=origin)
    if key in ("framework_version", "bitsandbytes_version") and type(value) in (int, float):
        # YAML reads 0.3 or 0.43 a number
        value = repr(value)
    if key in _STR_FIELDS:
        if not isinstance(value, str):
            raise SpecError(key=key, rule="expects a string", value=value, origin=origin)
        if len(value) > MAX_TEXT_CHARS:
            raise SpecError(
                f"{origin}: key {key!r} is {len(value):,} characters long; at most "
                f"{MAX_TEXT_CHARS:,} are accepted"
            )
        return value
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise SpecError(key=key, rule="expects a number", value=value, origin=origin)
        if isinstance(value, str) and not value.isascii():  # float() reads '٠.١', '０.１'
            raise SpecError(
                f"{origin}: key {key!r} expects a number in ASCII digits, got {quote(value)}"
            )
        try:
            return float(value)
        except (ValueError, OverflowError):
            raise SpecError(key=key, rule="expects a number", value=value, origin=origin) from None
    # integers: accept ints and integer-valued strings/floats (from --set), nothing else
    if isinstance(value, bool):
        raise SpecError(key=key, rule="expects an integer", value=value, origin=origin)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"[+-]?[0-9][0-9_]*", value.strip()):
        text = value.strip()
        digits = text.lstrip("+-").replace("_", "").lstrip("0") or "0"
        if len(digits) > 30:  # beyond every range; Python refuses int() over 4,300 digits
            low, high = SIZE_RANGES.get(key, (0, 10**30))
            raise SpecError(
                f"{origin}: key {key!r} must be in {low:,}..{high:,}, got an integer of "
                f"{len(digits):,} digits"
            )
        return -int(digits) if text.startswith("-") else int(digits)
    if isinstance(value, int):
        return value
    raise SpecError(key=key, rule="expects an integer", value=value, origin=origin)


def _coerce_layer_set(origin: str, key: str, value: Any) -> str:
    """A layer set: its string form, or a YAML list of layer indices joined by commas."""
    if isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        return ",".join(str(item) for item in value) if value else "none"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise SpecError(
            f"{origin}: key {key!r} expects a layer set such as all, none, 3-, 0-:2 or a list "
            f"of layer indices, got {quote(value)}"
        )
    return value


def _coerce_imbalance(origin: str, value: Any) -> str:
    """average | worst | a number >= 1, kept as a string (the factor stays exact)."""
    text = str(value).strip().lower()
    if text in ("average", "worst"):
        return text
    try:
        # ASCII digits only (Fraction reads '١.٥'), and short (int() refuses 4,300 digits)
        factor = Fraction(text) if text.isascii() and len(text) <= 100 else None
    except (ValueError, ZeroDivisionError):
        factor = None
    if isinstance(value, bool) or factor is None or factor < 1:
        raise SpecError(
            f"{origin}: key 'moe_imbalance' expects average, worst or a factor >= 1, "
            f"got {quote(value)}"
        )
    return "average" if factor == 1 else text


def _validate(spec: ModelSpec) -> None:
    for key, allowed in ENUMS.items():
        if getattr(spec, key) not in allowed:
            raise SpecError(
                key=key, rule=f"must be one of {', '.join(allowed)}", value=getattr(spec, key)
            )
    if spec.kind == "mlp" and not spec.profile.is_fused:
        raise SpecError("key 'profile' applies to kind: transformer; the NumPy MLP has no profiles")
    if not 0.0 <= spec.dropout < 1.0:
        raise SpecError(f"key 'dropout' must be in [0, 1), got {spec.dropout}")
    if spec.zero > 3:
        raise SpecError(f"key 'zero' must be 0, 1, 2 or 3, got {quote(spec.zero)}")
    if spec.heads % spec.kv_heads:
        raise SpecError(f"key 'kv_heads' ({spec.kv_heads}) must divide heads ({spec.heads})")
    if spec.heads % spec.tp:
        raise SpecError(f"key 'tp' ({spec.tp}) must divide heads ({spec.heads})")
    if spec.kv_heads % spec.tp and spec.tp % spec.kv_heads:
        raise SpecError(
            f"key 'tp' ({spec.tp}) and kv_heads ({spec.kv_heads}) must divide one another "
            "(kv heads are split over tp ranks, or replicated when tp exceeds them)"
        )
    if spec.pipeline_layout is not None:
        _validate_layout(spec)
    elif spec.first_stage_layers is not None or spec.last_stage_layers is not None:
        _validate_uneven_stages(spec)
    elif any(spec.pipeline_split_extras):
        _validate_split_extras(spec)
    elif spec.layers % spec.pp:
        raise SpecError(
            f"key 'pp' ({spec.pp}) must divide layers ({spec.layers}), or give "
            "first_stage_layers / last_stage_layers (or account_for_embedding_in_pipeline_split"
            " / account_for_loss_in_pipeline_split)"
        )
    elif spec.layers_per_stage % spec.virtual_stages:
        raise SpecError(
            f"key 'virtual_stages' ({spec.virtual_stages}) must divide layers per pipeline "
            f"stage ({spec.layers_per_stage})"
        )
    reason = frameworks.layout_error(spec.framework, spec.zero, spec.tp, spec.pp, spec.cp, spec.ep)
    if reason:
        raise SpecError(reason)
    if spec.sp and spec.tp == 1:
        raise SpecError("key 'sp' (sequence parallelism) needs tp > 1")
    if spec.seq % spec.cp:
        raise SpecError(f"key 'cp' ({spec.cp}) must divide seq ({spec.seq})")
    if not 0.0 <= spec.capacity_factor <= 1e6:
        raise SpecError(f"key 'capacity_factor' must be >= 0, got {spec.capacity_factor}")
    if spec.precision == "fp32":
        _validate_fp32(spec)
    _validate_layer_sets(spec)
    _validate_attention_details(spec)
    _validate_mla(spec)
    _validate_moe(spec)
    _validate_finetune(spec)
    _validate_optimizer(spec)
    if reason := frameworks.state_offload_error(spec):
        raise SpecError(reason)
    if reason := frameworks.grad_sync_error(spec.framework, spec.grad_sync):
        raise SpecError(reason)
    if reason := frameworks.backward_prefetch_error(spec.framework, spec.fsdp_backward_prefetch):
        raise SpecError(reason)
    reduce = spec.fsdp_reduce_dtype
    if reason := frameworks.fsdp_reduce_dtype_error(spec.framework, spec.precision, reduce):
        raise SpecError(reason)
    if reason := frameworks.framework_version_error(spec.framework, spec.framework_version):
        raise SpecError(reason)
    if reason := frameworks.fsdp_version_error(spec):
        raise SpecError(reason)
    if reason := frameworks.optimizer_implementation_error(spec):
        raise SpecError(reason)
    if reason := context_parallel.cp_attention_error(spec.framework, spec.cp_attention):
        raise SpecError(reason)
    if spec.cp_a2a_size is not None and spec.cp_attention != "a2a+p2p":
        raise SpecError(
            f"key 'cp_a2a_size' ({spec.cp_a2a_size}) sizes the all-to-all groups of "
            "cp_attention a2a+p2p; set cp_attention a2a+p2p or leave the key out"
        )
    if spec.framework == "megatron" and (
        reason := context_parallel.te_cp_error(spec, spec.cp_attention, spec.tp, spec.cp)
    ):
        raise SpecError(reason)
    if spec.mlp_tiles > 1:
        _validate_mlp_tiles(spec)
    if spec.mtp_layers and (spec.kind != "transformer" or spec.vocab == 0):
        raise SpecError(
            "key 'mtp_layers' needs a transformer with a vocabulary (vocab > 0): each MTP depth "
            "reads the shared embedding and feeds the shared output head"
        )
    if spec.microbatch_group_size is not None:
        _validate_microbatch_group(spec)
    if spec.pipeline_schedule == "dualpipe":
        _validate_dualpipe(spec)
    if spec.fsdp_float8_all_gather:
        _validate_fsdp_float8_all_gather(spec)
    if spec.fp8_param_gather:
        _validate_fp8_param_gather(spec)


def _validate_fsdp_float8_all_gather(spec: ModelSpec) -> None:
    """torchao's float8 all-gather is an FSDP2 extension of its float8 linears' weights
    (torchao/float8/fsdp_utils.py at eab345c, `WeightWithDynamicFloat8CastTensor`; torchtitan
    enables it only where FSDP shards, torchtitan/float8.py at 9dec370: `dp_shard_enabled and
    enable_fsdp_float8_all_gather`; the same at v0.2.2, components/quantization/float8.py):
    precision float8, torchtitan's FSDP (zero 2 or 3) with dp > 1, full training. ckplan
    counts the converted weights of dense blocks (`memory.float8_gathered_layer_weights`): not
    MoE or MLA layers."""
    what = "key 'fsdp_float8_all_gather' (torchao's float8 all-gather under FSDP2)"
    if spec.precision != "float8":
        raise SpecError(f"{what} needs precision float8, got {quote(spec.precision)}")
    if spec.framework != "torchtitan":
        raise SpecError(f"{what} needs framework torchtitan, got {quote(spec.framework)}")
    if spec.zero < 2 or spec.dp == 1:
        raise SpecError(
            f"{what} needs FSDP's data-parallel sharding: zero 2 or 3 with dp > 1 (torchtitan "
            f"keeps it only where dp_shard > 1), got zero {spec.zero}, dp {spec.dp}"
        )
    if spec.training != "full":
        raise SpecError(f"{what} needs training: full, got {quote(spec.training)}")
    if spec.experts or spec.mla:
        raise SpecError(f"{what} is modelled for dense layers without MLA (experts: 0)")


def _validate_fp8_param_gather(spec: ModelSpec) -> None:
    """FP8 primary weights as ckplan models them: Megatron-LM's --fp8-param-gather under
    Transformer Engine's FP8 (precision fp8) with the distributed optimizer (zero 1), whose
    fp32 master shards Transformer Engine casts to the FP8 weights
    (transformer_engine/pytorch/tensor/utils.py `cast_master_weights_to_fp8`, v2.9: delayed,
    current and block scaling; "cast_master_weights_to_fp8 for MXFP8BlockScaling is not
    supported yet"; Megatron-LM core_v0.15.3 arguments.py refuses --fp8-param-gather with a
    recipe other than delayed only under --optimizer-cpu-offload). Megatron-LM also runs it
    under its FSDPs (arguments.py core_v0.14.0: "only supported with distributed optimizer,
    torch fsdp2, megatron fsdp"), and gathers MXFP8 weights in BF16 through the gradient
    buffer (param_and_grad_buffer.py `reuse_grad_buf_for_mxfp8_param_ag`): neither is
    modelled."""
    if spec.precision != "fp8":
        raise SpecError(
            "key 'fp8_param_gather' keeps Transformer Engine's FP8 weights: it needs precision "
            f"fp8, got {quote(spec.precision)}"
        )
    if spec.fp8_recipe == "mxfp8":
        raise SpecError(
            "key 'fp8_param_gather' is modelled for fp8_recipe delayed, current or blockwise "
            "(Megatron-Core gathers MXFP8 weights in BF16), got fp8_recipe mxfp8"
        )
    if spec.framework != "megatron":
        raise SpecError(
            "key 'fp8_param_gather' is Megatron-LM's --fp8-param-gather: it needs framework "
            f"megatron, got {quote(spec.framework)}"
        )
    if spec.zero != 1:
        raise SpecError(
            "key 'fp8_param_gather' is modelled with Megatron's distributed optimizer: it needs "
            f"zero 1, got {quote(spec.zero)}"
        )


# Attention kernels without an fp32 path: FlashAttention-2 refuses any other dtype
# (Dao-AILab/flash-attention csrc/flash_attn/flash_api.cpp, `mha_fwd`: TORCH_CHECK(q_dtype ==
# torch::kFloat16 || q_dtype == torch::kBFloat16, "FlashAttention only supports fp16 and bf16
# data type")), FlashAttention-3 takes fp16, bf16 and FP8 (hopper/flash_api.cpp), cuDNN's fused
# attention fp16, bf16 and FP8 (NVIDIA cuDNN frontend, "Scaled Dot Product Attention"). PyTorch's
# SDPA runs fp32 through its memory-efficient or math backend.
HALF_ONLY_ATTENTION_KERNELS = ("flash2", "flash3", "cudnn")


# Frameworks whose sharded data parallelism ckplan counts in bf16 elements: DeepSpeed's reduce
# and all-gather buckets, FSDP1's and FSDP2's unsharded copies and gradients
# (ckplan.model.frameworks `buffer_bytes` and the fsdp*_ functions).
BF16_SHARDING_BUFFERS = ("deepspeed", "torchtitan", "hf")


def _validate_fp32(spec: ModelSpec) -> None:
    """precision fp32 is one dtype throughout: fp32 activations and weights, no master copy
    (`parts.FP32_DEFAULTS`), and an attention kernel that takes fp32."""
    for key, value in FP32_DEFAULTS.items():
        if getattr(spec, key) != value:
            raise SpecError(
                f"key {key!r} must be {value} with precision fp32 (fp32 weights, gradients and "
                f"activations, no master copy), got {getattr(spec, key)}"
            )
    sharded = spec.zero >= 1 and spec.dp * spec.cp > 1
    if sharded and spec.framework in BF16_SHARDING_BUFFERS:
        raise SpecError(
            f"key 'zero' ({spec.zero}): precision fp32 with {spec.framework}'s sharded data "
            "parallelism is not modelled yet (its buckets and gathered copies are counted in "
            "bf16); use zero: 0, dp: 1 or precision bf16"
        )
    if spec.attention == "flash" and spec.attention_kernel in HALF_ONLY_ATTENTION_KERNELS:
        raise SpecError(
            f"key 'attention_kernel' ({spec.attention_kernel}) runs fp16 and bf16 only: with "
            "precision fp32 use attention_kernel: sdpa or attention: standard"
        )


def _validate_microbatch_group(spec: ModelSpec) -> None:
    """Megatron-LM core_v0.19.0, megatron/core/pipeline_parallel/schedules.py
    `forward_backward_pipelining_with_interleaving`: the group N of contiguous micro-batches
    per virtual stage must lie in [p, m] (ValueError), and m mod N must be 0 or at least p
    (RuntimeError: a shorter last group stalls on its dependencies). Only the interleaved
    schedule reads it."""
    n, p, m = spec.microbatch_group_size, spec.pp, spec.microbatches
    if spec.virtual_stages == 1:
        raise SpecError(
            f"key 'microbatch_group_size' ({n}) is the interleaved schedule's: it needs "
            "virtual_stages > 1"
        )
    if not p <= n <= m:
        raise SpecError(
            f"key 'microbatch_group_size' ({n}) must be in pp..microbatches ({p}..{m}), as "
            "Megatron-LM's interleaved schedule requires"
        )
    if 0 < m % n < p:
        raise SpecError(
            f"key 'microbatch_group_size' ({n}): microbatches ({m}) leave a last group of "
            f"{m % n}, which must be 0 or at least pp ({p}), as Megatron-LM requires"
        )


def _validate_dualpipe(spec: ModelSpec) -> None:
    """DualPipe's own requirements, deepseek-ai/DualPipe dualpipe/dualpipe.py at 3da1bbe
    (`DualPipe.step`): `assert num_ranks % 2 == 0` and `assert num_chunks > 0 and num_chunks
    % 2 == 0 and num_chunks >= num_ranks * 2` (num_chunks, the micro-batches of both
    directions, is `microbatches`); each rank holds two whole stages, one per direction
    (`modules: Tuple[nn.Module, nn.Module]`), so no virtual stages, and Megatron-Core's
    pipeline_layout, a split for its own schedules, does not apply."""
    p, m = spec.pp, spec.microbatches
    if p < 2 or p % 2:
        raise SpecError(
            f"key 'pipeline_schedule' (dualpipe) needs an even pp of at least 2, got pp {p}"
        )
    if m % 2 or m < 2 * p:
        raise SpecError(
            f"key 'pipeline_schedule' (dualpipe) needs an even microbatches of at least 2·pp "
            f"({2 * p}), half from each end of the pipeline, got {m}"
        )
    if spec.virtual_stages != 1:
        raise SpecError(
            f"key 'pipeline_schedule' (dualpipe) needs virtual_stages: 1 (each rank holds "
            f"one stage of each direction), got {spec.virtual_stages}"
        )
    if spec.pipeline_layout is not None:
        raise SpecError(
            "key 'pipeline_schedule' (dualpipe): drop pipeline_layout, Megatron-Core's split "
            "for its own schedules; use first_stage_layers / last_stage_layers"
        )


def _validate_layout(spec: ModelSpec) -> None:
    """Megatron-Core's rules for --pipeline-model-parallel-layout
    (`ckplan.model.pipeline_layout.layout_errors`), and TransformerConfig.__post_init__'s
    (core_v0.19.0): no other pipeline split argument beside it."""
    others = [
        key
        for key in (
            "first_stage_layers",
            "last_stage_layers",
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
        )
        if getattr(spec, key) not in (None, False)
    ]
    if others:
        raise SpecError(
            f"key 'pipeline_layout' places every layer itself: drop {' and '.join(others)}, "
            "as Megatron-Core requires"
        )
    reason = layout_errors(spec.parsed_layout, spec.layers, spec.mtp_layers)
    if reason:
        raise SpecError(f"key 'pipeline_layout' ({quote(spec.pipeline_layout)}) {reason}")
    forwards = spec.microbatches * spec.virtual_stages
    if forwards > MAX_LAYOUT_FORWARDS:
        raise SpecError(
            f"key 'pipeline_layout': microbatches x virtual stages ({forwards:,}) is over "
            f"{MAX_LAYOUT_FORWARDS:,}, the chunk forwards ckplan walks per rank to weigh a "
            "layout's chunks"
        )


def _validate_uneven_stages(spec: ModelSpec) -> None:
    given = {
        key: getattr(spec, key)
        for key in ("first_stage_layers", "last_stage_layers")
        if getattr(spec, key) is not None
    }
    for key, value in given.items():
        if value < 1:
            raise SpecError(f"key {key!r} must be a positive integer, got {value}")
    if any(spec.pipeline_split_extras):
        raise SpecError(
            "keys first_stage_layers / last_stage_layers set the stages' layers themselves: "
            "drop account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split"
        )
    if spec.pp < 2:
        raise SpecError(f"key {next(iter(given))!r} needs pipeline parallelism (pp > 1)")
    if spec.virtual_stages > 1:
        raise SpecError("keys first_stage_layers / last_stage_layers need virtual_stages: 1")
    middle = spec.pp - len(given)
    rest = spec.layers - sum(given.values())
    if rest < 0 or (middle == 0 and rest != 0) or (middle and (rest < middle or rest % middle)):
        what = " + ".join(f"{key} ({value})" for key, value in given.items())
        raise SpecError(
            f"{what} leave {rest} of {spec.layers} layers, which the other {middle} pipeline "
            "stages must share evenly (at least one each)"
        )


def _validate_split_extras(spec: ModelSpec) -> None:
    """Megatron's get_num_layers_to_build with the embedding and/or loss counted as layers:
    p divides L + extras, each stage (each virtual stage) takes an equal share, the first
    (last) stage one layer fewer; ckplan also wants a layer on every pipeline stage."""
    embedding, loss = spec.pipeline_split_extras
    given = [
        key
        for key, on in (
            ("account_for_embedding_in_pipeline_split", embedding),
            ("account_for_loss_in_pipeline_split", loss),
        )
        if on
    ]
    if spec.pp < 2:
        raise SpecError(f"key {given[0]!r} needs pipeline parallelism (pp > 1)")
    items = spec.layers + embedding + loss
    what = "layers" + " + embedding" * embedding + " + loss" * loss
    if items % spec.pp:
        raise SpecError(
            f"key 'pp' ({spec.pp}) must divide {what} ({items}) with {' and '.join(given)}"
        )
    if items // spec.pp <= max(embedding, loss):
        raise SpecError(
            f"key 'pp' ({spec.pp}): {what} ({items}) leave no transformer layer on the first or "
            "last pipeline stage"
        )
    if (items // spec.pp) % spec.virtual_stages:
        raise SpecError(
            f"key 'virtual_stages' ({spec.virtual_stages}) must divide the {items // spec.pp} "
            f"layers per pipeline stage that {what} ({items}) give"
        )


def _validate_layer_sets(spec: ModelSpec) -> None:
    if spec.sliding_window_layers != "all" and not spec.sliding_window:
        raise SpecError("key 'sliding_window_layers' needs a sliding_window > 0")
    for key in sorted(_LAYER_SET_FIELDS):
        if getattr(spec, key).strip().lower() in ("all", "none"):
            continue  # valid for any depth; no need to build the set
        try:
            parse_layer_set(getattr(spec, key), spec.layers)
        except LayerSetError as error:
            raise SpecError(f"key {key!r}: {error}") from None


def _validate_attention_details(spec: ModelSpec) -> None:
    if spec.qk_norm_width != "head" and not spec.qk_norm:
        raise SpecError(
            f"key 'qk_norm_width' ({spec.qk_norm_width}) sets the span of the QK-norms: "
            "needs qk_norm: true"
        )
    if spec.kind != "transformer" and (spec.qk_norm or spec.attention_sinks):
        key = "qk_norm" if spec.qk_norm else "attention_sinks"
        raise SpecError(f"key {key!r} needs kind: transformer (the NumPy MLP has no attention)")
    if spec.mla and (spec.qk_norm or spec.attention_sinks):
        key = "qk_norm" if spec.qk_norm else "attention_sinks"
        raise SpecError(
            f"key {key!r} is not modelled with multi-head latent attention (kv_lora_rank > 0), "
            "whose latent norms are its own"
        )


def _validate_mla(spec: ModelSpec) -> None:
    mla_keys = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if not spec.mla:
        given = [key for key in mla_keys if getattr(spec, key)]
        if given:
            raise SpecError(
                f"key {given[0]!r} needs multi-head latent attention (kv_lora_rank > 0)"
            )
        return
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(spec, key) < 1:
            raise SpecError(
                f"key 'kv_lora_rank' (multi-head latent attention) needs {key} > 0, "
                f"got {getattr(spec, key)}"
            )
    if spec.qkv_bias:
        raise SpecError("key 'kv_lora_rank': multi-head latent attention has no QKV bias")
    if spec.kv_heads != spec.heads:
        raise SpecError(
            f"key 'kv_heads' ({spec.kv_heads}) must equal heads ({spec.heads}) with multi-head "
            "latent attention (every head has its own K and V)"
        )
    if spec.kind != "transformer":
        raise SpecError("key 'kv_lora_rank' needs kind: transformer")


# Megatron-Core's fused MoE kernels (ckplan.model.parts.Execution)
MOE_FUSIONS = ("moe_permute_fusion", "moe_router_fusion")


def _validate_moe(spec: ModelSpec) -> None:
    if not spec.experts:
        for key, default in (("ep", 1), ("shared_experts", 0), ("shared_ffn_hidden", 0)):
            if getattr(spec, key) != default:
                raise SpecError(f"key {key!r} needs a mixture of experts (experts > 0)")
        if spec.capacity_factor or spec.shared_expert_gate or spec.expert_bias:
            raise SpecError(
                "keys capacity_factor, shared_expert_gate, expert_bias need experts > 0"
            )
        for key in (
            *MOE_FUSIONS,
            "moe_act_input_fp8",
            "moe_dispatch_fp8",
            "overlap_moe_expert_parallel_comm",
        ):
            if getattr(spec, key):
                raise SpecError(f"key {key!r} needs a mixture of experts (experts > 0)")
        for key, default in (
            ("moe_layers", "all"),
            ("moe_imbalance", "average"),
            ("top_k", 2),
            ("moe_router_num_groups", 0),
            ("moe_router_group_topk", 0),
            ("moe_token_dispatcher_type", "alltoall"),
        ):
            if getattr(spec, key) != default:
                raise SpecError(f"key {key!r} needs a mixture of experts (experts > 0)")
        return
    if spec.kind != "transformer":
        raise SpecError("key 'experts' needs kind: transformer")
    for key in MOE_FUSIONS:
        if getattr(spec, key) and spec.framework != "megatron":
            raise SpecError(
                f"key {key!r} is Megatron-Core's (Transformer Engine's fused MoE kernels): it "
                f"needs framework megatron, got {spec.framework!r}"
            )
    if spec.moe_act_input_fp8 and spec.precision != "fp8":
        raise SpecError(
            "key 'moe_act_input_fp8' caches the experts' activation input in FP8: it needs "
            f"precision fp8, got {spec.precision!r}"
        )
    if spec.moe_dispatch_fp8 and spec.precision != "fp8":
        raise SpecError(
            "key 'moe_dispatch_fp8' sends the dispatched tokens in FP8: it needs precision fp8, "
            f"got {spec.precision!r}"
        )
    if not 1 <= spec.top_k <= spec.experts:
        raise SpecError(f"key 'top_k' ({spec.top_k}) must be in 1..experts ({spec.experts})")
    if spec.experts % spec.ep:
        raise SpecError(f"key 'ep' ({spec.ep}) must divide experts ({spec.experts})")
    if spec.moe_ffn_hidden % spec.etp:
        raise SpecError(
            f"key 'etp' ({spec.etp}) must divide moe_ffn_hidden ({spec.moe_ffn_hidden})"
        )
    group = spec.tp * spec.cp * spec.dp
    if group % (spec.ep * spec.etp):
        raise SpecError(
            f"keys ep·etp ({spec.ep}·{spec.etp}) must divide tp·cp·dp ({group}): the expert "
            "groups are carved from the same GPUs (raise dp, or set etp=1)"
        )
    if spec.tp > 1 and not spec.sp:
        raise SpecError(
            "key 'sp': a mixture of experts with tp > 1 needs sequence parallelism "
            "(Megatron-LM requires it); add sp=true"
        )
    if spec.shared_experts and spec.shared_ffn_hidden % spec.tp:
        raise SpecError(
            f"key 'tp' ({spec.tp}) must divide shared_ffn_hidden ({spec.shared_ffn_hidden})"
        )
    if spec.shared_expert_gate and not spec.shared_ffn_hidden:
        raise SpecError("key 'shared_expert_gate' needs shared experts (shared_ffn_hidden > 0)")
    if not parse_layer_set(spec.moe_layers, spec.layers):
        raise SpecError("key 'moe_layers' selects no layer (use experts: 0 for a dense model)")
    _validate_router_groups(spec)
    if spec.overlap_moe_expert_parallel_comm:
        _validate_a2a_overlap(spec)


def _validate_a2a_overlap(spec: ModelSpec) -> None:
    """overlap_moe_expert_parallel_comm as Megatron-Core asserts it (transformer_config.py
    core_v0.14.0 and core_v0.19.0, __post_init__): expert parallelism, an interleaved pipeline
    when pp > 1 (arguments.py turns a virtual size of 1 into None), at most one MTP layer, a
    half-precision model; and the combined 1F1B of Megatron-Core's 1F1B schedules, not
    DualPipe. Its bans on full recomputation apply to the plan, not the model."""
    key = "key 'overlap_moe_expert_parallel_comm'"
    if spec.framework != "megatron":
        raise SpecError(f"{key} is Megatron-Core's: it needs framework megatron")
    if spec.ep < 2:
        raise SpecError(f"{key} overlaps the expert-parallel all-to-alls: it needs ep > 1")
    if spec.pipeline_schedule != "1f1b":
        raise SpecError(f"{key} merges 1F1B's chunks: it needs pipeline_schedule 1f1b")
    if spec.pp > 1 and spec.virtual_stages < 2:
        raise SpecError(
            f"{key} with pp {spec.pp} needs an interleaved pipeline (virtual_stages > 1), "
            "as Megatron-Core asserts"
        )
    if spec.mtp_layers > 1:
        raise SpecError(f"{key} supports at most one MTP layer, got mtp_layers {spec.mtp_layers}")
    if spec.precision == "fp32":
        raise SpecError(f"{key} needs a bf16 or fp16 model, got precision fp32")


def _validate_router_groups(spec: ModelSpec) -> None:
    """Group-limited routing as Megatron-Core checks it (transformer_config.py core_v0.19.0,
    __post_init__: both keys together, experts divisible by the groups, group_topk <= groups),
    and enough experts in the chosen groups for top_k (moe_utils.group_limited_topk takes the
    top_k of the group_topk·E/G experts left)."""
    groups, chosen = spec.moe_router_num_groups, spec.moe_router_group_topk
    if not groups and not chosen:
        return
    if not groups or not chosen:
        raise SpecError(
            "keys 'moe_router_num_groups' and 'moe_router_group_topk' go together: set both "
            f"(got {groups} and {chosen})"
        )
    if spec.experts % groups:
        raise SpecError(
            f"key 'moe_router_num_groups' ({groups}) must divide experts ({spec.experts})"
        )
    if chosen > groups:
        raise SpecError(
            f"key 'moe_router_group_topk' ({chosen}) must be at most moe_router_num_groups "
            f"({groups})"
        )
    per_group = spec.experts // groups
    if chosen * per_group < spec.top_k:
        raise SpecError(
            f"key 'moe_router_group_topk' ({chosen}): {chosen} groups of {per_group} "
            f"expert{'s' if per_group != 1 else ''} hold fewer than top_k ({spec.top_k})"
        )


def _validate_finetune(spec: ModelSpec) -> None:
    """The fine-tuning keys (docs/fine-tuning.md): LoRA keys need LoRA, QLoRA 4-bit weights,
    and the layers and layouts ckplan models with frozen weights."""
    finetune = spec.finetune
    quantized = ("nf4", "fp4", "int8")
    if finetune.bitsandbytes_version is not None and finetune.weight_format not in quantized:
        raise SpecError(
            "key 'bitsandbytes_version' sets how bitsandbytes runs 4-bit and int8 weights: it "
            f"needs weight_format nf4, fp4 or int8 (weight_format is "
            f"{finetune.weight_format or 'not set'})"
        )
    lora = finetune.training in ("lora", "qlora")
    if not lora:
        defaults = FineTuning()
        for key in ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "use_dora"):
            if getattr(finetune, key) != getattr(defaults, key):
                raise SpecError(
                    f"key {key!r} needs training: lora or qlora (training is {finetune.training})"
                )
    if finetune.training == "full":
        if finetune.weight_format is not None:
            raise SpecError(
                "key 'weight_format' sets the frozen weights' format: it needs training: "
                "frozen, lora or qlora (full training keeps weight_bytes)"
            )
        return
    if finetune.training == "qlora" and finetune.weight_format not in ("nf4", "fp4"):
        raise SpecError(
            f"key 'weight_format' must be nf4 or fp4 with training: qlora (4-bit frozen "
            f"weights), got {quote(finetune.weight_format)}"
        )
    what = f"training: {finetune.training}"
    if spec.kind != "transformer":
        raise SpecError(f"key 'training' ({finetune.training}) needs kind: transformer")
    if spec.experts:
        _validate_frozen_experts(spec, what)
    if spec.mla:
        raise SpecError(
            f"key 'kv_lora_rank': {what} is not modelled with multi-head latent attention yet"
        )
    if spec.precision in ("fp8", "float8"):
        raise SpecError(
            f"key 'precision' must be bf16, fp16 or fp32 with {what}, got {spec.precision}"
        )
    if finetune.weight_format in ("nf4", "fp4", "int8") and spec.tp > 1:
        raise SpecError(
            f"key 'tp' must be 1 with weight_format: {finetune.weight_format} (quantised "
            "weights split over tensor-parallel ranks are not modelled yet)"
        )
    if lora and spec.tp > 1:
        raise SpecError(
            f"key 'tp' must be 1 with {what}: the adapters' tensor-parallel layout is not "
            "modelled yet"
        )
    if "gate_proj" in finetune.lora_targets.split(",") and spec.mlp == "gelu":
        raise SpecError(
            "key 'lora_targets': gate_proj needs a gated MLP (mlp: swiglu or geglu); a GELU "
            "MLP has up_proj and down_proj"
        )


# the PEFT modules an adapter may target beside a mixture of experts (`_validate_frozen_experts`)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _validate_frozen_experts(spec: ModelSpec, what: str) -> None:
    """Frozen base weights beside a mixture of experts: the experts stay in the compute dtype
    and on every rank, and adapters sit on the attention projections only (ckplan.model.
    finetune)."""
    mlp_targets = [name for name in spec.finetune.adapters if name not in ATTENTION_TARGETS]
    if mlp_targets:
        raise SpecError(
            f"key 'lora_targets' must name attention projections only (q_proj, k_proj, v_proj, "
            f"o_proj) with experts, got {spec.finetune.lora_targets}: for the MLP's names and "
            "all-linear PEFT adapts the experts' 3D weights and the router of Mixtral and "
            "Qwen MoE models (target_parameters), which is not modelled yet"
        )
    if spec.finetune.weight_format in ("nf4", "fp4", "int8"):
        raise SpecError(
            f"key 'weight_format' must be bf16, fp16 or fp32 with experts and {what}, got "
            f"{spec.finetune.weight_format} (bitsandbytes quantises nn.Linear modules, and "
            "transformers holds the experts as 3D parameters: quantised experts are not "
            "modelled yet)"
        )
    if spec.ep > 1:
        raise SpecError(
            f"key 'ep' must be 1 with experts and {what} (expert parallelism beside frozen "
            f"base weights is not modelled yet), got {spec.ep}"
        )
    if spec.etp != spec.tp:
        raise SpecError(
            f"key 'etp' must equal tp ({spec.tp}) with experts and {what} (the experts split "
            f"as the layer's other weights; other expert layouts beside frozen base weights "
            f"are not modelled yet), got {spec.etp}"
        )
    if spec.mtp_layers:
        raise SpecError(
            f"key 'mtp_layers' must be 0 with {what} (the MTP depths' frozen weights are not "
            f"modelled yet), got {spec.mtp_layers}"
        )


def _validate_optimizer(spec: ModelSpec) -> None:
    """The optimizer keys (docs/fine-tuning.md "Optimizers"): per-tensor states need the
    tensors' shapes, which ckplan knows for dense transformer layers at tp 1; Adafactor's
    factored moments need whole tensors; the step in backward runs one micro-batch per step."""
    optimizer = spec.optimizer
    shaped = optimizer in ("adamw-8bit", "paged-adamw-8bit", "adafactor")
    unknown_shapes = spec.kind != "transformer" or spec.experts or spec.mla or spec.tp > 1
    if shaped and spec.training == "full" and unknown_shapes:
        raise SpecError(
            f"key 'optimizer' ({optimizer}): its per-tensor states are modelled for dense "
            "transformer layers at tp 1 (kind: transformer, experts: 0, no MLA, tp: 1)"
        )
    if optimizer == "adafactor" and spec.zero >= 1:
        raise SpecError(
            f"key 'zero' ({spec.zero}): adafactor factors each whole weight matrix; use zero: 0"
        )
    if spec.optimizer_in_backward:
        if spec.pp > 1 or spec.microbatches > 1:
            raise SpecError(
                "key 'optimizer_in_backward' steps in every backward, so gradients never "
                "accumulate: it needs pp: 1 and microbatches: 1"
            )
        if spec.experts:
            raise SpecError(
                "key 'optimizer_in_backward' is not modelled for a mixture of experts (experts: 0)"
            )


def _validate_mlp_tiles(spec: ModelSpec) -> None:
    """TiledMLP tiles a dense transformer MLP over its tokens, at most one token a tile."""
    if spec.kind != "transformer" or spec.experts:
        raise SpecError(
            f"key 'mlp_tiles' ({spec.mlp_tiles}) tiles a dense MLP: it needs kind: transformer "
            "and experts: 0"
        )
    tokens = spec.seq // spec.cp * spec.micro_batch
    if spec.mlp_tiles > tokens:
        raise SpecError(
            f"key 'mlp_tiles' ({spec.mlp_tiles}) must be at most the tokens of a micro-batch "
            f"per rank ({tokens})"
        )
