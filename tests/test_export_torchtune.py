"""`ckplan export --to torchtune`: the overrides parse as YAML, every key is one torchtune
v0.6.1's recipe reads (tests/torchtune_keys.py, generated from its source by
tests/torchtune_mirror.py), the `tune run` line carries the same overrides, the values are the
plan's, and what torchtune cannot run is refused in one line."""

import shlex

import pytest
import yaml
from torchtune_keys import KEYS, RELEASE

from ckplan import exports
from ckplan.exports import ExportError
from ckplan.exports.torchtune import RELEASE as EXPORT_RELEASE
from ckplan.exports.torchtune import flat
from ckplan.plan import evaluate, parse_strategy

CASES = [
    ("full", {"training": "lora", "lora_targets": "all-linear", "loss": "chunked:8"}),
    ("none", {"training": "qlora", "loss": "eager", "micro_batch": 2, "microbatches": 4}),
    ("full", {"training": "lora", "use_dora": True, "lora_alpha": 32, "loss": "chunked:4"}),
    ("full", {"loss": "chunked:8", "optimizer": "paged-adamw-8bit", "optimizer_in_backward": True}),
    ("full", {"loss": "chunked:8", "dp": 8, "zero": 3, "kernels": "compiled"}),
    ("full", {"loss": "chunked-output:8", "kernels": "compiled", "optimizer_in_backward": True}),
    ("none", {"training": "lora", "loss": "eager", "dp": 4, "zero": 2, "dtype_bytes": 4}),
    ("full+offload", {"training": "qlora", "loss": "chunked:8"}),
    ("offload", {"training": "lora", "loss": "chunked:8"}),
]


def plan_of(spec, name):
    return evaluate(spec, parse_strategy(name, spec))


def export(spec_of, strategy, settings):
    spec = spec_of("llama3-8b", seq=1024, **settings)
    return spec, exports.export(plan_of(spec, strategy), "torchtune")


def header(text):
    first, second = text.splitlines()[:2]
    recipe = first.rsplit("recipe ", 1)[1]
    return recipe, shlex.split(second.removeprefix("# "))


@pytest.mark.parametrize(("strategy", "settings"), CASES)
def test_every_key_is_one_the_recipe_reads(spec_of, strategy, settings):
    assert EXPORT_RELEASE == RELEASE
    _, result = export(spec_of, strategy, settings)
    recipe, _ = header(result.text)
    overrides = yaml.safe_load(result.text)
    keys = [key for key, _ in flat(overrides)]
    assert keys and not [key for key in keys if key not in KEYS[recipe]]


@pytest.mark.parametrize(("strategy", "settings"), CASES)
def test_the_command_line_carries_the_same_overrides(spec_of, strategy, settings):
    spec, result = export(spec_of, strategy, settings)
    recipe, argv = header(result.text)
    launcher = ["tune", "run"] + (["--nproc_per_node", str(spec.dp)] if spec.dp > 1 else [])
    assert argv[: len(launcher) + 3] == [*launcher, recipe, "--config", "CONFIG"]
    given = dict(arg.split("=", 1) for arg in argv[len(launcher) + 3 :])
    expected = flat(yaml.safe_load(result.text))
    assert list(given) == [key for key, _ in expected]
    assert {key: yaml.safe_load(value) for key, value in given.items()} == dict(expected)


def test_values_are_the_plan(spec_of):
    _, result = export(spec_of, "full", CASES[2][1] | {"micro_batch": 2, "microbatches": 4})
    got = yaml.safe_load(result.text)
    recipe, _ = header(result.text)
    assert recipe == "lora_finetune_single_device"
    assert got["batch_size"] == 2 and got["gradient_accumulation_steps"] == 4
    assert got["enable_activation_checkpointing"] is True and got["dtype"] == "bf16"
    assert got["loss"] == {
        "_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss",
        "num_output_chunks": 4,
    }
    assert got["model"] == {
        "lora_attn_modules": ["q_proj", "v_proj"],
        "apply_lora_to_mlp": False,
        "apply_lora_to_output": False,
        "lora_rank": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "use_dora": True,
    }
    _, none = export(spec_of, "none", CASES[1][1])
    got = yaml.safe_load(none.text)
    assert got["enable_activation_checkpointing"] is False and got["model"]["quantize_base"]
    _, sharded = export(spec_of, "full", CASES[4][1])
    got = yaml.safe_load(sharded.text)
    assert header(sharded.text)[0] == "full_finetune_distributed"
    assert got["fsdp_reshard_after_forward"] is True and got["compile"] is True
    assert got["optimizer_in_bwd"] is False
    assert got["optimizer"] == {"_component_": "torch.optim.AdamW", "fused": True}


def test_foreach_step_is_said(spec_of):
    """`optimizer_implementation: foreach` turns torchtune's configs' `fused: True` off."""
    foreach = {"framework": "hf", "optimizer_implementation": "foreach"}
    _, result = export(spec_of, "full", CASES[4][1] | foreach)
    optimizer = yaml.safe_load(result.text)["optimizer"]
    assert optimizer == {"_component_": "torch.optim.AdamW", "fused": False, "foreach": True}


REFUSED = [
    ("full", {"tp": 2}, "tp=2"),
    ("full", {"pp": 2, "layers": 32}, "pp=2"),
    ("uniform:4", {"training": "lora"}, "every layer"),
    ("selective", {"training": "lora"}, "selective"),
    ("full", {"training": "frozen"}, "training: frozen"),
    ("full", {"training": "lora", "lora_targets": "q_proj,up_proj"}, "apply_lora_to_mlp"),
    ("full", {"training": "lora", "optimizer_in_backward": True}, "optimizer_in_bwd"),
    ("full", {"optimizer": "lion"}, "optimizer: lion"),
    ("full", {"dp": 4, "zero": 1}, "FSDP2"),
    ("full", {"framework": "hf", "dp": 4, "zero": 3, "fsdp_version": 1}, "fsdp_version 1"),
    ("uniform:4+offload", {"training": "lora"}, "every layer"),
    ("selective+offload", {"training": "lora"}, "selective"),
]


@pytest.mark.parametrize(("strategy", "settings", "fragment"), REFUSED)
def test_what_torchtune_cannot_run_is_refused(spec_of, strategy, settings, fragment):
    spec = spec_of("llama3-8b", seq=1024, loss="chunked:8", **settings)
    with pytest.raises(ExportError, match=fragment):
        exports.export(plan_of(spec, strategy), "torchtune")


def test_chunked_output_loss_is_torchtunes_chunked_loss_compiled(spec_of):
    """`chunked-output:N` is CEWithChunkedOutputLoss with N chunks under compile; without
    compiled kernels torchtune would run its cross-entropy eagerly, which it is not."""
    spec = spec_of("llama3-8b", seq=1024, loss="chunked-output:4", kernels="compiled")
    overrides = yaml.safe_load(exports.export(plan_of(spec, "full"), "torchtune").text)
    assert overrides["loss"]["_component_"].endswith("CEWithChunkedOutputLoss")
    assert overrides["loss"]["num_output_chunks"] == 4 and overrides["compile"] is True
    eager = spec_of("llama3-8b", seq=1024, loss="chunked-output:4", kernels="eager")
    with pytest.raises(ExportError, match="kernels=compiled"):
        exports.export(plan_of(eager, "full"), "torchtune")


def test_fused_loss_is_refused_in_one_line(cli):
    code, out, err = cli("export", "llama3-8b", "--plan", "full", "--to", "torchtune")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "loss=chunked:8" in err


@pytest.mark.parametrize(
    ("strategy", "checkpointing", "offloading"),
    [("full", True, False), ("full+offload", True, True), ("offload", False, True)],
)
def test_offloading_is_torchtunes_over_every_layer(spec_of, strategy, checkpointing, offloading):
    """torchtune's OffloadActivations over every layer: with checkpointing their inputs
    (full+offload), without it every saved tensor (offload)."""
    _, written = export(spec_of, strategy, {"training": "lora", "loss": "chunked:8"})
    got = yaml.safe_load(written.text)
    assert got["enable_activation_checkpointing"] is checkpointing
    assert got["enable_activation_offloading"] is offloading
