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
    return measure_frozen(harness, harness.LlamaLayer(cfg), cfg, targets, rank, dropout)


def measure_frozen(harness, layer, cfg, targets, rank, dropout):
    """What autograd saves in `layer` with every base weight frozen (the norms' too) and
    adapters on `targets`, by op tag."""
    layer = layer.to(dtype=cfg.torch_dtype).train()
    layer.requires_grad_(False)
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

    # the op table's fused kernels, as ckplan's blocks run them (adapters alone would default
    # to the Trainer's eager ones)
    mapping = harness.ckplan_mapping_for(cfg) | {"training": training, "framework": "megatron"}
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


class NativeDropout(nn.Module):
    """nn.Dropout as CUDA runs it (torch.native_dropout: a 1-byte mask)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return torch.native_dropout(x, self.p, True)[0]


class Holder:
    """What the pack hook hands autograd: alive while a graph node keeps it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor):
        self.tensor = tensor


def live_saved_bytes(harness, layer, x):
    """Bytes by op of the storages autograd still holds after the forward, each counted once
    under the op that saved it first: DoRA forms B·A through lora_A(eye) and detaches it, so
    that graph (and what it saved) is freed at once. Only the storages are kept here (to keep
    their addresses unique), not the tensors: a kept tensor would keep its graph alive."""
    import gc
    import weakref

    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in layer.buffers()}
    tags = harness.SavedTensorRecorder(exclude)  # the layer tags its ops through it
    saved: dict[int, tuple[str, int, list]] = {}
    storages = []

    def pack(t):
        holder = Holder(t)
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            entry = saved.setdefault(storage.data_ptr(), (tags.current, storage.nbytes(), []))
            entry[2].append(weakref.ref(holder))
            storages.append(storage)
        return holder

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor):
        out = layer(x, tags)
    gc.collect()
    by_op: dict[str, int] = {}
    for op, nbytes, refs in saved.values():
        if any(ref() is not None for ref in refs):
            by_op[op] = by_op.get(op, 0) + nbytes
    return out, by_op


DORA_CASES = [(("q_proj", "v_proj"), 0.0), (TARGET_MODULES, 0.05), (("o_proj", "up_proj"), 0.1)]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("targets", "dropout"), DORA_CASES)
def test_peft_dora_saved_bytes_match_autograd(harness, dtype, targets, dropout):
    """PEFT's own DoRA (use_dora=True) on the frozen Llama layer: what autograd holds after
    the forward, by site (a linear with its adapters), is ckplan's to the byte, and PEFT's
    trainable parameters (A, B and the magnitude vector) are ckplan's count."""
    from needs_frameworks import framework_or_skip

    peft = framework_or_skip("peft", "DoRA not checked against PEFT")
    from ckplan.inputs.presets import spec_from_values
    from ckplan.model.finetune import lora_layer_parameters
    from ckplan.model.memory import activation_bytes_by_op

    cfg = harness.Config(
        f"llama-{dtype}-dora",
        "llama",
        dtype,
        kv_heads=2,
        ffn_hidden=704,
        norm_impl="fused",
        attention="sdpa",
        swiglu_impl="eager",
    )
    torch.manual_seed(0)
    layer = harness.LlamaLayer(cfg).to(dtype=cfg.torch_dtype).train()
    layer.requires_grad_(False)
    config = peft.LoraConfig(r=8, target_modules=list(targets), lora_dropout=dropout, use_dora=True)
    peft.inject_adapter_in_model(config, layer)
    layer.to(dtype=cfg.torch_dtype)
    if dropout:
        for name in targets:
            getattr(layer, name).lora_dropout["default"] = NativeDropout(dropout)
    x = torch.randn(cfg.micro_batch, cfg.seq, cfg.hidden, dtype=cfg.torch_dtype)
    x.requires_grad_(True)
    out, measured = live_saved_bytes(harness, layer, x)
    out.float().sum().backward()
    magnitudes = [p for n, p in layer.named_parameters() if "lora_magnitude_vector" in n]
    assert len(magnitudes) == len(targets) and all(p.grad is not None for p in magnitudes)

    mapping = harness.ckplan_mapping_for(cfg) | {"training": "lora", "use_dora": True}
    mapping |= {"framework": "megatron"}  # the op table's fused kernels, as in `predict`
    mapping |= {"lora_rank": 8, "lora_targets": ",".join(targets), "lora_dropout": dropout}
    spec = spec_from_values(mapping, origin=cfg.name)
    predicted = activation_bytes_by_op(spec)
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
    trainable = sum(p.numel() for p in layer.parameters() if p.requires_grad)
    assert trainable == lora_layer_parameters(spec)


# ---- a mixture of experts with frozen base weights (validation/torch_moe_mla.py) -------------

MOE_CASES = [
    ("frozen", (), 0.0),
    ("lora", ("q_proj", "v_proj"), 0.0),
    ("lora", ("q_proj", "k_proj", "v_proj", "o_proj"), 0.1),
]


def measure_moe(harness, cfg, targets, rank, dropout):
    """What autograd saves in validation/torch_moe_mla.py's MoE layer with every base weight
    frozen (the experts', the router's and the shared experts' too) and adapters on `targets`."""
    sys.path.insert(0, str(SCRIPT.parent))
    import torch_moe_mla

    torch.manual_seed(0)
    return measure_frozen(harness, torch_moe_mla.MoELayer(cfg), cfg, targets, rank, dropout)


@pytest.mark.parametrize("name", ["moe-bf16", "moe-bf16-torchtitan", "moe-bf16-hf"])
@pytest.mark.parametrize(("training", "targets", "dropout"), MOE_CASES)
def test_frozen_experts_saved_bytes_match_autograd(harness, name, training, targets, dropout):
    """Frozen experts, router and shared experts save no input (the dispatched rows, the
    activation's output, the normed x), beside adapters on the attention projections; every
    other op saves what it saves in full training. As in full training, the fused norms keep
    an fp32 rstd per token and the router's aux loss its int64 counts and a scalar, which
    ckplan leaves out."""
    cfg = next(c for c in harness.default_configs() if c.name == name)
    rank = 8
    measured = measure_moe(harness, cfg, targets, rank, dropout)
    mapping = harness.ckplan_mapping_for(cfg) | {"training": training}
    if training == "lora":
        mapping |= {"lora_rank": rank, "lora_targets": ",".join(targets), "lora_dropout": dropout}
    from ckplan.inputs.presets import spec_from_values
    from ckplan.model.memory import activation_bytes_by_op

    predicted = activation_bytes_by_op(spec_from_values(mapping, origin=cfg.name))
    tokens = cfg.seq * cfg.micro_batch
    for op in ("router", "expert_fc1", "expert_fc2", "shared_fc1", "shared_fc2"):
        assert predicted[op] == 0, op
    sites = {
        "qkv_proj": ("qkv_proj", "qkv_proj_lora"),
        "attention_core": ("attention_core", "out_proj", "out_proj_lora"),
    }
    for tag, ops in sites.items():
        got = measured.get(tag, 0) + (measured.get("out_proj", 0) if tag == "attention_core" else 0)
        assert got == sum(predicted.get(op, 0) for op in ops), tag
    compared = set(predicted) - {op for ops in sites.values() for op in ops}
    for op in compared:
        extra = {"norm1": 4 * tokens, "norm2": 4 * tokens, "router_probs": 8 * cfg.experts + 4}
        assert measured.get(op, 0) - predicted[op] == extra.get(op, 0), op
    assert set(measured) <= set(predicted)
