"""Options to what the library takes: `resolve` turns a command's model, --set and its
shortcuts, --gpu, --budget and --reserve into one `Resolved` (the model spec, the GPU, the budget
in bytes), the same way for every command; and the checks of --formula, --slots and --format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from ckplan.cli.errors import UserError
from ckplan.cli.options import FORMATS
from ckplan.inputs import safe_yaml
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.spec import ModelSpec
from ckplan.plan import FORMULAS, limits
from ckplan.plan.search import DEFAULT_RESERVE
from ckplan.plan.strategies import formula_name
from ckplan.quoting import quote, shorten
from ckplan.units import parse_size

if TYPE_CHECKING:
    from ckplan.hardware.gpus import GPU

GPU_PREFIX = "gpu."


@dataclass(frozen=True)
class Resolved:
    """What a command's options resolve to: a model, a GPU (or none), and a budget (or none)."""

    spec: ModelSpec
    gpu: GPU | None = None
    budget_text: str | None = None  # as the user reads it: --budget, or the GPU's memory
    budget_bytes: int | None = None
    reserve_bytes: int | None = None

    @property
    def usable_bytes(self) -> int | None:
        """The budget less the reserve: what a plan's reserved peak must fit."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.reserve_bytes


def resolve(
    model: str,
    *,
    settings: list[str] | None = None,
    seq: int | None = None,
    batch: int | None = None,
    layers: int | None = None,
    moe_imbalance: str | None = None,
    profile: str | None = None,
    gpu: str | None = None,
    budget: str | None = None,
    reserve: str | None = None,
    need_budget: bool = False,
    gpu_keys: str | None = None,
) -> Resolved:
    """The one way every command turns its options into a model, a GPU and a budget.
    `need_budget`: --budget or --gpu must give one; `gpu_keys`: this command (named) takes no
    GPU, so `--set gpu.KEY` is refused rather than ignored."""
    if gpu_keys is not None:
        no_gpu_keys(settings, gpu_keys)
    spec = load_spec(model, parse_overrides(settings, seq, batch, layers, moe_imbalance, profile))
    device = resolve_gpu(gpu, settings)
    budgets = (require_budget if need_budget else resolve_budget)(budget, reserve, device)
    if budgets is None:
        return Resolved(spec, device)
    text, total, kept = budgets
    return Resolved(spec, device, text, total, kept)


def parse_overrides(
    settings: list[str] | None,
    seq: int | None,
    batch: int | None,
    layers: int | None,
    moe_imbalance: str | None = None,
    profile: str | None = None,
) -> dict[str, Any]:
    overrides = {
        key: value for key, value in _settings(settings).items() if not key.startswith(GPU_PREFIX)
    }
    shortcuts = (
        ("seq", seq),
        ("micro_batch", batch),
        ("layers", layers),
        ("moe_imbalance", moe_imbalance),
        ("profile", profile),
    )
    for key, value in shortcuts:
        if value is not None:
            overrides[key] = value
    return overrides


def _settings(settings: list[str] | None) -> dict[str, Any]:
    """Every --set key=value, values parsed as YAML scalars."""
    parsed: dict[str, Any] = {}
    for setting in settings or []:
        key, sep, raw = setting.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {quote(setting)}: expected key=value, e.g. --set seq=4096")
        try:
            value = safe_yaml.load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw  # not a YAML scalar: the spec says what the key expects
        parsed[key.strip()] = value
    return parsed


def resolve_model(
    model: str, settings, seq, batch, layers, moe_imbalance=None, profile=None
) -> ModelSpec:
    return load_spec(model, parse_overrides(settings, seq, batch, layers, moe_imbalance, profile))


def no_gpu_keys(settings: list[str] | None, command: str) -> None:
    """Commands without --gpu refuse `--set gpu.KEY=...` rather than ignore it."""
    for key in _settings(settings):
        if key.startswith(GPU_PREFIX):
            raise UserError(f"--set {quote(key)}: {command} takes no GPU, so GPU keys do not apply")


def resolve_gpu(gpu: str | None, settings: list[str] | None) -> GPU | None:
    """The --gpu preset or file with the --set gpu.KEY=VALUE overrides applied."""
    overrides = {
        key.removeprefix(GPU_PREFIX): value
        for key, value in _settings(settings).items()
        if key.startswith(GPU_PREFIX)
    }
    if gpu is None:
        if overrides:
            key = next(iter(overrides))
            raise UserError(f"--set gpu.{shorten(key)}: GPU keys need --gpu NAME|FILE")
        return None
    return load_gpu(gpu, overrides)


def resolve_budget(
    budget: str | None, reserve: str | None, gpu: GPU | None
) -> tuple[str, int, int] | None:
    """(budget as the user reads it, total bytes, reserve bytes): --budget, else the GPU's
    memory; None when neither is given."""
    if budget is not None:
        return (budget, *parse_budget(budget, reserve))
    if gpu is None:
        return None
    # Whole GB where the memory is (datasheet figures), else the exact bytes: CUDA-reported sizes
    # are not round, and a decimal like 85.100331008GB reads worse than the integer.
    whole, rest = divmod(gpu.memory_bytes, 10**9)
    text = f"{whole}GB" if not rest else f"{gpu.memory_bytes}"
    total, kept = parse_budget(text, reserve)
    return text, total, kept


def output_options(
    fmt: str | None, as_json: bool, mfu_convention: str = "full", plot: str | None = None
) -> tuple[str, str]:
    """The options every planning command checks before any work: the output format, the MFU
    convention, and the --plot file (writable, its extra installed)."""
    fmt = output_format(fmt, as_json)
    mfu_convention = check_mfu_convention(mfu_convention)
    if plot is not None:
        from ckplan.cli.lazy import plots

        plots().check_plot(plot)
    return fmt, mfu_convention


def check_mfu_convention(convention: str) -> str:
    """The FLOP convention --mfu-convention names (ckplan.model.flops.FLOP_CONVENTIONS)."""
    from ckplan.model.flops import FLOP_CONVENTIONS

    if convention not in FLOP_CONVENTIONS:
        raise UserError(
            f"--mfu-convention {quote(convention)}: expected one of {', '.join(FLOP_CONVENTIONS)}"
        )
    return convention


def check_formula(formula: str) -> str:
    """The formula set --formula names (`seed`, the simple set's old name, is accepted)."""
    name = formula_name(formula)
    if name not in FORMULAS:
        raise UserError(
            f"--formula {quote(formula)}: expected one of {', '.join(FORMULAS)} (or seed, the "
            "simple set's old name)"
        )
    return name


def output_format(fmt: str | None, as_json: bool) -> str:
    """--format, with --json as its alias for json."""
    if fmt is not None and fmt not in FORMATS:
        raise UserError(f"--format {quote(fmt)}: expected one of {', '.join(FORMATS)}")
    if as_json and fmt not in (None, "json"):
        raise UserError(f"--json and --format {shorten(fmt)} disagree: give one of them")
    return "json" if as_json else fmt or "table"


def parse_budget(budget: str, reserve: str | None) -> tuple[int, int]:
    total = parse_size(budget)
    kept = DEFAULT_RESERVE if reserve is None else parse_size_or_zero(reserve)
    if kept >= total:
        raise UserError(
            f"--reserve ({shorten(reserve or '2GiB')}) must be smaller than --budget "
            f"({shorten(budget)})"
        )
    return total, kept


def require_budget(budget: str | None, reserve: str | None, gpu: GPU | None):
    budgets = resolve_budget(budget, reserve, gpu)
    if budgets is None:
        raise UserError("--budget SIZE (or --gpu NAME, which sets it) is required")
    return budgets


def parse_size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else parse_size(text)


def check_slots(slots: int) -> int:
    return limits.check_slots(slots)
