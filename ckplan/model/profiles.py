"""Kernel profiles: the same op table with other numbers.

ckplan's op table (`ops.transformer_layer_ops`) counts what Megatron-style fused kernels save;
that table is the `fused` profile. Other code saves more or less for the same ops (Hugging Face
eager code upcasts its norms and softmax to fp32, keeps the SwiGLU gate twice, ...). A profile
says so op by op, keyed by op name: for each op it names, what the op saves for backward and,
where they differ, what its backward holds (`Op.output_grad_bytes`, `input_grad_bytes`,
`grad_workspace_bytes`), as coefficients of the sizes the tensors scale with. Ops a profile does
not name keep the table's numbers, so new ops keep theirs until a profile names them.

Terms: element counts on one GPU rank, split exactly as `ops.transformer_layer_ops` splits them
(t = tp, tokens = s·b / cp, "/ t" the largest share of a split, `ops.split_share`):

    sbh   s·b·h    a residual-stream tensor: whole on each TP rank, / t under sequence parallelism
    sbad  s·b·a·d  a tensor at the a attention heads (Q, O, the context): s·b·a·d / t, which is
                   s·b·h / t where a·d = h (not Gemma's, Qwen3-MoE's or gpt-oss's)
    sbgd  s·b·g·d  K or V at the kv heads of one rank: ceil(g / t)·d wide (one head when t > g)
    sbF   s·b·F    an MLP hidden tensor: / t
    as2b  a·s²·b   an attention-score tensor: / t (under cp, s/cp query rows against s keys)
    asb   a·s·b    one value per head and token (flash attention's logsumexp): / t
    sb    s·b      one value per token of the residual stream (a norm's statistics): / t under SP
    s2    s²       one (s, s) tensor per layer, whatever a and b (a boolean causal mask)

Coefficients are bytes per element, a linear form in B, the spec's `dtype_bytes`: "B" (a tensor
in the activation dtype), "4" (fp32 whatever the activation dtype), "1" (a bool mask), "4+B",
"8-2B", "3/2*B". An op's bytes are the sum over its terms, rounded up to a whole byte. A field
may also be a list of such mappings: the largest of them (a backward step whose peak is one of
several moments, e.g. eager attention's scale multiply).

Conditions (`when:` and `requires:`) make numbers depend on the model: `KEY=VALUE` for a model
key (`attention=flash`, `dtype_bytes=4`, `fused_swiglu=false`), a bare key for a flag or a number
that is not zero (`dropout`, `sp`), `gqa` (fewer K/V heads than Q heads on a rank), each negated
by a leading `!`, several joined by commas (all must hold). Within an op, the `when:` cases whose
conditions hold override the op's fields in the order written.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from ckplan.model.context_parallel import attention_backward_workspace_bytes
from ckplan.model.kernel_profile import Case, Condition, Field, Form, Profile, Terms
from ckplan.model.op import RESIDUAL_NORMS, Op, kv_heads_per_rank, split_share
from ckplan.model.spec import (
    CHAIN_PARTS,
    ENUMS,
    KEY_ORDER,
    PART_OF,
    ChainSpec,
    SpecError,
    coerce_value,
    model_keys,
)
from ckplan.quoting import quote

TERMS = {
    "sbh": "s·b·h, a residual-stream tensor (/ t under sequence parallelism)",
    "sbad": "s·b·a·d / t, a tensor at the attention heads",
    "sbgd": "s·b·g·d, K or V at the kv heads of one rank",
    "sbF": "s·b·F / t, an MLP hidden tensor",
    "as2b": "a·s²·b / t, an attention-score tensor",
    "asb": "a·s·b / t, one value per head and token",
    "sb": "s·b, one value per token (/ t under sequence parallelism)",
    "gsb": "g·s·b, one value per kv head and token (the kv heads of one rank)",
    "s2": "s², one (s, s) tensor per layer",
}
# Profile field -> the `Op` attribute it sets.
FIELDS = {
    "saved": "saved_bytes",
    "output_grad": "output_grad_bytes",
    "input_grad": "input_grad_bytes",
    "workspace": "grad_workspace_bytes",
}
# Every op name a layer's table may hold (ops.py); a profile naming another op is an error.
# New ops join this list with the op table (tests/test_profiles.py checks that they do).
OP_NAMES = (
    "norm1",
    "qkv_proj",
    "attn_scores",
    "softmax",
    "attn_dropout",
    "attn_values",
    "attention_core",
    "out_proj",
    "out_dropout",
    "norm2",
    "fc1",
    "act",
    "fc2",
    "mlp_dropout",
    # other layer kinds (ckplan.model.mla, ckplan.model.moe, qk_norm and Gemma's post-norms):
    # known names, so that a profile may give their numbers in the terms above
    "qk_norm",
    "post_attn_norm",
    "post_mlp_norm",
    "q_proj",
    "q_down",
    "q_norm",
    "q_up",
    "kv_down",
    "kv_norm",
    "kv_up",
    "router",
    "router_probs",
    "permute",
    "expert_fc1",
    "expert_act",
    "expert_fc2",
    "unpermute",
    "shared_fc1",
    "shared_act",
    "shared_fc2",
    "shared_gate",
)
DERIVED_FLAGS = ("gqa",)
# Conditions name the keys one GPU's op table depends on (ckplan.model.spec.ChainSpec).
CONDITION_KEYS = tuple(key for key in KEY_ORDER if PART_OF.get(key) in CHAIN_PARTS)
TOP_KEYS = ("name", "source", "description", "requires", "ops", "calibration")


class ProfileError(SpecError):
    """Invalid profile, or a profile that does not fit the model; one line naming the key."""


# ---- parsing -----------------------------------------------------------------------------

MAX_FORM_CHARS = 1000  # a coefficient is a few characters; Fraction() refuses 4,300 digits
_FORM_TERM = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]+)?(?:/[0-9]+)?)?(\*?B)?")


def parse_form(value: Any, where: str) -> Form:
    """A coefficient: an int, a decimal, or a linear form in B ("4+B", "8-2B", "3/2*B")."""
    if isinstance(value, bool):
        raise ProfileError(
            f"{where}: expected bytes per element such as 2, B or 4+B, got {quote(value)}"
        )
    if isinstance(value, int):
        return Fraction(value), Fraction(0)
    if isinstance(value, float) and math.isfinite(value):
        return Fraction(str(value)), Fraction(0)
    if isinstance(value, str) and len(value) > MAX_FORM_CHARS:
        raise ProfileError(
            f"{where}: a coefficient of {len(value):,} characters; at most {MAX_FORM_CHARS:,} "
            "are accepted"
        )
    text = value.replace(" ", "") if isinstance(value, str) else ""
    constant, per_b, position = Fraction(0), Fraction(0), 0
    while text and position < len(text):
        match = _FORM_TERM.match(text, position)
        number, b = match.group(2), match.group(3)
        if match.end() == position or (number is None and b is None) or (b == "*B" and not number):
            break
        if position > 0 and not match.group(1):
            break  # two terms must be joined by + or -
        try:
            coefficient = Fraction(number) if number else Fraction(1)
        except ZeroDivisionError:
            break
        if match.group(1) == "-":
            coefficient = -coefficient
        if b:
            per_b += coefficient
        else:
            constant += coefficient
        position = match.end()
    if not text or position != len(text):
        raise ProfileError(
            f"{where}: expected bytes per element such as 2, B, 4+B or 3/2*B, got {quote(value)}"
        )
    return constant, per_b


def format_form(form: Form) -> str:
    """The inverse of parse_form: "B", "2B", "4", "4+B", "8-2B", "3/2*B"."""
    constant, per_b = form
    parts = []
    if per_b:
        coefficient = "" if per_b in (1, -1) else str(abs(per_b))
        joint = "*" if per_b.denominator != 1 else ""
        parts.append(("-" if per_b < 0 else "") + coefficient + joint + "B")
    if constant or not parts:
        parts.append(("+" if parts and constant > 0 else "") + str(constant))
    return "".join(parts)


def _parse_field(value: Any, where: str) -> Field:
    """A mapping of terms, or a list of them: the largest (a max of linear forms)."""
    if isinstance(value, list):
        if not value:
            raise ProfileError(f"{where}: expected a mapping of terms, or a non-empty list of them")
        return tuple(_parse_terms(item, f"{where}[{i}]") for i, item in enumerate(value))
    return (_parse_terms(value, where),)


def _parse_terms(value: Any, where: str) -> Terms:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ProfileError(
            f"{where}: expected a mapping of terms to bytes per element, e.g. {{sbh: B}}"
        )
    terms = []
    for term, coefficient in value.items():
        if not isinstance(term, str) or term not in TERMS:
            raise ProfileError(f"{where}: unknown term {quote(term)}{_hint(term, TERMS)}")
        terms.append((term, parse_form(coefficient, f"{where}.{term}")))
    return tuple(sorted(terms))


def parse_condition(text: Any, where: str) -> Condition:
    """`attention=flash,!dropout,gqa` -> ((False, "attention", "flash"), (True, "dropout", None),
    (False, "gqa", None)); values are coerced as the model keys are."""
    if not isinstance(text, str) or not text.strip():
        raise ProfileError(f"{where}: expected a condition such as attention=flash or !dropout")
    items = []
    for raw in text.split(","):
        item = raw.strip()
        negated = item.startswith("!")
        key, sep, value = item.lstrip("!").partition("=")
        key = key.strip()
        known = [*CONDITION_KEYS, *DERIVED_FLAGS]
        if key not in known:
            raise ProfileError(
                f"{where}: unknown key {quote(key)} in condition {quote(text)}{_hint(key, known)}"
            )
        if sep:
            try:
                parsed = coerce_value(where, key, value.strip())
            except SpecError as error:
                raise ProfileError(str(error)) from None
            if key in ENUMS and parsed not in ENUMS[key]:
                allowed = ", ".join(ENUMS[key])
                raise ProfileError(f"{where}: {key} must be one of {allowed}, got {quote(parsed)}")
        elif key in DERIVED_FLAGS or _is_flag(key):
            parsed = None
        else:
            raise ProfileError(f"{where}: condition {quote(item)} needs a value, e.g. {key}=...")
        items.append((negated, key, parsed))
    return tuple(items)


def _is_flag(key: str) -> bool:
    default = model_keys()[key].default
    return isinstance(default, bool | int | float) and key not in ("name", "source")


def profile_from_mapping(mapping: Any, origin: str) -> Profile:
    """Validate a YAML-style mapping into a Profile; every error is one line naming the key."""
    if not isinstance(mapping, Mapping):
        raise ProfileError(f"{origin}: expected a mapping with an 'ops' key")
    for key in mapping:
        if key not in TOP_KEYS:
            raise ProfileError(f"{origin}: unknown key {quote(key)}{_hint(key, TOP_KEYS)}")
    ops = mapping.get("ops")
    if not isinstance(ops, Mapping):
        raise ProfileError(f"{origin}: key 'ops' expects a mapping of op names to their numbers")
    requires: Condition = ()
    for index, text in enumerate(_as_list(mapping.get("requires"), f"{origin}: key 'requires'")):
        requires += parse_condition(text, f"{origin}: requires[{index}]")
    entries = []
    for op, entry in ops.items():
        if op not in OP_NAMES:
            raise ProfileError(f"{origin}: unknown op {quote(op)}{_hint(op, OP_NAMES)}")
        entries.append((op, _parse_cases(entry, f"{origin}: ops.{op}")))
    for key in ("name", "source", "description"):
        if key in mapping and not isinstance(mapping[key], str):
            raise ProfileError(f"{origin}: key {key!r} expects a string")
    return Profile(
        name=str(mapping.get("name") or origin),
        source=mapping.get("source", ""),
        description=mapping.get("description", ""),
        requires=requires,
        ops=tuple(entries),
    )


def _parse_cases(entry: Any, where: str) -> tuple[Case, ...]:
    if not isinstance(entry, Mapping):
        raise ProfileError(
            f"{where}: expected a mapping with saved, output_grad, input_grad, workspace"
        )
    cases = [Case((), _parse_fields(entry, where, allow_when=True))]
    when = entry.get("when") or {}
    if not isinstance(when, Mapping):
        raise ProfileError(f"{where}.when: expected a mapping of conditions to fields")
    for condition, fields in when.items():
        inner = f"{where}.when[{condition}]"
        if not isinstance(fields, Mapping):
            raise ProfileError(f"{inner}: expected a mapping of fields")
        cases.append(Case(parse_condition(condition, inner), _parse_fields(fields, inner)))
    return tuple(cases)


def _parse_fields(entry: Mapping, where: str, allow_when: bool = False):
    fields = []
    for key, value in entry.items():
        if key == "when" and allow_when:
            continue
        if key not in FIELDS:
            allowed = [*FIELDS, "when"] if allow_when else list(FIELDS)
            raise ProfileError(f"{where}: unknown field {quote(key)}{_hint(key, allowed)}")
        fields.append((key, _parse_field(value, f"{where}.{key}")))
    return tuple(fields)


def _as_list(value: Any, where: str) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    raise ProfileError(f"{where}: expected a condition or a list of conditions")


def _hint(key: Any, choices) -> str:
    key = key if isinstance(key, str) and len(key) < 100 else ""
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6) if key else []
    return f" (did you mean {close[0]!r}?)" if close else f"; expected one of {', '.join(choices)}"


# ---- applying ----------------------------------------------------------------------------


def term_values(spec: ChainSpec) -> dict[str, int]:
    """The terms' element counts on one rank, split as `ops.transformer_layer_ops` splits them."""
    t = spec.tp
    seq_local = spec.seq // spec.cp
    tokens = seq_local * spec.micro_batch
    replicated = t if spec.sp else 1
    return {
        "sbh": split_share(tokens * spec.hidden, replicated),
        "sbad": split_share(tokens * spec.heads * spec.head_dim, t),
        "sbgd": tokens * kv_heads_per_rank(spec) * spec.head_dim,
        "sbF": split_share(tokens * spec.ffn_hidden, t),
        "as2b": split_share(spec.heads * spec.micro_batch * seq_local * spec.seq, t),
        "asb": split_share(tokens * spec.heads, t),
        "sb": split_share(tokens, replicated),
        "gsb": tokens * kv_heads_per_rank(spec),
        "s2": seq_local * spec.seq,
    }


def holds(condition: Condition, spec: ChainSpec) -> bool:
    return all(_item_holds(key, value, spec) != negated for negated, key, value in condition)


def _item_holds(key: str, value: Any, spec: ChainSpec) -> bool:
    if key == "gqa":
        return kv_heads_per_rank(spec) < spec.heads // spec.tp
    actual = getattr(spec, key)
    return bool(actual) if value is None else actual == value


def condition_text(condition: Condition) -> str:
    items = []
    for negated, key, value in condition:
        shown = (
            key
            if value is None
            else f"{key}={str(value).lower() if isinstance(value, bool) else value}"
        )
        items.append(("!" if negated else "") + shown)
    return ",".join(items)


def field_bytes(field: Field, spec: ChainSpec, values: dict[str, int] | None = None) -> Fraction:
    """The largest alternative of Σ term elements × (constant + multiple·B) bytes, exact."""
    values = values if values is not None else term_values(spec)
    B = spec.dtype_bytes
    return max(
        sum((values[t] * (constant + per_b * B) for t, (constant, per_b) in terms), Fraction(0))
        for terms in field
    )


def check_requires(profile: Profile, spec: ChainSpec) -> None:
    for item in profile.requires:
        if not holds((item,), spec):
            _, key, value = item
            if key in DERIVED_FLAGS:
                have = condition_text(((not _item_holds(key, None, spec), key, None),))
            else:
                have = condition_text(((False, key, getattr(spec, key)),))
            raise ProfileError(
                f"profile {quote(profile.name)} describes layers with {condition_text((item,))}; "
                f"the model has {have}" + _REQUIRES_HINTS.get((key, value), "")
            )


_REQUIRES_HINTS = {
    ("attention", "standard"): " (add --set attention=standard, or use --profile torch-sdpa)",
    ("attention", "flash"): " (add --set attention=flash, or use --profile torch-eager)",
}


def apply_profile(ops: tuple[Op, ...], spec: ChainSpec, profile: Profile) -> tuple[Op, ...]:
    """The op table with the numbers of the ops `profile` names replaced (derived: each field is
    Σ term × coefficient over the terms above); ops it does not name are returned unchanged.
    Raises ProfileError when the model misses the profile's `requires`, a field comes out
    negative, or the gradients no longer chain (`memory.layer_backward_walk` reads each op's
    output gradient from the input gradients of the ops after it)."""
    check_requires(profile, spec)
    values = term_values(spec)
    out = []
    for op in ops:
        changes: dict[str, int] = {}
        for case in profile.cases(op.name):
            if holds(case.condition, spec):
                for field, alternatives in case.fields:
                    exact = field_bytes(alternatives, spec, values)
                    if exact < 0:
                        raise ProfileError(
                            f"profile {quote(profile.name)}: ops.{op.name}.{field} is negative "
                            f"({exact} bytes) for this model (dtype_bytes={spec.dtype_bytes})"
                        )
                    changes[FIELDS[field]] = math.ceil(exact)
        if op.name == "attention_core" and "grad_workspace_bytes" in changes:
            # the profile gives the kernel's; Transformer Engine's context-parallel loops hold
            # their own around it
            changes["grad_workspace_bytes"] = _exchange_workspace(
                spec, changes["grad_workspace_bytes"]
            )
        out.append(dataclasses.replace(op, **changes) if changes else op)
    _check_gradients_chain(out, profile)
    return tuple(out)


def _exchange_workspace(spec: ChainSpec, kernel_workspace: int) -> int:
    """The attention core's backward transient around a kernel workspace of
    `kernel_workspace` bytes under the spec's context parallelism
    (`context_parallel.attention_backward_workspace_bytes`, as the op table builds it)."""
    heads_r = spec.heads // spec.tp
    kv_heads_r = heads_r if spec.mla else kv_heads_per_rank(spec)
    return attention_backward_workspace_bytes(spec, heads_r, kv_heads_r, kernel_workspace)


def _check_gradients_chain(ops: list[Op], profile: Profile) -> None:
    waiting = 0
    for op in reversed(ops):
        waiting -= op.output_grad_bytes
        if waiting < 0:
            raise ProfileError(
                f"profile {quote(profile.name)}: ops.{op.name}.output_grad is {-waiting} bytes "
                "more than the input gradients of the ops after it (input_grad) leave"
            )
        if op.name not in RESIDUAL_NORMS:  # their input gradients join the residual stream
            waiting += op.input_grad_bytes
    if waiting:
        raise ProfileError(
            f"profile {quote(profile.name)}: {waiting} bytes of input gradients (input_grad) are "
            "read by no op before them (output_grad)"
        )


def resolved_fields(profile: Profile, op: str, spec: ChainSpec) -> dict[str, Field]:
    """The fields `profile` sets for `op` in this model, its when-cases applied."""
    fields: dict[str, Field] = {}
    for case in profile.cases(op):
        if holds(case.condition, spec):
            fields.update(case.fields)
    return fields


def terms_text(terms: Terms) -> str:
    """ "B·sbh + 4·sb", "(4+B)·sbh", "0": a field as it reads in the docs."""
    parts = []
    for term, form in sorted(terms, key=lambda item: list(TERMS).index(item[0])):
        text = format_form(form)
        text = f"({text})" if any(c in text[1:] for c in "+-") else text
        parts.append(f"{text}·{term}")
    return " + ".join(parts) or "0"


def field_text(field: Field) -> str:
    texts = [terms_text(terms) for terms in field]
    return texts[0] if len(texts) == 1 else f"max({', '.join(texts)})"
