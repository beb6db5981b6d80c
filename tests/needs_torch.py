"""torch for the tests that need it: a clearly reported skip where it is not installed, a
failure instead when CKPLAN_REQUIRE_TORCH=1 (CI installs the CPU build and sets it)."""

import importlib
import os

import pytest

REQUIRE = "CKPLAN_REQUIRE_TORCH"


def torch_or_skip():
    try:
        return importlib.import_module("torch")
    except ImportError:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but torch is not installed", pytrace=False)
        pytest.skip(
            "torch is not installed: the tests against PyTorch autograd did not run "
            "(make .venv/.torch, or pip install torch==2.13.0)",
            allow_module_level=True,
        )
