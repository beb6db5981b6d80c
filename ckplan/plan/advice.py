"""What to change when nothing fits, derived from the model's current layout.

Each direction raises one lever of the layout from where it stands (ZeRO stage; tp within a
node; pp, with Megatron's uneven split where pp does not divide the layers; dp under ZeRO 3; cp;
or a smaller micro-batch) by the least step that makes the least-memory plan (`full`
recomputation) fit, and says what that plan then needs per GPU and how many times the GPUs it
takes. A lever that cannot make it fit alone is reported with the least it reaches.

A fine-tune on one GPU (its `training` not full, or a card whose GPUs only PCIe joins) adds a
fine-tune's levers (docs/fine-tuning.md): LoRA adapters, then QLoRA's 4-bit frozen weights; an
8-bit optimizer (bitsandbytes' AdamW8bit); the optimizer step in backward; the model states in
host memory (ZeRO-Offload, FSDP's CPU offload); each with every layer recomputed and shown with
what it gives alone. On a PCIe card more GPUs come only
through data parallelism with ZeRO-3 (FSDP), never tensor, pipeline or context parallelism
across cards that PCIe joins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckplan.model.frameworks import layout_error, optimizer_implementation
from ckplan.model.spec import ModelSpec, SpecError
from ckplan.plan.evaluate import evaluate
from ckplan.plan.strategies import parse_strategy
from ckplan.units import format_bytes_auto

MAX_STEPS = 8  # doublings tried per lever (x256)
GPUS_PER_NODE = 8  # tp stays within a node when no GPU is given
LOSS_CHUNKS = (4, 8, 16, 32)  # chunk counts the loss lever tries, fewest first
PCIE_LINK = 64e9  # bytes/s one direction: PCIe Gen5 x16; a GPU link no faster is PCIe


def over_pcie(gpu) -> bool:
    """Whether the GPU's peers are joined by PCIe only (link_bytes_per_s at most Gen5 x16's)."""
    return gpu is not None and gpu.link_bytes_per_s <= PCIE_LINK


@dataclass(frozen=True)
class Advice:
    keys: dict[str, Any]  # the changed model keys (--set)
    total_bytes: int  # the least-memory plan's per-GPU memory with them
    fits: bool
    gpus_factor: float  # GPUs needed, as a multiple of the current layout's
    # model states on the host against the host memory per GPU, where the keys put them there
    # and the GPU is known: (bytes, budget)
    host: tuple[int, int] | None = None

    @property
    def settings(self) -> str:
        return " ".join(f"--set {k}={_text(v)}" for k, v in self.keys.items())

    def text(self) -> str:
        gpus = "the same GPUs" if self.gpus_factor == 1 else f"{self.gpus_factor:g}x the GPUs"
        verdict = "fits" if self.fits else "still over"
        host = ""
        if self.host is not None:
            over = " (over)" if self.host[0] > self.host[1] else ""
            host = (
                f", {format_bytes_auto(self.host[0])} of {format_bytes_auto(self.host[1])} host "
                f"memory per GPU{over}"
            )
        return (
            f"{self.settings}: {format_bytes_auto(self.total_bytes)} per GPU with full "
            f"recomputation{host} ({verdict}; {gpus})"
        )


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def least_plan(spec: ModelSpec):
    """The least-memory plan: every layer recomputed (`full`)."""
    return evaluate(spec, parse_strategy("full", spec))


def least_bytes(spec: ModelSpec) -> int:
    """Per-GPU memory of the least-memory plan (`least_plan`)."""
    return least_plan(spec).budgeted_bytes


def _gpus(spec: ModelSpec) -> int:
    return spec.tp * spec.pp * spec.cp * spec.dp


def _try(spec: ModelSpec, keys: dict[str, Any]) -> ModelSpec | None:
    try:
        return spec.replace(**keys)
    except SpecError:  # not a valid layout of this model
        return None


# levers that train the same model the same way on the same GPUs: the gradients set to None
# between steps, AdamW's fused step instead of foreach
SAME_TRAINING = frozenset({"zero_grad", "optimizer_implementation"})


def _pipeline_keys(spec: ModelSpec, pp: int) -> dict[str, Any] | None:
    """pp with the split Megatron would use: even, else embedding/loss counted as layers."""
    from ckplan.plan.layout.space import pipeline_splits

    splits = pipeline_splits(spec.layers, pp)
    if not splits:
        return None
    keys = {
        "pp": pp,
        "virtual_stages": 1,
        "first_stage_layers": None,
        "last_stage_layers": None,
        "account_for_embedding_in_pipeline_split": False,
        "account_for_loss_in_pipeline_split": False,
        "pipeline_layout": None,
    }
    return keys | splits[0].keys()


def _one_gpu_fine_tune(spec: ModelSpec, pcie: bool) -> bool:
    """A fine-tune on one GPU: its training is not full, or the card is a PCIe one."""
    return _gpus(spec) == 1 and (pcie or spec.training != "full")


def _levers(spec: ModelSpec, gpus_per_node: int, pcie: bool = False):
    """Each lever's successive settings, least change first."""
    runnable = [
        z
        for z in range(4)
        if layout_error(spec.framework, z, spec.tp, spec.pp, spec.cp, spec.ep) is None
        and (z == 1 or not spec.fp8_param_gather)  # FP8 primary weights: zero 1 (spec)
    ]
    zero = [{"zero": z} for z in runnable if z > spec.zero] if spec.dp > 1 else []
    tp = [
        {"tp": t, "sp": True}
        for t in (spec.tp * 2**k for k in range(1, MAX_STEPS))
        if t <= gpus_per_node and spec.heads % t == 0
    ]
    pp = [
        keys
        for p in (spec.pp * 2**k for k in range(1, MAX_STEPS))
        if p <= spec.layers and (keys := _pipeline_keys(spec, p)) is not None
    ]
    dp = [{"dp": spec.dp * 2**k, "zero": max(runnable)} for k in range(1, MAX_STEPS)]
    cp = [
        {"cp": c} for c in (spec.cp * 2**k for k in range(1, MAX_STEPS)) if spec.seq % (2 * c) == 0
    ]
    # the loss computed in chunks (torchtitan's chunked loss, Liger-Kernel's fused linear
    # cross-entropy): no logits of the whole vocabulary held, on the same GPUs
    loss = (
        [{"loss": f"chunked:{n}"} for n in LOSS_CHUNKS]
        if spec.vocab and not spec.loss.startswith("chunked")
        else []
    )
    micro_batch = [
        {"micro_batch": b}
        for b in sorted({spec.micro_batch // 2**k for k in range(1, MAX_STEPS)}, reverse=True)
        if b >= 1 and spec.micro_batch % b == 0
    ]
    # gradients kept zeroed between steps set to None instead (PyTorch 2's zero_grad): the
    # smallest change, first
    freed = [{"zero_grad": "none"}] if spec.zero_grad != "none" else []
    # AdamW's fused step instead of foreach: no exp_avg_sq copy at the step, same GPUs
    fused = (
        [{"optimizer_implementation": "fused"}]
        if optimizer_implementation(spec) == "foreach"
        else []
    )
    if _one_gpu_fine_tune(spec, pcie):
        if pcie:  # no tensor, pipeline or context parallelism over PCIe
            return [freed, fused, *_finetune_levers(spec), loss, micro_batch, dp]
        return [freed, fused, *_finetune_levers(spec), zero, loss, tp, pp, dp, cp, micro_batch]
    if spec.training != "full":  # a fine-tune's states to the host before more GPUs
        return [freed, fused, zero, loss, _state_offload(spec), tp, pp, dp, cp, micro_batch]
    return [freed, fused, zero, loss, tp, pp, dp, cp, micro_batch]


def _finetune_levers(spec: ModelSpec) -> list[list[dict[str, Any]]]:
    """One GPU's fine-tuning levers, least change first: train LoRA adapters (PEFT's default
    targets) instead of every weight, then QLoRA over 4-bit weights; an 8-bit AdamW; the step
    in backward (one layer's gradients held, needs one micro-batch per step)."""
    # Megatron-LM's arguments have no adapters (exports.megatron): adapters under the Trainer
    trainer = {"framework": "hf"} if spec.framework == "megatron" else {}
    training = []
    if spec.training == "full":
        training.append({"training": "lora", **trainer})
    if spec.training in ("full", "lora", "frozen"):
        training.append({"training": "qlora", **trainer})
    optimizer = [{"optimizer": "adamw-8bit"}] if spec.optimizer in ("adamw", "adamw-bf16") else []
    # its hooks free each gradient after its step: gradients kept zeroed cannot stay
    freed = {"zero_grad": "none"} if spec.zero_grad != "none" else {}
    in_backward = (
        [{"optimizer_in_backward": True, **freed}]
        if not spec.optimizer_in_backward and spec.microbatches == 1
        else []
    )
    return [training, optimizer, in_backward, _state_offload(spec)]


def _state_offload(spec: ModelSpec) -> list[dict[str, Any]]:
    """Model states to the host, as the framework runs it (frameworks.state_offload_error):
    DeepSpeed's ZeRO-Offload (offload_optimizer), then with ZeRO 3 its parameters too; FSDP's
    CPU offload (both keys, ZeRO 3). With Adam (what it models), full training or the
    adapters of a fine-tune beside its frozen weights."""
    cpu_step = ("adamw",) if spec.framework == "deepspeed" else ("adamw", "adamw-bf16")
    if spec.optimizer not in cpu_step or spec.optimizer_offload != "none":
        return []
    if spec.framework == "deepspeed":
        return [
            {"zero": max(spec.zero, 1), "optimizer_offload": "cpu"},
            {"zero": 3, "optimizer_offload": "cpu", "param_offload": "cpu"},
        ]
    if spec.framework in ("torchtitan", "hf"):
        return [{"zero": 3, "optimizer_offload": "cpu", "param_offload": "cpu"}]
    return []


def advise(
    spec: ModelSpec,
    usable_bytes: int,
    gpus_per_node: int = GPUS_PER_NODE,
    pcie: bool = False,
    host_budget: int | None = None,
) -> list[Advice]:
    """Per lever, the least change that fits (or the least memory it reaches), fitting ones
    first, fewest GPUs first; only the fitting ones when some fit, but for a fine-tune on one
    GPU, which sees every lever with what it gives. `pcie`: the GPUs are joined by PCIe only
    (`over_pcie`); `host_budget`: host memory per GPU, which model states moved to the host
    must fit (None: not checked)."""
    current = least_bytes(spec)
    if current <= usable_bytes:
        return []
    gpus = _gpus(spec)
    found: list[Advice] = []
    for lever in _levers(spec, gpus_per_node, pcie):
        best = None
        for keys in lever:
            changed = _try(spec, keys)
            if changed is None:
                continue
            plan = least_plan(changed)
            total = plan.budgeted_bytes
            host = None
            if plan.model_states.host and host_budget is not None:
                host = (plan.host_total_bytes, host_budget)
            fits = total <= usable_bytes and (host is None or host[0] <= host[1])
            shown = {k: v for k, v in keys.items() if getattr(spec, k) != v}
            advice = Advice(shown, total, fits, _gpus(changed) / gpus, host)
            if advice.fits:
                best = advice
                break
            if best is None or total < best.total_bytes:
                best = advice
        if best is not None and best.total_bytes < current:
            found.append(best)
    # what changes neither the training nor the GPUs first among equals (`SAME_TRAINING`),
    # model states on the host last: the CPU's optimizer step is slow
    found.sort(
        key=lambda a: (
            not a.fits,
            a.gpus_factor,
            not set(a.keys) <= SAME_TRAINING,
            "optimizer_offload" in a.keys,
            a.total_bytes,
        )
    )
    if _one_gpu_fine_tune(spec, pcie):  # every lever, with what it gives alone
        return found
    fitting = [a for a in found if a.fits]
    return fitting or found


def advice_lines(spec: ModelSpec, usable_bytes: int, limit: int = 3, gpu=None) -> list[str]:
    """The first `limit` pieces of advice as lines for people; `gpu` (when known) sets the
    GPUs per node, whether PCIe joins them and the host memory per GPU."""
    from ckplan.hardware.host_link import host_memory_per_gpu

    per_node = gpu.gpus_per_node if gpu is not None else GPUS_PER_NODE
    host = host_memory_per_gpu(gpu) if gpu is not None else None
    found = advise(spec, usable_bytes, per_node, over_pcie(gpu), host)
    return [a.text() for a in found[:limit]]
