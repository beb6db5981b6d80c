"""Frozen weights and LoRA against PyTorch autograd: a Llama layer (fused RMSNorm, SDPA with
GQA, Hugging Face's eager SwiGLU) with every base weight frozen and PEFT-style adapters on the
targeted linears; the bytes saved for backward, deduplicated by storage, parameters excluded
(validation/torch_saved_bytes.py), against ckplan's per-op prediction.

The adapter is PEFT's `lora.Linear.forward` (peft v0.17.0, src/peft/tuners/lora/layer.py):
`result = self.base_layer(x); result = result + lora_B(lora_A(dropout(x))) * scaling`, with
nn.Identity for dropout 0 and, for dropout > 0, torch.native_dropout (what nn.Dropout runs on
CUDA: a 1-byte mask). Skipped without torch, failed under CKPLAN_REQUIRE_TORCH=1.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
from needs_torch import torch_or_skip

torch = torch_or_skip()
nn = torch.nn

SCRIPT = Path(__file__).resolve().parent.parent / "validation" / "torch_saved_bytes.py"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("torch_saved_bytes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class LoraLinear(nn.Module):
    """A frozen nn.Linear with a LoRA adapter beside it, as PEFT's lora.Linear runs it."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight)  # PEFT starts B at zero; any values save the same
        self.scaling = alpha / rank
        self.dropout = dropout

    def forward(self, x):
        result = self.base_layer(x)
        if self.dropout > 0:
            x = torch.native_dropout(x, self.dropout, True)[0]
        return result + self.lora_B(self.lora_A(x)) * self.scaling


def measure(harness, cfg, targets, rank, dropout):
    torch.manual_seed(0)
    layer = harness.LlamaLayer(cfg).to(dtype=cfg.torch_dtype).train()
    layer.requires_grad_(False)  # every base weight frozen, the norms' too
    for name in targets:
        adapted = LoraLinear(getattr(layer, name), rank, 2.0 * rank, dropout)
        setattr(layer, name, adapted.to(dtype=cfg.torch_dtype))
    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in layer.buffers()}
    x = torch.randn(cfg.micro_batch, cfg.seq, cfg.hidden, dtype=cfg.torch_dtype)
    x.requires_grad_(True)  # a layer after the first: its input needs a gradient
    recorder = harness.SavedTensorRecorder(exclude)
    with recorder.recording():
        out = layer(x, recorder)
    out.float().sum().backward()
    assert x.grad is not None
    for name in targets:
        assert getattr(layer, name).lora_A.weight.grad is not None
    assert all(p.grad is None for n, p in layer.named_parameters() if "lora_" not in n)
    return recorder.by_op()


def predict(harness, cfg, training, targets, rank, dropout):
    from ckplan.inputs.presets import spec_from_values
    from ckplan.model.memory import activation_bytes_by_op

    mapping = harness.ckplan_mapping_for(cfg) | {"training": training}
    if training == "lora":
        mapping |= {"lora_rank": rank, "lora_targets": ",".join(targets)}
        mapping |= {"lora_dropout": dropout}
    return activation_bytes_by_op(spec_from_values(mapping, origin=cfg.name))


CASES = [
    ("frozen", (), 0.0),
    ("lora", ("q_proj", "v_proj"), 0.0),
    ("lora", ("q_proj", "v_proj"), 0.1),
    ("lora", TARGET_MODULES, 0.0),
    ("lora", TARGET_MODULES, 0.05),
    ("lora", ("o_proj", "down_proj"), 0.0),
    ("lora", ("k_proj", "gate_proj"), 0.1),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("training", "targets", "dropout"), CASES)
def test_saved_bytes_match_autograd(harness, dtype, training, targets, dropout):
    cfg = harness.Config(
        f"llama-{dtype}-{training}",
        "llama",
        dtype,
        kv_heads=2,
        ffn_hidden=704,
        norm_impl="fused",
        attention="sdpa",
        swiglu_impl="eager",
    )
    rank = 8
    measured = measure(harness, cfg, targets if training == "lora" else (), rank, dropout)
    predicted = predict(harness, cfg, training, targets, rank, dropout)
    tokens = cfg.seq * cfg.micro_batch
    # Each linear and its adapter run under one tag in the layer: compare their sum. The
    # attention output is one storage saved by SDPA, counted with out_proj.
    sites = {
        "qkv_proj": ("qkv_proj", "qkv_proj_lora"),
        "attention_core": ("attention_core", "out_proj", "out_proj_lora"),
        "fc1": ("fc1", "fc1_lora"),
        "fc2": ("fc2", "fc2_lora"),
    }
    for tag, ops in sites.items():
        got = measured.get(tag, 0) + (measured.get("out_proj", 0) if tag == "attention_core" else 0)
        assert got == sum(predicted.get(op, 0) for op in ops), tag
    assert measured.get("act", 0) == predicted["act"]
    # the fused RMSNorm keeps an fp32 rstd per token, which ckplan leaves out
    for op in ("norm1", "norm2"):
        assert measured[op] - predicted[op] == 4 * tokens, op
    assert "untagged" not in measured


PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "torch-sdpa.yaml"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("training", "targets", "dropout"), CASES[:4])
def test_hugging_face_eager_norms_with_frozen_gains(harness, dtype, training, targets, dropout):
    """Hugging Face's LlamaRMSNorm with a frozen gain saves its fp32 input and rstd, not the
    normalized tensor `weight *` would need for the gain's gradient: the torch-sdpa profile's
    case, every op to the byte, the norms' statistics included."""
    cfg = harness.Config(
        f"llama-{dtype}-hf-{training}",
        "llama",
        dtype,
        kv_heads=2,
        ffn_hidden=704,
        norm_impl="hf",
        attention="sdpa",
        swiglu_impl="eager",
    )
    from ckplan.inputs.presets import spec_from_values
    from ckplan.model.memory import activation_bytes_by_op

    measured = measure(harness, cfg, targets, 8, dropout)
    mapping = harness.ckplan_mapping_for(cfg) | {"training": training, "profile": str(PROFILE)}
    if training == "lora":
        mapping |= {"lora_rank": 8, "lora_targets": ",".join(targets), "lora_dropout": dropout}
    predicted = activation_bytes_by_op(spec_from_values(mapping, origin=cfg.name))
    for op in ("norm1", "norm2", "act"):
        assert measured[op] == predicted[op], op
    assert sum(measured.values()) == sum(predicted.values())
