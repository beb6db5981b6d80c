"""The torch export's per-op `policy_fn` on Hugging Face transformers' LlamaDecoderLayer (CPU,
a tiny config): what selective checkpointing keeps is ckplan's tape op by op, and the gradients
are the plain step's. Skipped without torch and transformers (the `frameworks` extra)."""

import pytest
from export_snippet import recording_snippet

from ckplan.model.op_policy import kept_units, parse_policy, policy_tape_bytes, unit_ops
from ckplan.model.spec import spec_from_mapping

TINY = {
    "name": "tiny-llama",
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "ffn_hidden": 96,
    "seq": 16,
    "micro_batch": 2,
    "vocab": 128,
    "dtype_bytes": 4,
    "norm": "rmsnorm",
    "mlp": "swiglu",
    "attention": "flash",
    "positions": "rope",
    "dropout": 0,
    "bias": False,
    "framework": "hf",
}


def _layers(torch, transformers, spec):
    """Hugging Face's Llama decoder layers and rotary embedding for `spec` (fp32, SDPA)."""
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        num_hidden_layers=spec.layers,
        vocab_size=spec.vocab,
        max_position_embeddings=spec.seq,
        attention_dropout=0.0,
        attention_bias=False,
        mlp_bias=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        modeling_llama.LlamaDecoderLayer(config, index) for index in range(spec.layers)
    )
    return layers, modeling_llama.LlamaRotaryEmbedding(config)


def _kept_by_op(torch, mode):
    """Bytes of the distinct storages a selective-checkpoint context cached, per aten op and
    call (an attention kernel's call caches O and the logsumexp)."""
    seen, by_op = set(), {}
    for func, entries in mode.storage.items():
        name = str(func).split(".")[-2]
        for wrapped in entries.values():
            size = 0
            for value in wrapped if isinstance(wrapped, tuple) else (wrapped,):
                tensor = getattr(value, "val", None)
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        size += storage.nbytes()
            if size:  # a recomputed op's entry holds no tensor
                by_op.setdefault(name, []).append(size)
    return by_op


def _predicted_by_op(spec, policy):
    """ckplan's kept units as the aten ops that produce them: linear layers are `mm` (in
    layer order), the attention kernel the CPU flash kernel (O and the fp32 logsumexp)."""
    from ckplan.exports.torch_snippet import elementwise_ops

    kept = set(kept_units(spec, policy))
    elementwise = elementwise_ops(spec)
    by_op = {}
    for unit in unit_ops(spec):
        if unit.name not in kept:
            continue
        if unit.name in elementwise:  # one output per (op, count): RoPE's Q, then K
            sizes = {u.name: u.output_bytes for u in unit_ops(spec)}
            parts = (
                [sizes["q_proj"], sizes["k_proj"]] if unit.name == "rope" else [unit.output_bytes]
            )
            for (op, _), size in zip(elementwise[unit.name], parts, strict=True):
                by_op.setdefault(op, []).append(size)
            continue
        name = "mm" if unit.matmul else "_scaled_dot_product_flash_attention_for_cpu"
        by_op.setdefault(name, []).append(unit.output_bytes)
    return {op: sorted(sizes) for op, sizes in by_op.items()}


@pytest.mark.parametrize(
    "strategy",
    [
        "sac",
        "sac:matmuls",
        "sac:q_proj,o_proj,down_proj,attention",
        "sac:attention",
        # the element-wise units: norms, RoPE, the residual adds, the SwiGLU product
        "sac:norm1,rope,v_proj,attention,out_proj_add,norm2,gate_proj,up_proj,act",
        "sac:v_proj,rope,attention,out_proj_add,gate_proj,up_proj,act,fc2_add",
        "sac:norm1,norm2",
    ],
)
def test_exported_policy_fn_on_hugging_face_llama_layers(strategy):
    from needs_torch import torch_or_skip

    torch = torch_or_skip()
    transformers = pytest.importorskip("transformers")
    import torch.utils.checkpoint as checkpoint_module

    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.strategies import parse_strategy

    spec = spec_from_mapping(TINY)
    plan = evaluate(spec, parse_strategy(strategy, spec))
    policy = parse_policy(strategy)
    namespace, modes = recording_snippet(plan)
    layers, rotary = _layers(torch, transformers, spec)
    x = torch.randn(spec.micro_batch, spec.seq, spec.hidden, requires_grad=True)
    positions = torch.arange(spec.seq)[None].expand(spec.micro_batch, -1)
    cos_sin = rotary(x, positions)
    weights = torch.randn(spec.micro_batch, spec.seq, spec.hidden)

    hidden = x
    for layer in layers:  # the snippet's context_fn on each layer's checkpoint
        hidden = checkpoint_module.checkpoint(
            lambda h, layer=layer: layer(h, position_embeddings=cos_sin),
            hidden,
            use_reentrant=False,
            context_fn=namespace["context_fn"],
        )
    forward_modes = list(modes)
    assert len(forward_modes) == spec.layers
    predicted = _predicted_by_op(spec, policy)
    layer_input = x.numel() * x.element_size()
    for mode in forward_modes:
        got = {op: sorted(sizes) for op, sizes in _kept_by_op(torch, mode).items()}
        assert got == predicted
        assert sum(map(sum, got.values())) + layer_input == policy_tape_bytes(spec, policy)
    (hidden * weights).sum().backward()
    grads = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    layers.zero_grad()
    x.grad = None
    plain = x
    for layer in layers:
        plain = layer(plain, position_embeddings=cos_sin)
    (plain * weights).sum().backward()
    for got, want in zip(grads, [p.grad for p in layers.parameters()] + [x.grad], strict=True):
        torch.testing.assert_close(got, want)
