#!/usr/bin/env python3
"""What bitsandbytes' LLM.int8() matmul keeps alive after the forward of a frozen weight, release
by release, on the CPU (ckplan.model.finetune `matmul_8bit_keeps_transposed_input`, the int8
rule of `frozen_ops`, docs/fine-tuning.md).

MatMul8bitLt keeps what it keeps as Python attributes (`ctx.tensors`), which saved-tensor hooks
do not see, so the check is a weak reference on each candidate: the input (an intermediate no
one else holds) and the column-wise int8 copy of it that the quantisation returns (CAt). The
release's own bitsandbytes/autograd/_functions.py is run; the CUDA kernels it calls through
`bitsandbytes.functional` are replaced by stand-ins that return tensors of the shapes and dtypes
the real ones return (`int8_vectorwise_quant`, `int8_double_quant` and `double_quant`,
`int8_linear_matmul`, `int8_mm_dequant`, and from 0.46 the `torch.ops.bitsandbytes.int8_scaled_mm`
op), and the weight is given as its int8 codes and row
scales (`state.CB`, `state.SCB`), as Linear8bitLt holds a loaded checkpoint. Before 0.45.0
`supports_igemmlt` asks CUDA for the device, so it is answered False: the row-major fallback
that then runs keeps the same tensors. Unpack a release's wheel first (its sources only), e.g.

    pip download --no-deps bitsandbytes==0.44.1 -d wheels
    unzip wheels/bitsandbytes-0.44.1-*.whl 'bitsandbytes/*' -x '*.so' -d bnb-0.44.1
    python validation/bitsandbytes_matmul8bit_input.py bnb-0.44.1 bnb-0.45.5 bnb-0.50.1

It then runs the matmul inside a checkpointed function (torch.utils.checkpoint, non-reentrant and
reentrant) and checks whether the function's intermediate that feeds it outlives the forward: the
node's `ctx.tensors` is out of reach of the saved-tensor hooks non-reentrant checkpointing works
through (ckplan.model.finetune `held_through_checkpoint_bytes`).

Measured (CPU, torch 2.13): 0.44.1 keeps the input and CAt, 0.45.5 and 0.50.1 the input alone;
in all three the input outlives a non-reentrant checkpoint and not a reentrant one, as ckplan
says; a JSON line per release on stdout, with ckplan's answer.
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
    import torch._dynamo  # loaded before the stand-in modules, which it inspects
    from torch.utils.checkpoint import checkpoint
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("bitsandbytes_matmul8bit_input.py needs PyTorch: python3 -m pip install torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bitsandbytes_matmul4bit_input import version_of

from ckplan.model.finetune import matmul_8bit_keeps_transposed_input

TRANSPOSED: list[weakref.ref] = []  # CAt of each quantisation of an input


def _quantize(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = A.float().abs().amax(dim=1).clamp(min=1e-6)
    return (A.float() / scale[:, None] * 127).round().to(torch.int8), scale


def _double_quant(A: torch.Tensor, threshold: float = 0.0, **_) -> tuple:
    """CA, CAt (A's shape, int8), row and column statistics (fp32), no outliers."""
    CA, row_stats = _quantize(A)
    CAt = CA.clone()
    TRANSPOSED.append(weakref.ref(CAt))
    return CA, CAt, row_stats, A.float().abs().amax(dim=0), None


def _mm_dequant(out32: torch.Tensor, row_stats, col_stats, *_, bias=None, **__) -> torch.Tensor:
    return (out32.float() * row_stats[:, None] * col_stats[None, :] / (127 * 127)).half()


def _register_scaled_mm() -> None:
    """From 0.46 MatMul8bitLt calls the fused `torch.ops.bitsandbytes.int8_scaled_mm` (GEMM,
    dequantisation and bias): a CPU stand-in of that schema (bitsandbytes/_ops.py)."""
    if hasattr(torch.ops, "bitsandbytes") and hasattr(torch.ops.bitsandbytes, "int8_scaled_mm"):
        return
    library = torch.library.Library("bitsandbytes", "DEF")
    library.define(
        "int8_scaled_mm(Tensor A, Tensor B, Tensor row_stats, Tensor col_stats, "
        "Tensor? bias=None, ScalarType? dtype=None) -> Tensor"
    )

    def scaled_mm(A, B, row_stats, col_stats, bias=None, dtype=None):
        out32 = (A.float() @ B.float().t()).to(torch.int32)
        return _mm_dequant(out32, row_stats, col_stats).to(dtype or torch.float16)

    library.impl("int8_scaled_mm", scaled_mm, "CPU")
    _LIBRARIES.append(library)


_LIBRARIES: list = []  # kept alive: a Library's definitions go with it


def release_functions(root: Path) -> types.ModuleType:
    """The release's autograd/_functions.py, beside a stand-in `bitsandbytes.functional`."""
    package = types.ModuleType("bitsandbytes")
    package.__path__ = [str(root / "bitsandbytes")]
    functional = types.ModuleType("bitsandbytes.functional")
    functional.double_quant = _double_quant
    functional.int8_double_quant = _double_quant
    functional.int8_vectorwise_quant = lambda A, threshold=0.0: (*_quantize(A), None)
    functional.int8_linear_matmul = lambda CA, CB: (CA.float() @ CB.float().t()).to(torch.int32)
    functional.int8_mm_dequant = _mm_dequant
    functional.get_special_format_str = lambda: "col_turing"
    functional.__getattr__ = lambda name: object  # names imported at load time, never called
    package.functional = functional
    sys.modules.update({"bitsandbytes": package, "bitsandbytes.functional": functional})
    path = root / "bitsandbytes" / "autograd" / "_functions.py"
    _register_scaled_mm()
    spec = importlib.util.spec_from_file_location("bitsandbytes.autograd._functions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.supports_igemmlt = lambda device: False  # releases before 0.45.0 ask CUDA
    return module


def kept(functions: types.ModuleType) -> dict[str, bool]:
    """Run MatMul8bitLt on a (4 x 16) input and a frozen int8 (32 x 16) weight: which of the
    input and CAt are alive after the forward (CAt: False where none was made)."""
    TRANSPOSED.clear()
    state = functions.MatmulLtState()
    state.has_fp16_weights = False
    state.CB, state.SCB = _quantize(torch.randn(32, 16))
    weight = torch.zeros(32, 16, dtype=torch.int8)  # Int8Params: the codes, no gradient
    leaf = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    x = leaf * 1.0
    alive = weakref.ref(x)
    out = functions.MatMul8bitLt.apply(x, weight, None, None, state)
    del x
    result = {
        "keeps_input": alive() is not None,
        "keeps_transposed_input": any(ref() is not None for ref in TRANSPOSED),
    }
    out.float().sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape
    return result


def kept_through_checkpoint(functions: types.ModuleType, reentrant: bool) -> bool:
    """Run a checkpointed layer, x -> h = 2x -> MatMul8bitLt(h), under torch.utils.checkpoint:
    is h (an intermediate the checkpoint drops from autograd's saved tensors) alive after the
    forward? Non-reentrant checkpointing packs only what autograd saves; the node's
    `ctx.tensors` keeps h. Reentrant checkpointing runs the forward without a graph."""
    state = functions.MatmulLtState()
    state.has_fp16_weights = False
    state.CB, state.SCB = _quantize(torch.randn(32, 16))
    weight = torch.zeros(32, 16, dtype=torch.int8)
    inner: list[weakref.ref] = []

    def layer(x: torch.Tensor) -> torch.Tensor:
        h = x * 2.0
        inner.append(weakref.ref(h))
        return functions.MatMul8bitLt.apply(h, weight, None, None, state)

    leaf = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    out = checkpoint(layer, leaf * 1.0, use_reentrant=reentrant)
    alive = inner[0]() is not None
    out.float().sum().backward()
    assert leaf.grad is not None
    return alive


def main(roots: list[str]) -> None:
    if not roots:
        sys.exit(__doc__)
    for root in map(Path, roots):
        version = version_of(root)
        functions = release_functions(root)
        measured = kept(functions)
        for reentrant in (False, True):
            name = "reentrant" if reentrant else "non_reentrant"
            measured[f"kept_through_{name}_checkpoint"] = kept_through_checkpoint(
                functions, reentrant
            )
        transposed = matmul_8bit_keeps_transposed_input(version)
        ckplan = {"keeps_input": True, "keeps_transposed_input": transposed,
                  "kept_through_non_reentrant_checkpoint": True,
                  "kept_through_reentrant_checkpoint": False}  # fmt: skip
        print(json.dumps({"bitsandbytes": version, **measured, "ckplan": ckplan}))


if __name__ == "__main__":
    main(sys.argv[1:])
