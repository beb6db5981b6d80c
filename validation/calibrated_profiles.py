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
from ckplan.io.presets import load_spec
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
]


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
        heads=shape.heads, kv_heads=shape.kv_heads, ffn_hidden=shape.ffn, profile=profile,
    )  # fmt: skip
    return activation_bytes_per_layer(load_spec_from(at_shape))


def load_spec_from(spec):
    """Through a model file, as the command reads it (the profile loaded and checked)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.yaml"
        path.write_text(yaml.safe_dump(spec.to_dict()), encoding="utf-8")
        return load_spec(str(path))


def run(hf: bool) -> list[dict]:
    rows = []
    folder = Path(tempfile.mkdtemp())
    for name, preset, overrides, needs_hf in VARIANTS:
        if needs_hf and not hf:
            continue
        spec = load_spec(preset, overrides)
        result = calibrate(spec, hf=needs_hf, name=name)
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(result.profile, sort_keys=False), encoding="utf-8")
        for shape in held_out(spec.kv_heads < spec.heads):
            measured = measure(spec, shape, DTYPES[spec.dtype_bytes], "cpu", needs_hf)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hf", action="store_true", help="also the transformers decoder layers")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
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
