"""The exports read by the frameworks' own parsers: DeepSpeed's `DeepSpeedConfig` loads the
JSON ckplan writes, torchtitan 0.2's `ConfigManager` the TOML section. The frameworks are an
optional extra (`pip install '.[frameworks]'`, which .ci/run installs with
CKPLAN_REQUIRE_FRAMEWORKS=1); without them these tests are reported as skipped."""

import json
import subprocess
import sys
import textwrap

import pytest
from needs_frameworks import installed_or_skip

from ckplan import exports
from ckplan.plan.evaluate import evaluate
from ckplan.plan.strategies import parse_strategy


def _need(module: str) -> None:
    installed_or_skip(module, "its parser did not check the export")


DEEPSPEED_CASES = [
    ("none", {"zero": 1, "dp": 8}),
    ("uniform:2", {"zero": 2, "dp": 8, "microbatches": 4}),
    ("block:4", {"zero": 3, "dp": 16, "micro_batch": 2}),
    ("selective", {"zero": 0, "dp": 4}),
    ("none", {"zero": 2, "dp": 1, "optimizer_offload": "cpu"}),
    ("full", {"zero": 3, "dp": 8, "optimizer_offload": "cpu", "param_offload": "cpu"}),
    ("full+offload", {"zero": 3, "dp": 8}),
]


@pytest.mark.parametrize(("strategy", "layout"), DEEPSPEED_CASES)
def test_deepspeed_loads_the_exported_config(spec_of, strategy, layout):
    _need("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    spec = spec_of("llama3-8b", framework="deepspeed", **layout)
    plan = evaluate(spec, parse_strategy(strategy, spec))
    if exports.why_not(plan, "deepspeed"):
        pytest.skip(exports.why_not(plan, "deepspeed"))
    config = json.loads(exports.export(plan, "deepspeed").text)
    loaded = DeepSpeedConfig(config)
    assert loaded.zero_optimization_stage == spec.zero
    assert loaded.train_micro_batch_size_per_gpu == spec.micro_batch
    assert loaded.gradient_accumulation_steps == spec.microbatches
    checkpointing = loaded.activation_checkpointing_config
    assert (
        checkpointing.number_checkpoints
        == (config["activation_checkpointing"]["number_checkpoints"])
    )
    for key, block in (
        ("optimizer_offload", "offload_optimizer"),
        ("param_offload", "offload_param"),
    ):
        offload = getattr(loaded.zero_config, block)
        if getattr(spec, key) == "none":
            assert offload is None
        else:
            assert (str(offload.device), offload.pin_memory) == ("cpu", True)
    # the inputs of checkpointed layers to host: full+offload only
    assert checkpointing.cpu_checkpointing is (strategy == "full+offload")
    assert checkpointing.partition_activations is False


# torchtitan's package imports its models (and triton) on import; its config modules need only
# torch and tyro, so they are loaded without running the package's __init__.
_TORCHTITAN_PARSE = textwrap.dedent(
    """
    import importlib.util, json, os, sys, types
    root = os.path.dirname(importlib.util.find_spec("torchtitan").origin)
    package = types.ModuleType("torchtitan")
    package.__path__ = [root]
    sys.modules["torchtitan"] = package
    from torchtitan.config import ConfigManager
    config = ConfigManager().parse_args(["--job.config_file", sys.argv[1]])
    section = config.activation_checkpoint
    print(json.dumps({"mode": section.mode, "option": section.selective_ac_option}))
    """
)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [("none", ("none", None)), ("full", ("full", None)), ("sac", ("selective", "op"))],
)
def test_torchtitan_parses_the_exported_section(spec_of, tmp_path, strategy, expected):
    _need("torchtitan")
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=3)
    plan = evaluate(spec, parse_strategy(strategy, spec))
    path = tmp_path / "job.toml"
    path.write_text(exports.export(plan, "torchtitan").text, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-c", _TORCHTITAN_PARSE, str(path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    mode, option = expected
    assert parsed["mode"] == mode
    if option is not None:
        assert parsed["option"] == option
