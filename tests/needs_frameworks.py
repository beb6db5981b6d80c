"""The optional frameworks (`pip install '.[frameworks]'`: DeepSpeed, torchtitan, transformers,
PEFT) for the tests that read ckplan's output with them: a clearly reported skip where one is not
installed, a failure instead when CKPLAN_REQUIRE_FRAMEWORKS=1 (.ci/run installs the extra and
sets it)."""

import importlib
import importlib.util
import os

import pytest

REQUIRE = "CKPLAN_REQUIRE_FRAMEWORKS"


def installed_or_skip(module: str, why: str = "its check did not run") -> None:
    """Nothing when the module is installed (not imported: torchtitan's package imports need
    triton, its tests run it in a subprocess); else a skip, or a failure under
    CKPLAN_REQUIRE_FRAMEWORKS=1."""
    if importlib.util.find_spec(module) is None:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but {module} is not installed", pytrace=False)
        pytest.skip(f"{module} is not installed: {why}")


def framework_or_skip(module: str, why: str = "its check did not run"):
    """The imported module, or a skip (a failure under CKPLAN_REQUIRE_FRAMEWORKS=1)."""
    installed_or_skip(module, why)
    return importlib.import_module(module)
