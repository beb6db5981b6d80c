"""The bytes an optimizer's state holds for the Llama-like model of measure_plans.py.

For each optimizer importable here (torch.optim.AdamW and SGD with momentum; bitsandbytes'
AdamW8bit and PagedAdamW8bit; transformers' Adafactor) it builds the model in bf16, runs two
steps and sums the state tensors' bytes (each storage once), beside the trainable parameters.
ckplan's figure for the same model is `model_state_bytes(...).optimizer` with the `optimizer`
key (validation/device/compare.py prints none of this; docs/validation.md quotes both).

    python validation/device/measure_optimizer_states.py --out states.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_plans import SHAPE, SMALL, Model


def optimizers():
    yield "adamw", lambda params: torch.optim.AdamW(params, lr=1e-5)
    yield "sgd", lambda params: torch.optim.SGD(params, lr=1e-5, momentum=0.9)
    if importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes as bnb

        yield "adamw-8bit", lambda params: bnb.optim.AdamW8bit(params, lr=1e-5)
        yield "paged-adamw-8bit", lambda params: bnb.optim.PagedAdamW8bit(params, lr=1e-5)
    if importlib.util.find_spec("transformers") is not None:
        from transformers.optimization import Adafactor

        yield (
            "adafactor",
            lambda params: Adafactor(params, lr=1e-5, scale_parameter=False, relative_step=False),
        )


def state_bytes(optimizer) -> int:
    seen = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    shape = SMALL if args.small else SHAPE
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=args.device)
    results = []
    for name, build in optimizers():
        torch.manual_seed(0)
        model = Model(shape, "none").to(device=args.device, dtype=torch.bfloat16)
        optimizer = build(list(model.parameters()))
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            model(tokens, tokens).backward()
            optimizer.step()
        result = {"optimizer": name, "state_bytes": state_bytes(optimizer),
                  "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
        results.append(result)
        print(json.dumps(result), flush=True)
        del optimizer, model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
