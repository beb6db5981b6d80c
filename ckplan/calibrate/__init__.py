"""`ckplan calibrate`: measure what autograd saves per op for one layer, fit a kernel profile.

Needs the optional extra `ckplan[torch]` (and `transformers` for --hf). Nothing here imports
torch at import time except the modules that run layers (record, layers, run, hf, cuda); the CLI
imports them only inside the command, after checking that torch is installed.

    attribute  which op of the table a recorded torch call belongs to (pure Python)
    fit        fitting a profile's coefficients to measured layers, exactly (pure Python)
    record     what autograd saves in one forward, storage by storage
    layers     ckplan's own GPT and Llama blocks written op by op in PyTorch
    block      one built layer and the calibration error
    hf         the real Hugging Face decoder layer
    run        measure, fit, check: the calibration
    cuda       the step peak on CUDA against torch.cuda.max_memory_allocated
"""

import importlib.util

TORCH_EXTRA = "ckplan calibrate needs PyTorch: pip install 'ckplan[torch]' (the CPU build will do)"
HF_EXTRA = "--hf needs Hugging Face transformers: pip install transformers"

__all__ = ["HF_EXTRA", "TORCH_EXTRA", "missing_extra"]


def missing_extra(hf: bool = False) -> str | None:
    """The one-line message naming the extra that is not installed, else None."""
    if importlib.util.find_spec("torch") is None:
        return TORCH_EXTRA
    if hf and importlib.util.find_spec("transformers") is None:
        return HF_EXTRA
    return None
