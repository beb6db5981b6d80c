"""`ckplan calibrate`: measure what one layer of a model saves for backward, fit a profile.

For each small shape of ckplan.calibrate.fit, one layer of the described architecture is built
in PyTorch (ckplan.calibrate.layers: a GPT block for layernorm + gelu, a Hugging Face eager
Llama block for rmsnorm + swiglu; standard attention written op by op, flash as
F.scaled_dot_product_attention; with `hf`, the real Hugging Face decoder layer, ckplan.calibrate.hf)
with random weights, and run forward once under ckplan.calibrate.record's recorder: each saved
storage counted once, attributed to an op by ckplan.calibrate.attribute's rule. The elements per
op and dtype are fitted exactly (ckplan.calibrate.fit); a shape left out of the fit checks the
profile through the same code `ckplan estimate` runs (`profiles.apply_profile` on the op table).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from ckplan.calibrate.attribute import attribute, is_fused_attention, resolve
from ckplan.calibrate.block import Block, CalibrationError
from ckplan.calibrate.fit import OpFit, Shape, check_shape, fit_op, fit_shapes
from ckplan.calibrate.layers import Config, GPTLayer, LlamaLayer
from ckplan.calibrate.record import CallRecorder
from ckplan.model.finetune import frozen_ops
from ckplan.model.ops import transformer_layer_ops
from ckplan.model.profiles import (
    OP_NAMES,
    ProfileError,
    apply_profile,
    condition_text,
    field_text,
    profile_from_mapping,
    resolved_fields,
    terms_text,
)
from ckplan.model.spec import ModelSpec
from ckplan.quoting import quote

DTYPES = {2: torch.bfloat16, 4: torch.float32}
# the ops of norms, whose gains freeze with the other weights
NORM_OPS = ("norm1", "norm2", "qk_norm", "post_attn_norm", "post_mlp_norm")


@dataclass
class ShapeMeasurement:
    shape: Shape
    elements: dict[str, dict[object, int]]  # op -> dtype class ("B" or item size) -> elements
    bytes_by_op: dict[str, int]
    calls: list[str]  # the attention core's calls, for the report (e.g. the SDPA node)
    sdpa_node: str | None = None
    tags: dict[str, int] = field(default_factory=dict)  # bytes by explicit tag (own blocks)


@dataclass
class Calibration:
    spec: ModelSpec
    block: str
    device: str
    torch_version: str
    fits: dict[str, OpFit]
    samples: list[ShapeMeasurement]
    check: ShapeMeasurement
    check_predicted: dict[str, int]  # by op, through apply_profile at the check shape
    profile: dict  # the YAML mapping
    unmeasured: list[str]  # ops of the model's table the measured layer does not have
    unmodelled: list[str]  # ops measured that the model's table does not have
    cuda: dict | None = None  # --device cuda: peak memory with and without checkpointing

    @property
    def max_residual(self) -> Fraction:
        return max((fit.max_residual for fit in self.fits.values()), default=Fraction(0))

    @property
    def check_error(self) -> float:
        measured = sum(self.check.bytes_by_op.values())
        return (sum(self.check_predicted.values()) - measured) / measured


def block_description(
    spec: ModelSpec, hf: bool, hf_config: dict | None = None, module: str | None = None
) -> str:
    attention = "F.scaled_dot_product_attention" if spec.attention == "flash" else "eager attention"
    if module:
        return f"the layer of {module}"
    if hf:
        from ckplan.calibrate.hf import model_type

        layer = f"transformers' {model_type(spec, hf_config)} decoder layer ({attention})"
        finetune = spec.finetune
        if finetune.training == "frozen":
            return f"{layer}; checked with every weight frozen"
        if finetune.training == "lora":
            targets = ", ".join(finetune.adapters)
            return (
                f"{layer}; checked frozen with PEFT's LoRA r={finetune.lora_rank} on {targets}, "
                f"dropout {finetune.lora_dropout}"
            )
        return layer
    if spec.norm == "layernorm":
        return f"GPT block: nn.LayerNorm, {attention}, F.gelu, dropout {spec.dropout}"
    return f"Llama block: Hugging Face LlamaRMSNorm, {attention}, eager SwiGLU"


def own_block(spec: ModelSpec, shape: Shape, dtype: torch.dtype, device: str) -> Block:
    """The GPT (layernorm + gelu, MHA) or Llama (rmsnorm + swiglu, no dropout) block of
    ckplan.calibrate.layers at `shape`, as validation/torch_saved_bytes.py runs it."""
    if (spec.norm, spec.mlp) == ("layernorm", "gelu"):
        if spec.kv_heads != spec.heads:
            raise CalibrationError("the GPT block has a = g heads; use --hf for GQA with gelu")
        arch = "gpt"
    elif (spec.norm, spec.mlp) == ("rmsnorm", "swiglu"):
        if spec.dropout > 0:
            raise CalibrationError(
                "the Llama block has no dropout (Hugging Face Llama trains without): "
                "--set dropout=0, or --hf"
            )
        arch = "llama"
    else:
        raise CalibrationError(
            f"calibrate builds GPT (layernorm + gelu) and Llama (rmsnorm + swiglu) blocks, not "
            f"{spec.norm} + {spec.mlp}; --hf builds the Hugging Face layer"
        )
    config = Config(
        name=spec.name,
        arch=arch,
        dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
        seq=shape.seq,
        micro_batch=shape.batch,
        hidden=shape.hidden,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        ffn_hidden=shape.ffn,
        dropout=spec.dropout,
        dropout_impl="native",  # what F.dropout runs on CUDA (docs/validation.md §2)
        attention="sdpa" if spec.attention == "flash" else "standard",
        norm_impl="hf",
        softmax_fp32=True,
        swiglu_impl="eager",
    )
    layer = (GPTLayer if arch == "gpt" else LlamaLayer)(config)
    layer = layer.to(device=device, dtype=dtype).train()
    return Block(layer, lambda x, rec: layer(x, rec))


def measure(
    spec: ModelSpec,
    shape: Shape,
    dtype: torch.dtype,
    device: str,
    hf: bool,
    hf_config: dict | None = None,
    seed: int = 0,
    module: str | None = None,
    training: str = "full",
) -> ShapeMeasurement:
    """One forward of one layer at `shape`: elements saved per op and dtype class. `module`:
    the user's factory, PKG.MOD:FACTORY (`ckplan.calibrate.user`); `training`: the Hugging
    Face layer with every weight training ("full"), frozen, or frozen with PEFT's LoRA layers
    as the spec says ("lora"; ckplan.calibrate.hf). A LoRA layer is one projection to the
    attribution rule: a linear's op holds its adapters' saves too."""
    torch.manual_seed(seed)
    if module:
        from ckplan.calibrate.user import load_factory, user_block

        block = user_block(load_factory(module), module, shape, dtype, device)
    elif hf:
        from ckplan.calibrate.hf import hf_block

        block = hf_block(spec, shape, dtype, device, hf_config, training)
    else:
        block = own_block(spec, shape, dtype, device)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, dtype=dtype, device=device)
    x.requires_grad_(True)  # the layer input: the previous layer's output, an activation
    recorder = CallRecorder(block.layer, block.exclude)
    try:
        with recorder.recording():
            out = block.forward(x, recorder)
    except Exception as error:  # a layer that does not run: one line, not a traceback
        message = " ".join(str(error).split())[:200]
        raise CalibrationError(
            f"the layer's forward failed at {shape.text()} ({type(error).__name__}: {message})"
        ) from None
    try:
        labels = attribute(recorder.calls)
    except ValueError as error:
        raise CalibrationError(f"cannot map the layer's ops to ckplan's: {error}") from None
    elements: dict[str, dict[object, int]] = {}
    bytes_by_op: dict[str, int] = {}
    tags: dict[str, int] = {}
    for saves in recorder.storages.values():
        op = resolve([labels[call] for call in saves.calls])
        dtype_class = "B" if saves.dtype == dtype else saves.dtype.itemsize
        per_class = elements.setdefault(op, {})
        per_class[dtype_class] = per_class.get(dtype_class, 0) + saves.elements
        bytes_by_op[op] = bytes_by_op.get(op, 0) + saves.nbytes
        tags[saves.tags[0]] = tags.get(saves.tags[0], 0) + saves.nbytes
    core = [c.name for c, op in zip(recorder.calls, labels, strict=True) if op == "attention_core"]
    node = None
    if any(is_fused_attention(name) for name in core):
        node = _sdpa_node(out) or "the math path (no fused SDPA kernel)"
    out.float().sum().backward()  # the recorded graph is a working one
    if x.grad is None or not torch.isfinite(x.grad.float()).all():
        raise CalibrationError("the layer's backward did not produce a finite input gradient")
    return ShapeMeasurement(shape, elements, bytes_by_op, core, node, tags)


def _sdpa_node(out: torch.Tensor) -> str | None:
    """The autograd node of the SDPA kernel that ran (e.g. the CPU flash kernel, or the math
    path's ops), found by walking the graph back from the output."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if "Attention" in name or "Flash" in name or "Efficient" in name:
            return name
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return None


def calibrate(
    spec: ModelSpec,
    hf: bool = False,
    device: str = "cpu",
    name: str | None = None,
    hf_config: dict | None = None,
    module: str | None = None,
) -> Calibration:
    """Measure one layer of `spec` at the fitting shapes and the check shape, fit the profile.
    `hf_config`: the model's config.json (its model_type picks the Hugging Face layer);
    `module`: the user's own layer, PKG.MOD:FACTORY."""
    if spec.kind != "transformer":
        raise CalibrationError("calibrate measures transformer layers (kind: transformer)")
    if spec.dtype_bytes not in DTYPES:
        raise CalibrationError(
            f"calibrate runs bf16 (dtype_bytes: 2) or fp32 (4) layers, not dtype_bytes "
            f"{spec.dtype_bytes}"
        )
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CalibrationError(f"--device {quote(device)}: torch sees no CUDA device here")
    dtype = DTYPES[spec.dtype_bytes]
    gqa = spec.kv_heads < spec.heads
    if module:
        from ckplan.calibrate.user import load_factory

        load_factory(module)  # a bad factory is one error before any measurement
    tuning = finetune_training(spec, hf, module)
    samples = [
        measure(spec, shape, dtype, device, hf, hf_config, module=module)
        for shape in fit_shapes(gqa)
    ]
    held_out = measure(
        spec, check_shape(gqa), dtype, device, hf, hf_config, module=module, training=tuning
    )
    fits = _fits(samples, spec.dtype_bytes)
    frozen_fits: dict[str, OpFit] = {}
    if tuning != "full":
        frozen = [
            measure(spec, shape, dtype, device, hf, hf_config, training="frozen")
            for shape in fit_shapes(gqa)
        ]
        frozen_fits = _fits(frozen, spec.dtype_bytes)
    table = [op.name for op in transformer_layer_ops(spec)]
    unmeasured = [op for op in table if op not in fits]
    unmodelled = [op for op in fits if op not in table]
    block = block_description(spec, hf, hf_config, module)
    profile = _profile_mapping(spec, fits, unmeasured, block, device, name, samples, frozen_fits)
    predicted = _predict(spec, profile, held_out.shape)
    profile["calibration"]["check"] = {
        "shape": held_out.shape.text(),
        "measured_bytes": sum(held_out.bytes_by_op.values()),
        "predicted_bytes": sum(predicted.values()),
    }
    return Calibration(
        spec,
        block,
        device,
        str(torch.__version__),
        fits,
        samples,
        held_out,
        predicted,
        profile,
        unmeasured,
        unmodelled,
    )


def finetune_training(spec: ModelSpec, hf: bool, module: str | None) -> str:
    """How the checked layer trains: "full", or with frozen weights ("frozen", "lora") on the
    Hugging Face layer only (PEFT wraps transformers' modules; QLoRA's 4-bit layers need
    bitsandbytes on CUDA)."""
    training = spec.finetune.training
    if training == "full":
        return "full"
    if not hf or module:
        raise CalibrationError(
            f"calibrate measures training: {training} on the Hugging Face layer only (--hf)"
        )
    if training == "qlora":
        raise CalibrationError(
            "calibrate measures training: frozen and lora; qlora's 4-bit layers need "
            "bitsandbytes on a CUDA device"
        )
    if spec.finetune.use_dora:
        raise CalibrationError(
            "calibrate does not measure DoRA (use_dora); tests/test_finetune_torch.py checks it"
        )
    if training == "lora" and importlib.util.find_spec("peft") is None:
        raise CalibrationError("--hf with training: lora needs PEFT: pip install peft")
    return training


def _fits(samples: list[ShapeMeasurement], dtype_bytes: int) -> dict[str, OpFit]:
    measured_ops = [op for op in OP_NAMES if any(op in s.elements for s in samples)]
    return {
        op: fit_op(op, [(s.shape, s.elements.get(op, {})) for s in samples], dtype_bytes)
        for op in measured_ops
    }


def requires(spec: ModelSpec) -> list[str]:
    """The conditions the measured layer met: a calibrated profile describes that layer only."""
    items = [
        ((False, "attention", spec.attention),),
        ((False, "norm", spec.norm),),
        ((False, "mlp", spec.mlp),),
        ((spec.dropout == 0, "dropout", None),),
        ((spec.kv_heads == spec.heads, "gqa", None),),
        ((not spec.qk_norm, "qk_norm", None),),
        ((False, "dtype_bytes", spec.dtype_bytes),),
    ]
    if spec.qk_norm:  # per head or over all heads: one fp32 statistic per row either way
        items.insert(-1, ((False, "qk_norm_width", spec.qk_norm_width),))
    return [condition_text(item) for item in items]


def _profile_mapping(spec, fits, unmeasured, block, device, name, samples, frozen_fits) -> dict:
    """The profile of the layer as it trains in full; where the layer with every weight frozen
    saves otherwise in an op other than a linear (Hugging Face's RMSNorm keeps the normalised
    tensor only for its gain's gradient), that op's `!training=full` case. The frozen linears
    and the adapters are ckplan's own (ckplan.model.finetune.frozen_ops)."""
    ops: dict[str, dict] = {op: {"saved": fit.mapping()} for op, fit in fits.items()}
    for op in unmeasured:  # the measured layer has no such op: it saves nothing
        ops[op] = {"saved": {}}
    for op, entry in ops.items():
        if op not in NORM_OPS or not frozen_fits:  # the other ops with weights: linears
            continue
        frozen = frozen_fits[op].mapping() if op in frozen_fits else {}
        if frozen != entry["saved"]:
            entry["when"] = {"!training=full": {"saved": frozen}}
    ordered = {op: ops[op] for op in OP_NAMES if op in ops}
    return {
        "name": name or f"{spec.name}-calibrated",
        "source": f"ckplan calibrate: {block}, torch {torch.__version__!s} on {device}",
        "description": f"what autograd saves for one {spec.name} layer, measured and fitted "
        "exactly (ckplan calibrate)",
        "requires": requires(spec),
        "ops": ordered,
        "calibration": {
            "torch": str(torch.__version__),
            "device": device,
            "block": block,
            "fit_shapes": [s.shape.text() for s in samples],
            "max_residual_bytes": str(max((f.max_residual for f in fits.values()), default=0)),
        },
    }


def _predict(spec: ModelSpec, mapping: dict, shape: Shape) -> dict[str, int]:
    """What `ckplan estimate` computes for one layer at `shape` with the fitted profile."""
    at_shape = spec.replace(
        layers=1,
        pp=1,
        virtual_stages=1,
        tp=1,
        sp=False,
        cp=1,
        seq=shape.seq,
        micro_batch=shape.batch,
        hidden=shape.hidden,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        ffn_hidden=shape.ffn,
    )
    try:
        profile = profile_from_mapping(mapping, mapping["name"])
        ops = apply_profile(transformer_layer_ops(at_shape), at_shape, profile)
    except ProfileError as error:
        raise CalibrationError(f"the fitted profile does not apply: {error}") from None
    if at_shape.training != "full":
        ops = frozen_ops(ops, at_shape)
    predicted: dict[str, int] = {}
    for op in ops:
        # a linear's adapters run inside PEFT's LoRA layer: measured with the linear
        name = op.name.removesuffix("_lora")
        if op.saved_bytes or name in mapping["ops"]:
            predicted[name] = predicted.get(name, 0) + op.saved_bytes
    return predicted


def bytes_at(spec: ModelSpec, mapping: dict) -> dict[str, tuple[int, int]]:
    """Per op of the model at its own size: (fused bytes, calibrated bytes)."""
    ops = transformer_layer_ops(spec.replace(profile="fused"))
    profile = profile_from_mapping(mapping, mapping["name"])
    calibrated = apply_profile(ops, spec, profile)
    return {a.name: (a.saved_bytes, b.saved_bytes) for a, b in zip(ops, calibrated, strict=True)}


def compare_with_fused(result: Calibration) -> list[dict]:
    """Op by op of the model's table: what fused saves and what was measured, as terms and in
    bytes at the model's own size (its seq, batch and layout)."""
    from ckplan.inputs.profiles import load_profile

    fused = load_profile("fused")
    spec = result.spec.replace(profile="fused")
    at_size = bytes_at(spec, result.profile)
    written = {op for op, _ in fused.ops}  # the others are the op table's own (qk_norm, ...)
    rows = []
    for op, (fused_bytes, calibrated_bytes) in at_size.items():
        fit = result.fits.get(op)
        measured = tuple(sorted(fit.terms.items())) if fit else ()
        saved = resolved_fields(fused, op, spec).get("saved", ((),))
        rows.append(
            {
                "op": op,
                "fused": field_text(saved) if op in written else "the op table's",
                "calibrated": terms_text(measured),
                "fused_bytes": fused_bytes,
                "calibrated_bytes": calibrated_bytes,
            }
        )
    return rows
