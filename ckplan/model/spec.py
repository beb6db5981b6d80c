"""The model description: a validated, immutable `ModelSpec` built from a YAML-style mapping.

The fields read as the architecture (nanoGPT's GPTConfig style). `spec_from_mapping` is the one
gate every input passes: unknown keys (with a did-you-mean hint), wrong types, non-positive
sizes, heads that do not divide hidden, and unknown enum values all raise `SpecError` with a
one-line message naming the key. Parsing files lives in `ckplan.io`; this module does no I/O.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class SpecError(ValueError):
    """Invalid model description; the message is one line and names the offending key."""


KINDS = ("transformer", "mlp")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
ATTENTIONS = ("standard", "flash")
POSITIONS = ("learned", "rope")


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
    profile: str = "fused"
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

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        _validate(self)

    @property
    def head_dim(self) -> int:
        """d = h / a."""
        return self.hidden // self.heads

    @property
    def layers_per_stage(self) -> int:
        """Transformer layers held by one pipeline stage, L / p."""
        return self.layers // self.pp

    def replace(self, **changes: Any) -> ModelSpec:
        return spec_from_mapping({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(ModelSpec)}
_REQUIRED = [name for name, f in _FIELDS.items() if f.default is dataclasses.MISSING]
_BOOL_FIELDS = {"bias", "tied_embeddings", "fused_swiglu", "sp"}
_STR_FIELDS = {"name", "source", "kind", "norm", "mlp", "attention", "positions", "profile"}
_FLOAT_FIELDS = {"dropout"}
_ENUMS = {
    "kind": KINDS,
    "norm": NORMS,
    "mlp": MLPS,
    "attention": ATTENTIONS,
    "positions": POSITIONS,
}
# Sizes that must be >= 1; vocab and zero may be 0.
_POSITIVE = {
    "layers",
    "hidden",
    "seq",
    "micro_batch",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "dtype_bytes",
    "tp",
    "pp",
    "cp",
    "dp",
    "virtual_stages",
    "microbatches",
}
_NON_NEGATIVE = {"vocab", "zero", "weight_bytes", "grad_bytes", "master_bytes", "optimizer_bytes"}


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
            raise SpecError(f"{origin}: unknown key {key!r}{_did_you_mean(str(key))}")
        values[key] = _coerce(origin, key, value)
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


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, _FIELDS, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f"; valid keys: {', '.join(_FIELDS)}"


def _coerce(origin: str, key: str, value: Any) -> Any:
    if key in ("kv_heads", "ffn_hidden") and value is None:
        return None
    if key in _BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise SpecError(f"{origin}: key {key!r} expects true or false, got {value!r}")
    if key in _STR_FIELDS:
        if not isinstance(value, str):
            raise SpecError(f"{origin}: key {key!r} expects a string, got {value!r}")
        return value
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise SpecError(f"{origin}: key {key!r} expects a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise SpecError(f"{origin}: key {key!r} expects a number, got {value!r}") from None
    # integers: accept ints and integer-valued strings/floats (from --set), nothing else
    if isinstance(value, bool):
        raise SpecError(f"{origin}: key {key!r} expects an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.replace("_", ""))
        except ValueError:
            pass
    if isinstance(value, int):
        return value
    raise SpecError(f"{origin}: key {key!r} expects an integer, got {value!r}")


def _validate(spec: ModelSpec) -> None:
    for key in _POSITIVE:
        if getattr(spec, key) < 1:
            raise SpecError(f"key {key!r} must be a positive integer, got {getattr(spec, key)}")
    for key in _NON_NEGATIVE:
        if getattr(spec, key) < 0:
            raise SpecError(f"key {key!r} must be >= 0, got {getattr(spec, key)}")
    for key, allowed in _ENUMS.items():
        if getattr(spec, key) not in allowed:
            raise SpecError(
                f"key {key!r} must be one of {', '.join(allowed)}, got {getattr(spec, key)!r}"
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
        raise SpecError(f"key 'zero' must be 0, 1, 2 or 3, got {spec.zero}")
    if spec.hidden % spec.heads:
        raise SpecError(f"key 'heads' ({spec.heads}) must divide hidden ({spec.hidden})")
    if spec.heads % spec.kv_heads:
        raise SpecError(f"key 'kv_heads' ({spec.kv_heads}) must divide heads ({spec.heads})")
    if spec.heads % spec.tp:
        raise SpecError(f"key 'tp' ({spec.tp}) must divide heads ({spec.heads})")
    if spec.kv_heads % spec.tp and spec.tp % spec.kv_heads:
        raise SpecError(
            f"key 'tp' ({spec.tp}) and kv_heads ({spec.kv_heads}) must divide one another "
            "(kv heads are split over tp ranks, or replicated when tp exceeds them)"
        )
    if spec.layers % spec.pp:
        raise SpecError(f"key 'pp' ({spec.pp}) must divide layers ({spec.layers})")
    if spec.layers_per_stage % spec.virtual_stages:
        raise SpecError(
            f"key 'virtual_stages' ({spec.virtual_stages}) must divide layers per pipeline "
            f"stage ({spec.layers_per_stage})"
        )
    if spec.sp and spec.tp == 1:
        raise SpecError("key 'sp' (sequence parallelism) needs tp > 1")
    if spec.seq % spec.cp:
        raise SpecError(f"key 'cp' ({spec.cp}) must divide seq ({spec.seq})")
