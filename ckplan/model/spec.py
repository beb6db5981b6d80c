"""The model description: a validated, immutable `ModelSpec` built from a YAML-style mapping.

The fields read as the architecture (nanoGPT's GPTConfig style). `spec_from_mapping` is the one
gate every input passes: unknown keys (with a did-you-mean hint), wrong types, non-positive
sizes, heads that do not divide hidden, and unknown enum values all raise `SpecError` with a
one-line message naming the key. Parsing files lives in `ckplan.inputs`; this module does no I/O.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

from ckplan.errors import InputError
from ckplan.quoting import quote


class SpecError(InputError):
    """Invalid model description; the message is one line and names the offending key."""


KINDS = ("transformer", "mlp")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "geglu")  # geglu: gated like swiglu (Gemma), the same shapes
ATTENTIONS = ("standard", "flash")
POSITIONS = ("learned", "rope")
DEFAULT_PROFILE = "fused"  # the op table itself (ckplan.model.profiles)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int  # L
    hidden: int  # h (for kind=mlp: the width d)
    seq: int  # s (for kind=mlp: unused, 1)
    micro_batch: int  # b (for kind=mlp: rows per step)
    heads: int = 1  # a
    kv_heads: int | None = None  # g; None -> heads
    ffn_hidden: int | None = None  # F; None -> 4h
    vocab: int = 0  # V; 0 -> no embedding/output layer in the chain
    dtype_bytes: int = 2  # B: bytes per activation value
    kind: str = "transformer"
    source: str = ""
    norm: str = "layernorm"
    mlp: str = "gelu"
    attention: str = "standard"
    positions: str = "learned"
    bias: bool = True
    dropout: float = 0.0
    tied_embeddings: bool = False
    fused_swiglu: bool = True  # Megatron's bias_swiglu saves fc1 output, not silu(gate) too
    # kernel profile (ckplan.model.profiles): a shipped name or a .yaml file; fused = ops.py's
    profile: str = DEFAULT_PROFILE
    # parallel layout
    tp: int = 1
    pp: int = 1
    sp: bool = False
    cp: int = 1
    dp: int = 1
    zero: int = 0
    virtual_stages: int = 1
    microbatches: int = 1
    # model states, bytes per parameter (Megatron-LM's mixed-precision Adam: 2 + 4 + 4 + 4 + 4)
    weight_bytes: int = 2
    grad_bytes: int = 4
    master_bytes: int = 4
    optimizer_bytes: int = 8
    # attention details of the Hugging Face families (README "Model keys")
    head_dim: int | None = None  # d; None -> h / a (Gemma, Qwen3: a·d != h)
    qkv_bias: bool | None = None  # biases on Q, K, V only (Qwen2); None -> bias
    qk_norm: bool = False  # RMSNorm on each head of Q and K (Qwen3, Gemma 3)
    post_norms: bool = False  # norms after attention and MLP too (Gemma 2/3)
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX)
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
    moe_layers: str = "all"  # a layer set; --moe-layer-freq N is 0-:N
    moe_imbalance: str = "average"  # average | worst | a factor >= 1 (tokens on the busiest rank)
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

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        _validate_ranges(self)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.head_dim is None:
            if self.heads >= 1 and self.hidden % self.heads:
                raise SpecError(
                    f"key 'heads' ({self.heads}) must divide hidden ({self.hidden}), "
                    "or give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden // max(self.heads, 1))
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)
        if self.moe_ffn_hidden is None:
            object.__setattr__(self, "moe_ffn_hidden", self.ffn_hidden)
        if self.shared_ffn_hidden is None:
            object.__setattr__(self, "shared_ffn_hidden", self.shared_experts * self.moe_ffn_hidden)
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        _validate(self)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 §2.1), on when kv_lora_rank > 0."""
        return self.kv_lora_rank > 0

    @property
    def expert_data_parallel(self) -> int:
        """Data-parallel size of the expert weights: tp·cp·dp / (ep·etp). Megatron-LM's
        expert_data_parallel_size = world / (etp·ep·pp) with world = tp·cp·dp·pp
        (megatron/core/parallel_state.py; MoE README, "MoE Parallel Folding")."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def layers_per_stage(self) -> int:
        """Transformer layers held by one pipeline stage, L / p (the most any stage holds, with
        uneven stages)."""
        return max(self.stage_layer_counts)

    @property
    def stage_layer_counts(self) -> tuple[int, ...]:
        """Layers of each pipeline stage: L/p each, or first_stage_layers, last_stage_layers
        and the rest split evenly over the stages between (Megatron-LM's uneven split)."""
        p = self.pp
        if self.first_stage_layers is None and self.last_stage_layers is None:
            embedding, loss = self.pipeline_split_extras
            each = (self.layers + embedding + loss) // p
            return (each - embedding, *(each,) * (p - 2), each - loss) if p > 1 else (each,)
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = p - (first is not None) - (last is not None)
        rest = self.layers - (first or 0) - (last or 0)
        each = rest // middle_stages if middle_stages else 0
        counts = [each] * p
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return tuple(counts)

    @property
    def pipeline_split_extras(self) -> tuple[int, int]:
        """(embedding, loss): 1 where Megatron counts it as a layer of the pipeline split."""
        return (
            int(self.account_for_embedding_in_pipeline_split),
            int(self.account_for_loss_in_pipeline_split),
        )

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with `changes`. Keys whose value is still the default derived from other keys
        (head_dim = h/a, etp = tp, ...) are derived again from the changed ones."""
        values = self.to_dict()
        derived = {
            "head_dim": self.hidden // self.heads,
            "qkv_bias": self.bias,
            "moe_ffn_hidden": self.ffn_hidden,
            "shared_ffn_hidden": self.shared_experts * self.moe_ffn_hidden,
            "etp": self.tp,
        }
        for key, default in derived.items():
            if key not in changes and values[key] == default:
                del values[key]
        return spec_from_mapping({**values, **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(ModelSpec)}
_REQUIRED = [name for name, f in _FIELDS.items() if f.default is dataclasses.MISSING]
_BOOL_FIELDS = {
    "bias",
    "tied_embeddings",
    "fused_swiglu",
    "sp",
    "qkv_bias",
    "qk_norm",
    "post_norms",
    "parallel_residual",
    "shared_expert_gate",
    "expert_bias",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
}
_STR_FIELDS = {"name", "source", "kind", "norm", "mlp", "attention", "positions", "profile"}
_LAYER_SET_FIELDS = {"moe_layers", "sliding_window_layers"}
_FLOAT_FIELDS = {"dropout", "capacity_factor"}
_NULLABLE = {"kv_heads", "ffn_hidden", "head_dim", "qkv_bias", "moe_ffn_hidden"}
_NULLABLE |= {"shared_ffn_hidden", "etp", "first_stage_layers", "last_stage_layers"}
ENUMS = {
    "kind": KINDS,
    "norm": NORMS,
    "mlp": MLPS,
    "attention": ATTENTIONS,
    "positions": POSITIONS,
}
# The documented range of every size key (README "Ranges"). Generous: a model 100x larger than
# any trained today fits (today's largest: ~130 layers, hidden 25,600, FFN 73,728, 160 heads,
# vocab 262k, contexts of 10M tokens, ~100k GPUs), and a typo beyond it is an error instead of
# a minutes-long run or an exhausted memory. vocab and zero may be 0.
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
    "dp": (1, 2**24),
    "zero": (0, 3),
    "virtual_stages": (1, 2**16),
    "microbatches": (1, 2**20),
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
    "first_stage_layers": (1, 99_999),  # the other stages hold at least one layer
    "last_stage_layers": (1, 99_999),
}
MAX_TEXT_CHARS = 1000  # name and source


@lru_cache(maxsize=1024)
def activation_spec(spec: ModelSpec) -> ModelSpec:
    """`spec` with the least dp, no ZeRO and one micro-batch per iteration, where valid: the
    chain depends on none of them (dp and ZeRO shard model states, the micro-batch count
    times the iteration), so the layouts that differ in them share one chain (`ckplan sweep`'s
    advice tries several on a 100,000-layer model; `ckplan plan --global-batch` many more).
    The least dp is 1, or with experts the least that keeps ep·etp dividing tp·cp·dp."""
    dp = 1
    if spec.experts:
        group = spec.ep * spec.etp
        dp = group // math.gcd(spec.tp * spec.cp, group)
    if (spec.dp, spec.zero, spec.microbatches) == (dp, 0, 1):
        return spec
    for changes in ({"dp": dp, "zero": 0, "microbatches": 1}, {"dp": dp, "zero": 0}):
        try:
            return spec.replace(**changes)
        except SpecError:
            continue
    return spec


def field_names() -> list[str]:
    return list(_FIELDS)


def spec_from_mapping(mapping: Mapping[str, Any], origin: str = "model") -> ModelSpec:
    """Validate a YAML-style mapping into a ModelSpec, resolving defaults.

    `origin` prefixes error messages (a file name or preset name) so that the user knows
    which description is wrong.
    """
    if not isinstance(mapping, Mapping):
        raise SpecError(
            f"{origin}: expected a mapping of keys to values, got {type(mapping).__name__}"
        )
    values: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or key not in _FIELDS:
            raise SpecError(f"{origin}: unknown key {quote(key)}{_did_you_mean(key)}")
        values[key] = coerce_value(origin, key, value)
    missing = [key for key in _REQUIRED if key not in values]
    if values.get("kind") == "mlp":
        values.setdefault("seq", 1)
        missing = [key for key in missing if key != "seq"]
    if missing:
        raise SpecError(f"{origin}: missing required key {missing[0]!r}")
    try:
        return ModelSpec(**values)
    except SpecError as error:
        raise SpecError(f"{origin}: {error}") from None


def _did_you_mean(key: Any) -> str:
    key = key if isinstance(key, str) and len(key) < 100 else ""
    close = difflib.get_close_matches(key, _FIELDS, n=1, cutoff=0.6) if key else []
    return f" (did you mean {close[0]!r}?)" if close else f"; valid keys: {', '.join(_FIELDS)}"


def coerce_value(origin: str, key: str, value: Any) -> Any:
    if key in _NULLABLE and value is None:
        return None
    if key in _LAYER_SET_FIELDS:
        return _coerce_layer_set(origin, key, value)
    if key == "moe_imbalance":
        return _coerce_imbalance(origin, value)
    if key in _BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise SpecError(f"{origin}: key {key!r} expects true or false, got {quote(value)}")
    if key in _STR_FIELDS:
        if not isinstance(value, str):
            raise SpecError(f"{origin}: key {key!r} expects a string, got {quote(value)}")
        if len(value) > MAX_TEXT_CHARS:
            raise SpecError(
                f"{origin}: key {key!r} is {len(value):,} characters long; at most "
                f"{MAX_TEXT_CHARS:,} are accepted"
            )
        return value
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise SpecError(f"{origin}: key {key!r} expects a number, got {quote(value)}")
        if isinstance(value, str) and not value.isascii():  # float() reads '٠.١', '０.１'
            raise SpecError(
                f"{origin}: key {key!r} expects a number in ASCII digits, got {quote(value)}"
            )
        try:
            return float(value)
        except (ValueError, OverflowError):
            raise SpecError(f"{origin}: key {key!r} expects a number, got {quote(value)}") from None
    # integers: accept ints and integer-valued strings/floats (from --set), nothing else
    if isinstance(value, bool):
        raise SpecError(f"{origin}: key {key!r} expects an integer, got {quote(value)}")
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
    raise SpecError(f"{origin}: key {key!r} expects an integer, got {quote(value)}")


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


def _validate_ranges(spec: ModelSpec) -> None:
    """Every size key inside its documented range (before anything divides by it)."""
    for key, (low, high) in SIZE_RANGES.items():
        value = getattr(spec, key)
        if value is None:  # a nullable key left to its default
            continue
        if value < low and low == 1:
            raise SpecError(f"key {key!r} must be a positive integer, got {quote(value)}")
        if value < low:
            raise SpecError(f"key {key!r} must be >= {low}, got {quote(value)}")
        if value > high and key != "zero":
            raise SpecError(f"key {key!r} must be in {low:,}..{high:,}, got {quote(value)}")


def _validate(spec: ModelSpec) -> None:
    for key, allowed in ENUMS.items():
        if getattr(spec, key) not in allowed:
            raise SpecError(
                f"key {key!r} must be one of {', '.join(allowed)}, got {quote(getattr(spec, key))}"
            )
    if not spec.profile.strip():
        raise SpecError(
            "key 'profile' expects a profile name (fused, torch-eager, ...) or a .yaml file"
        )
    if spec.kind == "mlp" and spec.profile != "fused":
        raise SpecError("key 'profile' applies to kind: transformer; the seed MLP has no profiles")
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
    if spec.first_stage_layers is not None or spec.last_stage_layers is not None:
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
    if spec.sp and spec.tp == 1:
        raise SpecError("key 'sp' (sequence parallelism) needs tp > 1")
    if spec.seq % spec.cp:
        raise SpecError(f"key 'cp' ({spec.cp}) must divide seq ({spec.seq})")
    if not 0.0 <= spec.capacity_factor <= 1e6:
        raise SpecError(f"key 'capacity_factor' must be >= 0, got {spec.capacity_factor}")
    _validate_layer_sets(spec)
    _validate_mla(spec)
    _validate_moe(spec)


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
    from ckplan.model.layers import LayerSetError, parse_layer_set

    if spec.sliding_window_layers != "all" and not spec.sliding_window:
        raise SpecError("key 'sliding_window_layers' needs a sliding_window > 0")
    for key in sorted(_LAYER_SET_FIELDS):
        if getattr(spec, key).strip().lower() in ("all", "none"):
            continue  # valid for any depth; no need to build the set
        try:
            parse_layer_set(getattr(spec, key), spec.layers)
        except LayerSetError as error:
            raise SpecError(f"key {key!r}: {error}") from None


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


def _validate_moe(spec: ModelSpec) -> None:
    if not spec.experts:
        for key, default in (("ep", 1), ("shared_experts", 0), ("shared_ffn_hidden", 0)):
            if getattr(spec, key) != default:
                raise SpecError(f"key {key!r} needs a mixture of experts (experts > 0)")
        if spec.capacity_factor or spec.shared_expert_gate or spec.expert_bias:
            raise SpecError(
                "keys capacity_factor, shared_expert_gate, expert_bias need experts > 0"
            )
        for key, default in (("moe_layers", "all"), ("moe_imbalance", "average"), ("top_k", 2)):
            if getattr(spec, key) != default:
                raise SpecError(f"key {key!r} needs a mixture of experts (experts > 0)")
        return
    from ckplan.model.layers import parse_layer_set

    if spec.kind != "transformer":
        raise SpecError("key 'experts' needs kind: transformer")
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
