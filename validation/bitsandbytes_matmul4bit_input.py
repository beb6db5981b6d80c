#!/usr/bin/env python3
"""Whether bitsandbytes' 4-bit matmul keeps its input alive after the forward, release by release,
on the CPU (ckplan.model.finetune `matmul_4bit_keeps_input`, docs/fine-tuning.md).

MatMul4Bit keeps what it keeps as a Python attribute (`ctx.tensors`), which saved-tensor hooks
do not see, so the check is a weak reference: the input is an intermediate no one else holds,
and after the forward it is either still alive (held by the autograd node) or gone. The
release's own bitsandbytes/autograd/_functions.py is run; only `functional.dequantize_4bit`,
a CUDA kernel, is replaced by a stand-in that returns the bf16 weight in the layout the real
one returns for a transposed packed weight (in x out), so no GPU and no compiled library is
needed. Unpack a release's wheel first (its sources only), e.g.

    pip download --no-deps bitsandbytes==0.43.0 -d wheels
    unzip wheels/bitsandbytes-0.43.0-*.whl 'bitsandbytes/*' -x '*.so' -d bnb-0.43.0
    python validation/bitsandbytes_matmul4bit_input.py bnb-0.43.0 bnb-0.43.2

Measured (CPU, torch 2.13): 0.43.0 keeps the input, 0.43.2 and 0.45.5 do not, as
`matmul_4bit_keeps_input` says; a JSON line per release on stdout, with ckplan's answer.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import weakref
from pathlib import Path

try:
    import torch
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("bitsandbytes_matmul4bit_input.py needs PyTorch: python3 -m pip install torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckplan.model.finetune import matmul_4bit_keeps_input


def release_functions(root: Path) -> types.ModuleType:
    """The release's autograd/_functions.py, loaded beside a stand-in `bitsandbytes.functional`
    (the only name MatMul4Bit calls there is dequantize_4bit)."""
    package = types.ModuleType("bitsandbytes")
    package.__path__ = [str(root / "bitsandbytes")]
    functional = types.ModuleType("bitsandbytes.functional")
    functional.dequantize_4bit = lambda packed, state: state["weight"].t()
    functional.__getattr__ = lambda name: object  # names imported at load time, never called
    package.functional = functional
    sys.modules.update({"bitsandbytes": package, "bitsandbytes.functional": functional})
    path = root / "bitsandbytes" / "autograd" / "_functions.py"
    spec = importlib.util.spec_from_file_location("bitsandbytes.autograd._functions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def keeps_input(functions: types.ModuleType) -> bool:
    """Run MatMul4Bit on a (4 x 16) input and a (32 x 16) weight; is the input alive after?"""
    weight = torch.randn(32, 16, dtype=torch.bfloat16)
    packed = torch.zeros(32 * 16 // 4, 1, dtype=torch.bfloat16)  # bf16 quant storage
    leaf = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    x = leaf * 1.0
    alive = weakref.ref(x)
    out = functions.MatMul4Bit.apply(x, packed.t(), None, None, {"weight": weight})
    del x
    kept = alive() is not None
    out.float().sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape
    return kept


def version_of(root: Path) -> str:
    text = (root / "bitsandbytes" / "__init__.py").read_text()
    line = next(line for line in text.splitlines() if line.startswith("__version__"))
    return line.split("=")[1].strip().strip("\"'")


def main(roots: list[str]) -> None:
    if not roots:
        sys.exit(__doc__)
    for root in map(Path, roots):
        version = version_of(root)
        measured = keeps_input(release_functions(root))
        print(json.dumps({"bitsandbytes": version, "keeps_input": measured,
                          "ckplan": matmul_4bit_keeps_input(version)}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
