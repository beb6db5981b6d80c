#!/usr/bin/env python3
"""Measure what PyTorch autograd saves for backward in ONE forward of one transformer layer.

This is the validation of ckplan's activation accounting (docs/validation.md). PyTorch is an
optional dependency, used only here (`pip install torch`, or `pip install '.[torch]'`); ckplan
itself never imports it.

Method
------
* Small single layers are written op by op in plain PyTorch, the way nanoGPT / Megatron /
  Hugging Face eager code writes them (no fused kernels unless a variant says so). They live in
  ckplan/calibrate/layers.py, which `ckplan calibrate` runs too.
* `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd saves. Each saved tensor
  is reduced to its underlying storage (`untyped_storage().data_ptr()`), and each storage is
  counted once, with its full `nbytes()` (that is what stays allocated). Storages of
  parameters and buffers (the weights, the causal-mask buffer) are excluded: they are model
  state, not activations.
* A storage is attributed to the op that saved it first. The "current op" is set by a context
  manager around the lines that run the op; the names are ckplan's op names (norm1, qkv_proj,
  attn_scores, softmax, attn_dropout, attn_values, out_proj, out_dropout, norm2, fc1, act, fc2,
  mlp_dropout; attention_core for scaled_dot_product_attention).

Usage
-----
    python validation/torch_saved_bytes.py                 # table for the default configs
    python validation/torch_saved_bytes.py --detail        # plus every saved storage
    python validation/torch_saved_bytes.py --json          # machine-readable
    python validation/torch_saved_bytes.py --compare       # ckplan's prediction vs measured
    python validation/torch_saved_bytes.py --config gpt-bf16-dropout --seq 256
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

try:
    import torch
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("torch_saved_bytes.py needs PyTorch: python3 -m pip install torch")


def _import_ckplan() -> None:
    repo = Path(__file__).resolve().parent.parent
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))


_import_ckplan()
# The recorder, the building blocks and the layers live in the package (ckplan calibrate runs
# them too); re-exported here for validation/torch_backward_peak.py and the tests.
from ckplan.calibrate.layers import (  # noqa: E402, F401
    Config,
    FusedRMSNorm,
    FusedSwiGLU,
    GPTLayer,
    HFRMSNorm,
    LlamaLayer,
    _FusedRMSNormFunction,
    dropout,
    repeat_kv,
)
from ckplan.calibrate.record import SavedStorage, SavedTensorRecorder, tag_tensor  # noqa: E402, F401

GPT_OPS = [
    "norm1", "qkv_proj", "q_down", "q_norm", "q_up", "kv_down", "kv_norm", "kv_up",
    "attn_scores", "softmax", "attn_dropout", "attn_values",
    "attention_core", "out_proj", "out_dropout", "norm2", "fc1", "act", "fc2", "mlp_dropout",
    "router", "router_probs", "permute", "expert_fc1", "expert_act", "expert_fc2", "unpermute",
    "shared_fc1", "shared_act", "shared_fc2",
]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Configurations (the layers and Config: ckplan/calibrate/layers.py)
# --------------------------------------------------------------------------------------------


def default_configs() -> list[Config]:
    llama = dict(arch="llama", kv_heads=2, ffn_hidden=704)  # F ~ 8h/3 rounded up to 64
    return [
        Config("gpt-fp32-dropout", "gpt", "float32", dropout=0.1,
               description="GPT, fp32, dropout 0.1 (F.dropout), standard attention"),
        Config("gpt-fp32-dropout-native", "gpt", "float32", dropout=0.1, dropout_impl="native",
               description="GPT, fp32 (precision fp32), dropout 0.1 via torch.native_dropout"),
        Config("gpt-bf16-dropout", "gpt", "bfloat16", dropout=0.1,
               description="GPT, bf16, dropout 0.1 (F.dropout), standard attention"),
        Config("gpt-bf16-dropout-native", "gpt", "bfloat16", dropout=0.1, dropout_impl="native",
               description="as gpt-bf16-dropout, dropout via torch.native_dropout (CUDA's path)"),
        Config("gpt-bf16-nodrop", "gpt", "bfloat16", dropout=0.0,
               description="GPT, bf16, no dropout, standard attention"),
        Config("gpt-bf16-maskedfill", "gpt", "bfloat16", dropout=0.0, mask="masked_fill",
               description="as gpt-bf16-nodrop, nanoGPT's masked_fill(tril == 0) causal mask"),
        Config("gpt-bf16-sdpa", "gpt", "bfloat16", dropout=0.0, attention="sdpa",
               description="GPT, bf16, no dropout, F.scaled_dot_product_attention(is_causal)"),
        Config("gpt-bf16-sdpa-dropout", "gpt", "bfloat16", dropout=0.1, dropout_impl="native",
               attention="sdpa",
               description="GPT, bf16, dropout 0.1 (native), SDPA(is_causal, dropout_p=0.1)"),
        Config("llama-bf16-torchrms", **llama, dtype="bfloat16", norm_impl="torch",
               description="Llama, bf16, nn.RMSNorm, HF eager attention (repeat_kv, fp32 softmax)"),
        Config("llama-bf16-hfrms", **llama, dtype="bfloat16", norm_impl="hf",
               description="Llama, bf16, HF LlamaRMSNorm, HF eager attention"),
        Config("llama-fp32-hfrms", **llama, dtype="float32", norm_impl="hf",
               description="Llama, fp32, HF LlamaRMSNorm, HF eager attention"),
        Config("llama-bf16-sdpa", **llama, dtype="bfloat16", norm_impl="torch", attention="sdpa",
               description="Llama, bf16, nn.RMSNorm, SDPA(is_causal, enable_gqa=True)"),
        Config("llama-bf16-sdpa-repeat", **llama, dtype="bfloat16", norm_impl="torch",
               attention="sdpa", kv_repeat=True,
               description="Llama, bf16, nn.RMSNorm, repeat_kv then SDPA(is_causal)"),
        Config("llama-bf16-fusedswiglu", **llama, dtype="bfloat16", norm_impl="torch",
               attention="sdpa", swiglu_impl="fused",
               description="as llama-bf16-sdpa, Megatron's fused SwiGLU (saves fc1 output only)"),
        Config("llama-bf16-fused", **llama, dtype="bfloat16", norm_impl="fused", attention="sdpa",
               swiglu_impl="fused",
               description="Megatron/TE-style Llama: fused RMSNorm, SDPA(GQA), fused SwiGLU"),
        Config("moe-bf16", "moe", "bfloat16", kv_heads=2, experts=8, top_k=2, moe_ffn_hidden=128,
               shared_ffn_hidden=256, attention="sdpa",
               description="Megatron-Core MoE layer: 8 experts of 128, top-2, a shared expert "
                           "of 256, weighted SwiGLU, SDPA(GQA), fused RMSNorm"),
        Config("mla-bf16", "mla", "bfloat16", heads=4, ffn_hidden=704, q_lora_rank=96,
               kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
               attention="sdpa",
               description="DeepSeek-V3-style MLA layer (Megatron's MLASelfAttention), flash "
                           "kernel contract, dense fused SwiGLU MLP"),
        Config("moe-bf16-torchtitan", "moe", "bfloat16", kv_heads=2, experts=8, top_k=2,
               moe_ffn_hidden=128, shared_ffn_hidden=256, attention="sdpa",
               framework="torchtitan",
               description="as moe-bf16, torchtitan 0.3.0's experts and combine: unweighted "
                           "SwiGLU, outputs weighted by their fp32 scores"),
        Config("mla-bf16-torchtitan", "mla", "bfloat16", heads=4, ffn_hidden=704,
               q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
               v_head_dim=32, attention="sdpa", framework="torchtitan",
               description="as mla-bf16, torchtitan 0.3.0's views: the KV latent and V "
                           "un-copied"),
        Config("moe-bf16-hf", "moe", "bfloat16", kv_heads=2, experts=8, top_k=2,
               moe_ffn_hidden=128, shared_ffn_hidden=256, attention="sdpa", framework="hf",
               description="as moe-bf16, Hugging Face's experts and combine: unweighted "
                           "SwiGLU, bf16 outputs times fp32 weights"),
        Config("mla-bf16-hf", "mla", "bfloat16", heads=4, ffn_hidden=704, q_lora_rank=96,
               kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
               attention="sdpa", framework="hf",
               description="as mla-bf16, Hugging Face's V: a view of kv_b_proj's output"),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    config: Config
    by_op: dict[str, int]
    total: int
    storages: list[SavedStorage]
    sdpa_node: str | None = None
    excluded_param_refs: int = 0
    extra: dict = field(default_factory=dict)


def measure(cfg: Config, seed: int = 0, device: str = "cpu") -> Measurement:
    torch.manual_seed(seed)
    layer_cls = {"gpt": GPTLayer, "llama": LlamaLayer}.get(cfg.arch)
    if layer_cls is None:
        here = str(Path(__file__).resolve().parent)
        if here not in sys.path:
            sys.path.insert(0, here)
        import torch_moe_mla

        layer_cls = {"moe": torch_moe_mla.MoELayer, "mla": torch_moe_mla.MLALayer}[cfg.arch]
    layer = layer_cls(cfg).to(device=device, dtype=cfg.torch_dtype).train()
    exclude = {t.untyped_storage().data_ptr() for t in layer.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in layer.buffers()}
    x = torch.randn(cfg.micro_batch, cfg.seq, cfg.hidden, dtype=cfg.torch_dtype, device=device)
    x.requires_grad_(True)  # the layer input is an activation (the previous layer's output)
    rec = SavedTensorRecorder(exclude)
    with rec.recording():
        out = layer(x, rec)
    by_op = rec.by_op()
    # Backward once, to prove the recorded graph is a working one.
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    return Measurement(
        config=cfg,
        by_op=by_op,
        total=sum(by_op.values()),
        storages=list(rec.storages.values()),
        sdpa_node=getattr(layer, "sdpa_node", None),
        excluded_param_refs=rec.excluded_refs,
    )


# --------------------------------------------------------------------------------------------
# ckplan's prediction
# --------------------------------------------------------------------------------------------


def ckplan_mapping(cfg: Config) -> dict:
    """The model keys (docs/models.md) for the same layer."""
    return {
        "name": cfg.name,
        "kind": "transformer",
        "layers": 1,
        "hidden": cfg.hidden,
        "heads": cfg.heads,
        "kv_heads": cfg.kv_heads,
        "ffn_hidden": cfg.ffn_hidden,
        "vocab": 1024,
        "seq": cfg.seq,
        "micro_batch": cfg.micro_batch,
        "dtype_bytes": cfg.dtype_bytes,
        "norm": "layernorm" if cfg.arch == "gpt" else "rmsnorm",
        "mlp": "gelu" if cfg.arch == "gpt" else "swiglu",
        "attention": "flash" if cfg.attention == "sdpa" else "standard",
        "dropout": cfg.dropout,
    }


def ckplan_mapping_for(cfg: Config) -> dict:
    """ckplan_mapping plus ckplan's optional knobs that match the measured code, where the
    installed ckplan has them (fused_swiglu: eager silu(gate) * up keeps silu(gate) too)."""
    mapping = ckplan_mapping(cfg)
    _import_ckplan()
    from ckplan.model.spec import field_names

    fields = set(field_names())
    from ckplan.model.parts import PRECISIONS

    if cfg.dtype_bytes == 4 and "fp32" in PRECISIONS:
        mapping["precision"] = "fp32"  # full-fp32 training: the same 4-byte activations
    if "fused_swiglu" in fields and cfg.arch == "llama":
        mapping["fused_swiglu"] = cfg.swiglu_impl == "fused"
    if "bias" in fields:
        mapping["bias"] = cfg.arch == "gpt"
    if "positions" in fields and cfg.arch == "llama":
        mapping["positions"] = "rope"  # parameter count only; no RoPE op is run here
    if cfg.arch in ("moe", "mla"):
        mapping |= {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": False}
        mapping["fused_swiglu"] = True
        if "framework" in fields:
            # the blocks run fused norms and SwiGLU, as Megatron's kernels, in either framework
            mapping |= {"framework": cfg.framework, "kernels": "fused"}
    if cfg.arch == "moe":
        mapping |= {
            "experts": cfg.experts,
            "top_k": cfg.top_k,
            "moe_ffn_hidden": cfg.moe_ffn_hidden,
        }
        if cfg.shared_ffn_hidden:
            mapping |= {"shared_experts": 1, "shared_ffn_hidden": cfg.shared_ffn_hidden}
    if cfg.arch == "mla":
        mapping["kv_heads"] = cfg.heads
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
            mapping[key] = getattr(cfg, key)
        mapping["v_head_dim"] = cfg.v_head_dim
    return mapping


def ckplan_prediction(cfg: Config) -> dict[str, int]:
    _import_ckplan()
    from ckplan.inputs.presets import spec_from_values
    from ckplan.model.memory import activation_bytes_by_op

    spec = spec_from_values(ckplan_mapping_for(cfg), origin=cfg.name)
    return {k: int(v) for k, v in activation_bytes_by_op(spec).items()}


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _sbh(cfg: Config) -> int:
    return cfg.seq * cfg.micro_batch * cfg.hidden


def _coef(n: int, cfg: Config) -> str:
    return f"{n / _sbh(cfg):.3f}"


def _ops_in_order(*dicts: dict[str, int]) -> list[str]:
    names = [op for op in GPT_OPS if any(op in d for d in dicts)]
    for d in dicts:
        names += [op for op in d if op not in names]
    return names


def _header(cfg: Config) -> str:
    return (
        f"== {cfg.name}: {cfg.description}\n"
        f"   s={cfg.seq} b={cfg.micro_batch} h={cfg.hidden} a={cfg.heads} g={cfg.kv_heads} "
        f"F={cfg.ffn_hidden} d={cfg.hidden // cfg.heads} dtype={cfg.dtype} "
        f"(B={cfg.dtype_bytes}) dropout={cfg.dropout} ({cfg.dropout_impl}) "
        f"attention={cfg.attention} mask={cfg.mask}"
        + (f" norm={cfg.norm_impl}" if cfg.arch == "llama" else "")
        + f"  sbh={_sbh(cfg)}"
    )


def print_measurement(m: Measurement, detail: bool) -> None:
    cfg = m.config
    print(_header(cfg))
    if m.sdpa_node:
        print(f"   SDPA autograd node: {m.sdpa_node}")
    print(f"   {'op':<15}{'bytes':>12}{'/sbh':>9}")
    for op in _ops_in_order(m.by_op):
        print(f"   {op:<15}{m.by_op[op]:>12}{_coef(m.by_op[op], cfg):>9}")
    print(f"   {'TOTAL':<15}{m.total:>12}{_coef(m.total, cfg):>9}")
    if detail:
        print("   saved storages (op, dtype, shape of first saving tensor, storage bytes, refs):")
        for st in m.storages:
            note = "" if st.tensor_bytes == st.storage_bytes else f" (a {st.tensor_bytes} B view)"
            also = f" also saved by {', '.join(st.ops[1:])}" if len(st.ops) > 1 else ""
            print(
                f"     {st.op:<15}{st.dtype:<9}{st.shape!s:<22}{st.storage_bytes:>10}"
                f"  x{st.saves}{note}{also}"
            )
    print()


def print_comparison(m: Measurement, pred: dict[str, int]) -> None:
    cfg = m.config
    print(_header(cfg))
    if m.sdpa_node:
        print(f"   SDPA autograd node: {m.sdpa_node}")
    print(f"   {'op':<15}{'predicted':>12}{'measured':>12}{'diff':>11}{'meas/pred':>11}")
    for op in _ops_in_order(pred, m.by_op):
        p, q = pred.get(op, 0), m.by_op.get(op, 0)
        ratio = f"{q / p:.3f}" if p else ("-" if q == 0 else "inf")
        flag = "" if p == q else "  *"
        print(f"   {op:<15}{p:>12}{q:>12}{q - p:>+11}{ratio:>11}{flag}")
    pt = sum(pred.values())
    print(f"   {'TOTAL':<15}{pt:>12}{m.total:>12}{m.total - pt:>+11}{m.total / pt:>11.3f}")
    for st in m.storages:
        if len(st.ops) > 1:
            print(
                f"   shared: {st.storage_bytes} B ({st.dtype} {st.shape}) saved by "
                f"{' and '.join(st.ops)}, counted once under {st.op}"
            )
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", help="config name (repeatable); default: all")
    ap.add_argument("--list", action="store_true", help="list the configs and exit")
    ap.add_argument("--seq", type=int, help="override s")
    ap.add_argument("--batch", type=int, help="override b")
    ap.add_argument("--hidden", type=int, help="override h")
    ap.add_argument("--heads", type=int, help="override a")
    ap.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="override a Config field of the chosen configs, e.g. softmax_fp32=false",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--compare", action="store_true", help="compare with ckplan's prediction")
    ap.add_argument("--detail", action="store_true", help="list every saved storage")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    configs = default_configs()
    if args.list:
        for c in configs:
            print(f"{c.name:<26}{c.description}")
        return 0
    if args.config:
        known = {c.name: c for c in configs}
        missing = [n for n in args.config if n not in known]
        if missing:
            print(f"unknown config(s): {', '.join(missing)}; see --list", file=sys.stderr)
            return 2
        configs = [known[n] for n in args.config]
    for c in configs:
        if args.seq:
            c.seq = args.seq
        if args.batch:
            c.micro_batch = args.batch
        if args.hidden:
            c.hidden = args.hidden
            c.ffn_hidden = 4 * args.hidden if c.arch == "gpt" else c.ffn_hidden
        if args.heads:
            c.heads = args.heads
            c.kv_heads = args.heads if c.arch == "gpt" else c.kv_heads

    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or key not in Config.__dataclass_fields__ or key == "name":
            print(f"--set expects FIELD=VALUE with a Config field, got {item!r}", file=sys.stderr)
            return 2
        for c in configs:
            current = getattr(c, key)
            if isinstance(current, bool):
                value = raw.lower() in ("1", "true", "yes", "on")
            elif isinstance(current, int):
                value = int(raw)
            elif isinstance(current, float):
                value = float(raw)
            else:
                value = raw
            setattr(c, key, value)
            c.description += f" [{key}={raw}]"

    results = [measure(c, device=args.device) for c in configs]
    preds = [ckplan_prediction(m.config) for m in results] if args.compare else None

    if args.json:
        runs = []
        for i, m in enumerate(results):
            run = {
                "config": asdict(m.config),
                "ckplan_spec": ckplan_mapping_for(m.config) if args.compare else None,
                "sbh": _sbh(m.config),
                "measured": {"by_op": m.by_op, "total": m.total},
                "sdpa_node": m.sdpa_node,
                "storages": [asdict(s) for s in m.storages],
            }
            if preds is not None:
                run["predicted"] = {"by_op": preds[i], "total": sum(preds[i].values())}
            runs.append(run)
        out = {"torch_version": torch.__version__, "device": args.device, "runs": runs}
        print(json.dumps(out, indent=2))
        return 0

    print(f"torch {torch.__version__} on {args.device}; bytes saved for backward by one layer "
          "forward, deduplicated by storage, parameters and buffers excluded\n")  # fmt: skip
    for i, m in enumerate(results):
        if preds is not None:
            print_comparison(m, preds[i])
        else:
            print_measurement(m, args.detail)
    untagged = [m.config.name for m in results if "untagged" in m.by_op]
    if untagged:
        print(f"warning: untagged saved tensors in {', '.join(untagged)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
