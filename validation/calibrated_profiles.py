#!/usr/bin/env python3
"""Calibrated profiles against PyTorch autograd at shapes left out of the fit (docs/validation.md,
"Profiles and ckplan calibrate").

For each layer variant: `ckplan calibrate` (the library call behind the command) fits a profile
on its nine small shapes; then, at held-out shapes (calibrate's own check shape, the shape of
torch_saved_bytes.py and a larger one), the layer is measured again and `ckplan estimate`'s
per-layer figure (`memory.per_layer_activation_bytes` of a model file with `profile:` set to the
written profile, as the command computes it) is compared with it, and with the fused default.

    python validation/calibrated_profiles.py            # the table of docs/validation.md
    python validation/calibrated_profiles.py --json
    python validation/calibrated_profiles.py --hf       # also the transformers layers
    python validation/calibrated_profiles.py --backward # torch-eager's backward fields

`--backward` checks the backward fields of profiles/torch-eager.yaml instead: the Hugging Face
eager Llama block's forward + backward measured with torch_backward_peak.py (PyTorch's memory
profiler), per op and at the peak, against ckplan's walk with the torch-eager profile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

try:
    import torch
    import yaml
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("calibrated_profiles.py needs PyTorch: python3 -m pip install torch==2.13.0")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckplan.calibrate.fit import Shape, check_shape
from ckplan.calibrate.run import DTYPES, calibrate, measure
from ckplan.inputs.presets import load_spec
from ckplan.model.memory import activation_bytes_per_layer

VARIANTS = [
    # name, preset, overrides, --hf
    ("gpt-eager-dropout", "gpt2", {"dropout": 0.1}, False),
    ("gpt-sdpa", "gpt2", {"dropout": 0.0, "attention": "flash"}, False),
    ("llama-eager", "llama3-8b", {"attention": "standard"}, False),
    ("llama-eager-fp32", "llama3-8b", {"attention": "standard", "dtype_bytes": 4}, False),
    ("llama-sdpa", "llama3-8b", {}, False),
    ("hf-gpt2-eager-dropout", "gpt2", {"dropout": 0.1}, True),
    ("hf-llama-eager", "llama3-8b", {"attention": "standard"}, True),
    ("hf-llama-sdpa", "llama3-8b", {}, True),
    # QK norms per head (Qwen3) and OLMo 2's norms after the sublayers, over all heads of Q, K
    ("hf-qwen3-sdpa", "tests/fixtures/hf/Qwen3-8B/config.json", {}, True),
    ("hf-olmo2-sdpa", "tests/fixtures/hf/OLMo-2-1124-13B/config.json", {}, True),
]
ROOT = Path(__file__).resolve().parent.parent


def held_out(gqa: bool) -> list[Shape]:
    g = 2 if gqa else 8
    return [
        check_shape(gqa),
        Shape(128, 2, 256, 8, g, 704 if gqa else 1024),  # torch_saved_bytes.py's shape
        Shape(256, 4, 512, 8, g, 1408 if gqa else 2048),
    ]


def estimate_bytes(spec, shape: Shape, profile: str) -> int:
    """`ckplan estimate`'s per_layer_activation_bytes for one layer at `shape`."""
    at_shape = spec.replace(
        layers=1, seq=shape.seq, micro_batch=shape.batch, hidden=shape.hidden,
        heads=shape.heads, kv_heads=shape.kv_heads, ffn_hidden=shape.ffn,
    )  # fmt: skip
    return activation_bytes_per_layer(load_spec_from(at_shape, profile))


def load_spec_from(spec, profile: str):
    """Through a model file, as the command reads it (the profile loaded and checked)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.yaml"
        path.write_text(yaml.safe_dump({**spec.to_dict(), "profile": profile}), encoding="utf-8")
        return load_spec(str(path))


def run(hf: bool) -> list[dict]:
    rows = []
    folder = Path(tempfile.mkdtemp())
    for name, preset, overrides, needs_hf in VARIANTS:
        if needs_hf and not hf:
            continue
        config = None
        if preset.endswith("config.json"):  # the checkpoint's own model type
            preset = str(ROOT / preset)
            config = json.loads(Path(preset).read_text(encoding="utf-8"))
        spec = load_spec(preset, overrides)
        result = calibrate(spec, hf=needs_hf, name=name, hf_config=config)
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(result.profile, sort_keys=False), encoding="utf-8")
        for shape in held_out(spec.kv_heads < spec.heads):
            dtype = DTYPES[spec.dtype_bytes]
            measured = measure(spec, shape, dtype, "cpu", needs_hf, config)
            total = sum(measured.bytes_by_op.values())
            calibrated = estimate_bytes(spec, shape, str(path))
            fused = estimate_bytes(spec, shape, "fused")
            rows.append(
                {
                    "variant": name,
                    "block": result.block,
                    "shape": shape.text(),
                    "measured_bytes": total,
                    "calibrated_bytes": calibrated,
                    "calibrated_error": (calibrated - total) / total,
                    "fused_bytes": fused,
                    "fused_error": (fused - total) / total,
                    "max_fit_residual_bytes": str(result.max_residual),
                }
            )
    return rows


BACKWARD_SHAPES = [(48, 2, 192, 6, 3, 320), (128, 2, 256, 8, 2, 704), (512, 2, 256, 8, 2, 704)]


def backward(dtype: str) -> list[dict]:
    """The HF eager Llama block (bf16 or fp32) under torch_backward_peak.py, against ckplan's
    walk with the torch-eager profile. In bf16, LlamaRMSNorm saves an fp32 copy of the layer
    input x, not x, which a model frees after the layer's forward; the harness holds x (as the
    tensor it differentiates for), so one B·sbh is taken off every measured figure."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch_backward_peak as tbp
    import torch_saved_bytes as tsb

    from ckplan.calibrate.layers import Config

    mapping = tsb.ckplan_mapping_for
    tsb.ckplan_mapping_for = lambda cfg: {**mapping(cfg), "profile": "torch-eager"}
    rows = []
    try:
        for s, b, h, a, g, F in BACKWARD_SHAPES:
            cfg = Config(
                "hf-eager", "llama", dtype, seq=s, micro_batch=b, hidden=h, heads=a, kv_heads=g,
                ffn_hidden=F, norm_impl="hf", softmax_fp32=True, swiglu_impl="eager",
            )  # fmt: skip
            measured = tbp.measure_layer(cfg)
            predicted = tbp.predict_layer(cfg)
            x = s * b * h * cfg.dtype_bytes if dtype == "bfloat16" else 0
            by_op: dict[str, int] = {}
            for step in measured.steps:
                by_op[step.op] = max(by_op.get(step.op, 0), step.peak_bytes - x)
            rows.append(
                {
                    "dtype": dtype,
                    "shape": Shape(s, b, h, a, g, F).text(),
                    "measured_peak_bytes": measured.backward_peak_bytes - x,
                    "predicted_peak_bytes": predicted["peak_bytes"],
                    "ops": {
                        p["op"]: {"measured": by_op.get(p["op"], 0), "predicted": p["live_bytes"]}
                        for p in predicted["walk"]
                    },
                }
            )
    finally:
        tsb.ckplan_mapping_for = mapping
    return rows


def print_backward(rows: list[dict]) -> None:
    print(
        "| dtype | shape | measured peak | predicted peak | diff | per op: measured - predicted |"
    )
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        ops = ", ".join(f"{op} {v['measured'] - v['predicted']:+,}" for op, v in r["ops"].items())
        diff = r["measured_peak_bytes"] - r["predicted_peak_bytes"]
        print(
            f"| {r['dtype']} | {r['shape']} | {r['measured_peak_bytes']:,} | "
            f"{r['predicted_peak_bytes']:,} | {diff:+,} | {ops} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hf", action="store_true", help="also the transformers decoder layers")
    ap.add_argument("--backward", action="store_true", help="torch-eager's backward fields")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.backward:
        rows = backward("bfloat16") + backward("float32")
        if args.json:
            print(json.dumps({"torch_version": str(torch.__version__), "rows": rows}, indent=2))
        else:
            print_backward(rows)
        return 0
    rows = run(args.hf)
    if args.json:
        print(json.dumps({"torch_version": str(torch.__version__), "rows": rows}, indent=2))
        return 0
    print(f"torch {torch.__version__} on cpu\n")
    print("| variant | held-out shape | measured B | calibrated estimate B | error | fused B | "
          "fused error |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['shape']} | {r['measured_bytes']:,} | "
            f"{r['calibrated_bytes']:,} | {r['calibrated_error']:+.3%} | {r['fused_bytes']:,} | "
            f"{r['fused_error']:+.1%} |"
        )
    return 0 if all(abs(r["calibrated_error"]) < 0.01 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
