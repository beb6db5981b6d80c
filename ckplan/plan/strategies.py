"""Strategies: the `--strategy` grammar (docs/strategies.md) parsed and checked against a model.

    [selective+][moe+|experts+][MODULE+...]BASE   or a modifier alone (selective, moe, ...)

BASE is none, full, uniform:K, sequential:K, sqrt, block:N, revolve:C, optimal or every:K
(every K-th layer of a stage re-run whole from its input, the others stored: torchtitan's
per-layer selective_ac_option = "K"). The
modifiers recompute a group of ops inside every stored layer: `selective` the attention core
(Korthikanti §5), `moe` the whole MoE block (Megatron-LM --moe-layer-recompute, or
--recompute-modules moe), `experts` the routed expert MLPs only. `moe` and `experts` need a
model with experts. `offload` moves stored tapes to host memory (Beaumont et al. 2021): alone
every layer's tape, no recomputation; `offload+optimal` the joint DP over keep, offload and
recompute; `full+offload` (and any segment strategy's `+offload`) the checkpointed inputs
(docs/offloading.md). `sac+mixed` (any per-op policy +mixed): the optimal DP choosing each
layer's tape, full, the policy's, or re-run whole (ckplan.schedules.policy_mix). The MODULE
words are Megatron-Core's other --recompute-modules: layernorm, moe_act, mla_up_proj,
shared_experts (ckplan.model.modules).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ckplan.errors import InputError
from ckplan.model.modules import LAYERNORM, MLA_UP_PROJ, MOE_ACT
from ckplan.model.moe import SHARED_EXPERTS
from ckplan.model.op import ATTENTION_CORE, DENSE_MLP
from ckplan.model.op_policy import (
    NO_EXPORT,
    POLICY_PREFIX,
    POLICY_WORDS,
    SCOPED_PREFIX,
    PolicyError,
    check_policy_model,
    parse_policy,
    policy_fit_reason,
    policy_text,
)
from ckplan.model.spec import ModelSpec
from ckplan.quoting import quote

FORMULAS = ("derived", "simple")
FORMULA_ALIASES = {"seed": "simple"}  # the simple formula set's old name, still accepted


def formula_name(text: str) -> str:
    """The formula set `text` names (an alias read as its set); unchanged if it names none."""
    return FORMULA_ALIASES.get(text, text)


MOE_GROUPS = {"moe": "moe", "experts": "moe/experts"}  # modifier -> recompute group (moe.py)
# Megatron-Core's other --recompute-modules, in its order: modifier -> recompute group
# (ckplan.model.modules; the shared experts' group is moe.py's)
MODULES = {
    LAYERNORM: LAYERNORM,
    MOE_ACT: MOE_ACT,
    MLA_UP_PROJ: MLA_UP_PROJ,
    "shared_experts": SHARED_EXPERTS,
}


class StrategyError(InputError):
    """A strategy string that names no strategy, or does not fit the model."""


@dataclass(frozen=True)
class Strategy:
    """A parsed `--strategy`: `kind` with its integer `size` (K, N or C) where it takes one."""

    # none | full | uniform | sequential | sqrt | selective | block | revolve | optimal | mixed
    kind: str
    size: int | None = None
    selective: bool = False  # attention core recomputed on top of `kind`
    moe: str | None = None  # "moe" | "experts": that MoE group recomputed on top of `kind`
    mlp: bool = False  # the dense MLP (fc1, activation, fc2) recomputed on top of `kind`
    policy: str | None = None  # a per-op policy (`sac:...`, model.op_policy) in stored layers
    # what the first pass stores (tapes, checkpointed inputs) offloaded to host memory (none,
    # optimal and the segment strategies)
    offload: bool = False
    modules: tuple[str, ...] = ()  # MODULES words recomputed on top of `kind`, in their order

    @property
    def name(self) -> str:
        base = self.kind if self.size is None else f"{self.kind}:{self.size}"
        prefix = (
            ([_policy_word(self.policy)] if self.policy else [])
            + (["selective"] if self.selective else [])
            + (["mlp"] if self.mlp else [])
            + ([self.moe] if self.moe else [])
            + list(self.modules)
            + (["offload"] if self.offload and self.kind in OFFLOAD_FIRST else [])
        )
        suffix = ["offload"] if self.offload and self.kind not in OFFLOAD_FIRST else []
        if self.kind in ("none", "selective") and prefix:
            return "+".join(prefix)
        return "+".join([*prefix, base, *suffix])

    @property
    def groups(self) -> tuple[str, ...]:
        """The recompute groups (ops.py / moe.py names) re-run inside every stored layer."""
        if self.policy:
            return (self.policy,)
        groups = (ATTENTION_CORE,) if self.selective else ()
        groups += (DENSE_MLP,) if self.mlp else ()
        groups += (MOE_GROUPS[self.moe],) if self.moe else ()
        return groups + tuple(MODULES[word] for word in self.modules)


_SIZED = ("uniform", "sequential", "block", "revolve", "every")
# POLICY+mixed: the optimal DP over, per layer, the full tape, the policy's tape or a re-run
# (ckplan.schedules.policy_mix)
MIXED = "mixed"
# `offload` before these kinds' names (offload, offload+optimal: the tapes move), after the
# others' (full+offload, block:4+offload: what the first pass stores moves, checkpointed inputs
# included; ckplan.schedules.offload)
OFFLOAD_FIRST = ("none", "selective", "optimal")
_PLAIN = ("none", "full", "sqrt", "selective", "optimal")
STRATEGY_HELP = (
    "none, full, uniform:K, sequential:K, sqrt, selective, block:N, revolve:C, optimal, every:K, "
    "each "
    "with selective+, mlp+ or layernorm+... (e.g. selective+uniform:4), with experts moe+ or "
    "experts+; per-op policies sac, sac-fused, sac:OP,... (e.g. sac:matmuls%2,attention) or "
    "scoped sac@REGION=OP,.../REGION (e.g. sac@mlp=gate_proj/attention), each with +mixed; "
    "offload, full+offload, offload+optimal (docs/strategies.md)"
)
# The same list without the examples, for the error that names it: the whole of it fits the
# one error line (`ckplan.quoting.LINE_LIMIT`) after a misspelt word and its hint
STRATEGY_EXPECTED = (
    "none, full, uniform:K, sequential:K, sqrt, selective, block:N, revolve:C, optimal, every:K, "
    "each with selective+, mlp+ or layernorm+..., with experts moe+ or experts+; per-op "
    "policies sac, sac-fused, sac:OP,... or sac@REGION=OP,.../REGION; offload, full+offload, "
    "offload+optimal (docs/strategies.md)"
)


def _hint(text: str) -> str:
    """' (did you mean ...?)' for a misspelt strategy word (selectve -> selective), said before
    the long list of strategies so that a cut line keeps it."""
    import difflib

    words = [*_PLAIN, *_SIZED, *MOE_GROUPS, *MODULES, "mlp", "offload"]
    if len(text) > 100:
        return ""
    parts = text.strip().split("+")
    fixed = []
    for part in parts:
        word, sep, size = part.partition(":")
        close = difflib.get_close_matches(word.lower(), words, n=1, cutoff=0.7)
        fixed.append((close[0] if close else word) + sep + size)
    guess = "+".join(fixed)
    return f" (did you mean {guess!r}?)" if guess != text.strip() else ""


def _is_base(part: str) -> bool:
    """Whether a strategy word names a base (full, uniform:K, ...), not a modifier."""
    return part.partition(":")[0] in _SIZED + _PLAIN and part != "selective"


def _policy_word(policy: str) -> str:
    """How a strategy name spells a per-op policy: `sac` for torchtitan 0.2's, `sac-fused` for
    torchtitan 0.3.0's (`POLICY_WORDS`)."""
    words = {body: word for word, body in POLICY_WORDS.items()}
    return words.get(policy, policy)


def _is_policy_word(part: str) -> bool:
    return part in POLICY_WORDS or part.startswith((POLICY_PREFIX, SCOPED_PREFIX))


def _parse_policy(text: str, word: str, spec: ModelSpec) -> str:
    """The canonical policy of `word` (`sac`, `sac-fused` or `sac:ITEM,...`), checked against
    the model."""
    try:
        parsed = parse_policy(word)
        policy = POLICY_WORDS.get(word) or policy_text(parsed)
    except PolicyError as error:
        raise StrategyError(f"strategy {quote(text)}: {error}") from None
    why = check_policy_model(spec) or policy_fit_reason(spec, parsed)
    if why:
        raise StrategyError(f"strategy {quote(text)}: {why}")
    return policy


def parse_strategy(text: str, spec: ModelSpec) -> Strategy:
    """Parse a `--strategy` value and check its size against the layers of one pipeline stage."""
    parts = text.strip().split("+")
    words = [part for part in parts if _is_policy_word(part)]
    if words:
        if len(words) > 1 or len(parts) > 2:
            raise StrategyError(
                f"strategy {quote(text)}: a per-op policy decides every op of a layer; it "
                "combines only with one layer-level strategy (e.g. sac+block:4)"
            )
        policy = _parse_policy(text, words[0], spec)
        rest = [part for part in parts if not _is_policy_word(part)]
        if rest == [MIXED]:
            # the optimal DP choosing each layer's tape: full, the policy's, or re-run whole
            return Strategy(kind=MIXED, policy=policy)
        base = parse_strategy(rest[0], spec) if rest else Strategy("none")
        if rest and rest[0] == "full":
            return Strategy(kind="uniform", size=1)  # every layer re-run whole
        if base.mlp and "mlp" not in rest[0].split("+"):
            # mlp_tiles' MLP word: the policy decides every op of a layer (no tiles there)
            base = dataclasses.replace(base, mlp=False)
        if base.groups:
            raise StrategyError(
                f"strategy {quote(text)}: a per-op policy already decides what "
                f"{base.name} recomputes inside a layer"
            )
        if base.kind == "full":
            return Strategy("uniform", 1)  # every layer re-run whole: the policy has no say
        return dataclasses.replace(base, policy=policy)
    if MIXED in parts:
        raise StrategyError(
            f"strategy {quote(text)}: {MIXED} chooses each layer's tape between the full one "
            "and a per-op policy's: name the policy (sac+mixed or sac:OP,...+mixed)"
        )
    if len(parts) > 1 and parts[-1] == "offload":  # full+offload: the base named last
        bases = [j for j, part in enumerate(parts) if _is_base(part)]
        if bases:
            parts = [*parts[: bases[-1]], *parts[bases[-1] + 1 :], parts[bases[-1]]]
    modifiers, body = parts[:-1], parts[-1]
    if (
        body in MOE_GROUPS
        or body in MODULES
        or body in ("mlp", "offload")
        or (body == "selective" and modifiers)
    ):
        modifiers, body = [*modifiers, body], "none"
    selective = "selective" in modifiers
    mlp = "mlp" in modifiers
    offload = "offload" in modifiers
    moe = [m for m in modifiers if m in MOE_GROUPS]
    modules = tuple(word for word in MODULES if word in modifiers)
    unknown = [
        m
        for m in modifiers
        if m not in ("selective", "mlp", "offload") and m not in MOE_GROUPS and m not in MODULES
    ]
    if unknown or len(set(modifiers)) < len(modifiers) or len(moe) > 1:
        if len(moe) > 1:
            raise StrategyError(f"strategy {quote(text)}: moe already recomputes the expert MLPs")
        if not unknown and len(set(modifiers)) < len(modifiers):
            twice = next(m for m in modifiers if modifiers.count(m) > 1)
            raise StrategyError(f"strategy {quote(text)}: {twice} cannot combine with itself")
        raise StrategyError(
            f"unknown strategy {quote(text)}{_hint(text)}: expected one of {STRATEGY_EXPECTED}"
        )
    match = re.fullmatch(r"([a-z]+)(?::(-?[0-9]{1,18}))?", body)
    kind = match.group(1) if match else ""
    size = int(match.group(2)) if match and match.group(2) is not None else None
    if not match or kind not in _SIZED + _PLAIN or (kind in _PLAIN) != (size is None):
        raise StrategyError(
            f"unknown strategy {quote(text)}{_hint(text)}: expected one of {STRATEGY_EXPECTED}"
        )
    if selective and kind == "selective":
        raise StrategyError(f"strategy {quote(text)}: selective cannot combine with itself")
    if moe and not spec.experts:
        raise StrategyError(
            f"strategy {quote(text)}: {moe[0]} recomputes MoE layers; this model has none "
            "(experts: 0)"
        )
    layers = spec.layers_per_stage
    if kind in ("uniform", "sequential", "every") and not 1 <= size <= layers:
        raise StrategyError(f"strategy {quote(text)}: K must be in 1..{layers} (layers per stage)")
    if kind == "block" and not 0 <= size <= layers:
        raise StrategyError(f"strategy {quote(text)}: N must be in 0..{layers} (layers per stage)")
    if kind == "revolve" and size < 1:
        raise StrategyError(f"strategy {quote(text)}: C must be at least 1 checkpoint slot")
    if mlp and not has_dense_layers(spec):
        raise StrategyError(
            f"strategy {quote(text)}: mlp recomputes dense MLPs; every layer of this model is MoE"
        )
    if modules:
        _check_modules(text, modules, group := (moe[0] if moe else None), spec)
    if offload and kind == "revolve":
        raise StrategyError(
            f"strategy {quote(text)}: offload combines with none, optimal and the segment "
            f"strategies (full, uniform:K, sequential:K, sqrt, block:N), not with {body}: "
            "revolve re-reads its checkpoints from nested segments"
        )
    group = moe[0] if moe else None
    # TiledMLP replaces every dense MLP's forward: it is recomputed in every stored layer
    tiled_mlp = spec.mlp_tiles > 1 and has_dense_layers(spec)
    mlp = mlp or tiled_mlp
    if kind == "none" and (selective or mlp or group or offload or modules):
        name = "selective" if selective else "none"
        return Strategy(
            name, selective=selective, moe=group, mlp=mlp, offload=offload, modules=modules
        )
    if kind == "full" and (selective or group or mlp or modules):
        # full recompute already re-runs every op of every layer (TiledMLP's MLP runs its
        # backward tile by tile inside it)
        return Strategy(kind="uniform", size=1, selective=selective, mlp=tiled_mlp, offload=offload)
    return Strategy(
        kind, size, selective or kind == "selective", group, mlp, offload=offload, modules=modules
    )


def _check_modules(text: str, modules: tuple[str, ...], group: str | None, spec: ModelSpec) -> None:
    """Refuse a Megatron-Core module the model lacks, or one another modifier already covers."""
    where = f"strategy {quote(text)}"
    if spec.kind != "transformer":
        raise StrategyError(f"{where}: {modules[0]} recomputes part of a transformer layer")
    if MLA_UP_PROJ in modules and not spec.mla:
        raise StrategyError(
            f"{where}: mla_up_proj recomputes multi-head latent attention's up projections; "
            "this model has none (attention is not MLA)"
        )
    for word in (MOE_ACT, "shared_experts"):
        if word in modules and not spec.experts:
            raise StrategyError(
                f"{where}: {word} recomputes part of MoE layers; this model has none (experts: 0)"
            )
        if word in modules and group:
            raise StrategyError(f"{where}: {group} already recomputes what {word} does")
    if "shared_experts" in modules and not spec.shared_ffn_hidden:
        raise StrategyError(
            f"{where}: shared_experts recomputes the shared experts; this model has none "
            "(shared_ffn_hidden: 0)"
        )


def has_dense_layers(spec: ModelSpec) -> bool:
    """Whether any layer has a dense MLP (the `mlp` module has something to recompute)."""
    if spec.kind != "transformer":
        return False
    if not spec.experts:
        return True
    from ckplan.model.layers import parse_layer_set

    return len(parse_layer_set(spec.moe_layers, spec.layers)) < spec.layers


# The frameworks that run Megatron-Core's module recomputation (`mlp`, `moe` and the MODULES
# words; `experts`, the routed experts alone, is no module there): Megatron-LM's
# --recompute-modules (megatron/core/transformer/transformer_config.py, core_v0.19.0). No other
# framework's configuration has such a key, and the torch snippet wraps whole layers, the
# attention core or a scoped policy's regions.
MODULE_FRAMEWORKS = ("megatron",)
# A module that is a plain checkpoint of one region (exports.megatron.SCOPED_MODULES, its
# inverse): the scoped policy `sac@REGION` keeps nothing inside the same region.
MODULE_REGIONS = {"mlp": "mlp", "moe": "moe", "experts": "experts",
                  "shared_experts": "shared_experts"}  # fmt: skip


def module_words(strategy: Strategy) -> tuple[str, ...]:
    """The Megatron-Core module words `strategy` recomputes, in its name's order."""
    return (
        (("mlp",) if strategy.mlp else ())
        + ((strategy.moe,) if strategy.moe else ())
        + (strategy.modules)
    )


def scoped_equivalent(strategy: Strategy) -> str | None:
    """The scoped policy the torch snippet writes that checkpoints the same region as
    `strategy` in every stored layer (`sac@mlp` for `mlp`), or None: the output-discarding
    modules (layernorm, moe_act, mla_up_proj) are no region, the attention core is code inside a
    submodule, which the snippet does not wrap as a region, and a scoped policy beside
    recomputed layers is exported by no target (exports.torch_snippet `_scoped_reason`)."""
    words = module_words(strategy)
    if strategy.kind != "none" or strategy.selective or strategy.offload or strategy.policy:
        return None
    if not words or any(word not in MODULE_REGIONS for word in words):
        return None
    return "sac@" + "/".join(MODULE_REGIONS[word] for word in words)


def module_framework_reason(spec: ModelSpec, strategy: Strategy) -> str | None:
    """Why `spec.framework` cannot run `strategy`'s Megatron-Core module recomputation (one
    line, naming the scoped policy that checkpoints the same regions where there is one), or
    None: under Megatron-LM (but for `experts`, which is no Megatron-Core module), or when
    `strategy` recomputes no module."""
    words = module_words(strategy)
    if spec.framework in MODULE_FRAMEWORKS and "experts" in words:
        # exports.megatron: its --recompute-modules (core_v0.19.0, transformer_config.py) has moe
        # (the whole MoE layer) and moe_act (the activation), no experts-only module
        return (
            f"framework {spec.framework} cannot run {'+'.join(words)}: Megatron-Core's "
            f"--recompute-modules has moe and moe_act, no experts-only module, and {NO_EXPORT} it"
        )
    if spec.framework in MODULE_FRAMEWORKS or not words:
        return None
    reason = (
        f"framework {spec.framework} cannot run {'+'.join(words)}: Megatron-Core's "
        f"--recompute-modules has no counterpart there and {NO_EXPORT} it"
    )
    same = scoped_equivalent(strategy)
    if same is None:
        return reason
    return f"{reason}; the scoped policy {same} checkpoints the same regions (--to torch)"
