"""A layer of the user's own code: `ckplan calibrate --module PKG.MOD:FACTORY` (or
`path/to/file.py:FACTORY`).

The factory is called with the layer's shape as keywords (hidden, heads, kv_heads, ffn_hidden,
seq, micro_batch) and returns an `nn.Module` whose forward maps the residual stream
(batch, seq, hidden) to the same shape; calibrate moves it to the dtype and device and measures
it as it measures its own blocks, so the fitted profile describes the code the user runs
(examples/modules/my_block.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ckplan.calibrate.block import Block, CalibrationError
from ckplan.calibrate.fit import Shape
from ckplan.quoting import quote


def load_factory(text: str) -> Callable:
    """The callable `text` names: `package.module:name` or `file.py:name`."""
    where, sep, name = text.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise CalibrationError(
            f"--module {quote(text)}: expected PACKAGE.MODULE:FACTORY or FILE.py:FACTORY"
        )
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise CalibrationError(f"--module {quote(text)}: no file {quote(where)}")
            spec = importlib.util.spec_from_file_location(f"_ckplan_user_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except CalibrationError:
        raise
    except Exception as error:  # the user's module failed to import: one line
        message = " ".join(str(error).split())[:200]
        raise CalibrationError(
            f"--module {quote(text)}: importing {quote(where)} failed "
            f"({type(error).__name__}: {message})"
        ) from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise CalibrationError(f"--module {quote(text)}: {quote(where)} has no callable {name!r}")
    return factory


def user_block(
    factory: Callable, text: str, shape: Shape, dtype: torch.dtype, device: str
) -> Block:
    """The factory's layer at `shape`, in `dtype` on `device`, in training mode."""
    try:
        layer = factory(
            hidden=shape.hidden,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            ffn_hidden=shape.ffn,
            seq=shape.seq,
            micro_batch=shape.batch,
        )
    except Exception as error:
        message = " ".join(str(error).split())[:200]
        raise CalibrationError(
            f"--module {quote(text)}: the factory failed at {shape.text()} "
            f"({type(error).__name__}: {message})"
        ) from None
    if not isinstance(layer, torch.nn.Module):
        raise CalibrationError(
            f"--module {quote(text)}: the factory returned {type(layer).__name__}, "
            "expected an nn.Module"
        )
    layer = layer.to(device=device, dtype=dtype).train()
    return Block(layer, lambda x, recorder: layer(x))
