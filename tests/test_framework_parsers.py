"""The exports read by the frameworks' own parsers: DeepSpeed's `DeepSpeedConfig` loads the
JSON ckplan writes, torchtitan 0.3.0's `ConfigManager` the command-line overrides (torchtitan
0.2.x's TOML section is checked against its keys, tests/torchtitan_02_keys.py, in
tests/test_exports.py). The frameworks are an
optional extra (`pip install '.[frameworks]'`, which .ci/run installs with
CKPLAN_REQUIRE_FRAMEWORKS=1); without them these tests are reported as skipped."""

import json
import subprocess
import sys
import textwrap

import pytest
from needs_frameworks import installed_or_skip

from ckplan import exports
from ckplan.exports import torchtitan
from ckplan.model.frameworks import optimizer_implementation
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


# torchtitan 0.3.0's own ConfigManager (torchtitan/config/manager.py) reads each case's
# arguments after `--module M --config C`, as `python -m torchtitan.train` does, in one
# subprocess for all cases (its package imports triton and its models: seconds). Each case: the
# parsed activation-checkpoint class and every option ckplan wrote, read back by its dotted name.
_TORCHTITAN_03_PARSE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from torchtitan.config import ConfigManager
    results = []
    for case in json.loads(sys.stdin.read()):
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                config = ConfigManager().parse_args(case)
        except BaseException as error:  # tyro exits on an unknown option or a failed check
            results.append({"error": f"{type(error).__name__}: {error} {said.getvalue()}"})
            continue
        values = {}
        for word in case:
            if not word.startswith("--") or word in ("--module", "--config"):
                continue
            section, key = word[2:].split(".", 1)
            key = key.replace("-", "_")
            key = key[3:] if key.startswith("no_") else key
            values[word] = getattr(getattr(config, section), key)
        ac = config.activation_checkpoint
        name = None if ac is None else type(ac).__qualname__
        results.append({"ac": name, "values": values})
    print(json.dumps(results))
    """
)

LLAMA = ("llama3", "llama3_8b")
OFFLOAD = {"zero": 3, "optimizer_offload": "cpu", "param_offload": "cpu"}
TORCHTITAN_03_CASES = [
    ("none", "llama3-8b", {"dp": 8, "zero": 3}, LLAMA),
    ("full", "llama3-8b", {"dp": 8, "zero": 3}, LLAMA),
    # sac is refused on 0.3.0 (ckplan.model.torchtitan_ac.sac_reason_03); sac-fused is its
    # SelectiveAC
    ("sac-fused", "llama3-8b", {"dp": 8, "zero": 3}, LLAMA),
    ("full", "llama3-8b", {"tp": 2, "sp": True, "dp": 4, "zero": 3}, LLAMA),
    ("full", "llama3-8b", {"tp": 4, "sp": False, "dp": 2, "zero": 3}, LLAMA),
    ("full", "llama3-8b", {"cp": 2, "dp": 4, "zero": 3, "seq": 16384}, LLAMA),
    ("full", "llama3-8b", {"pp": 2, "microbatches": 4, "micro_batch": 2, "dp": 4}, LLAMA),
    ("none", "llama3-8b", {"pp": 4, "virtual_stages": 2, "microbatches": 8, "zero": 2}, LLAMA),
    ("full", "llama3-8b", {"dp": 8, "zero": 0, "microbatches": 4}, LLAMA),
    ("full", "llama3-8b", {"dp": 8, **OFFLOAD}, LLAMA),
    # float8 is the config function's converter (llama3_8b_float8-style functions build
    # torchao's Float8Linear, which checks for an SM89+ GPU): the options are the same
    ("full", "llama3-8b", {"dp": 8, "zero": 3, "precision": "float8"}, LLAMA),
    ("full", "qwen3-30b-a3b", {"dp": 8, "zero": 3, "ep": 8}, ("qwen3", "qwen3_30b_a3b")),
    ("full", "llama3-8b", {"dp": 8, "zero": 3, "optimizer_implementation": "foreach"}, LLAMA),
    ("full", "llama3-8b", {"dp": 8, "zero": 3, "optimizer": "adamw-bf16"}, LLAMA),
]  # fmt: skip
AC_CLASSES = {"none": None, "full": "FullAC.Config", "sac-fused": "SelectiveAC.Config"}


def _torchtitan_03_cases(spec_of):
    """(spec, strategy, written arguments, parsed) of every case, parsed in one subprocess."""
    written = []
    for strategy, preset, layout, (module, config) in TORCHTITAN_03_CASES:
        spec = spec_of(preset, framework="torchtitan", **layout)
        plan = evaluate(spec, parse_strategy(strategy, spec))
        text = exports.export(plan, "torchtitan", version="0.3").text
        written.append((spec, strategy, ["--module", module, "--config", config, *text.split()]))
    pipelined = next(args for spec, _, args in written if spec.pp > 1)  # the graphs kept on
    cases = [args for *_, args in written]
    cases.append([word for word in pipelined if word != "--training.disable-cuda-graphs"])
    done = subprocess.run(
        [sys.executable, "-c", _TORCHTITAN_03_PARSE], input=json.dumps(cases),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    return [(*case, result) for case, result in zip(written, parsed, strict=False)], parsed[-1]


@pytest.fixture(scope="module")
def torchtitan_03():
    from ckplan.inputs.presets import load_spec

    _need("torchtitan")
    from importlib.metadata import version

    if not version("torchtitan").startswith("0.3"):
        pytest.skip(f"torchtitan {version('torchtitan')} is installed, not 0.3")
    return _torchtitan_03_cases(lambda name, **keys: load_spec(name, keys))


def test_torchtitan_03_parses_every_exported_case(torchtitan_03):
    cases, _ = torchtitan_03
    assert len(cases) == len(TORCHTITAN_03_CASES)
    for spec, strategy, args, parsed in cases:
        assert "error" not in parsed, (args, parsed)
        assert parsed["ac"] == AC_CLASSES[strategy]
        assert torchtitan.strategy_from_arguments(" ".join(args)) == strategy
        values = parsed["values"]
        # every option written reads back as written (a flag: True, its no- form: False)
        for index, word in enumerate(args):
            if not word.startswith(("--parallelism.", "--training.", "--optimizer.")):
                continue
            following = args[index + 1] if index + 1 < len(args) else ""
            if following.startswith("--") or following.startswith("activation-checkpoint:"):
                assert values[word] is (".no-" not in word), word
            else:
                assert str(values[word]) == following, word
        # and the layout and batch are the spec's
        parallel = {word.split(".")[1]: value for word, value in values.items()}
        assert parallel["tensor-parallel-degree"] == spec.tp
        assert parallel["context-parallel-degree"] == spec.cp
        assert parallel["pipeline-parallel-degree"] == spec.pp
        shard = parallel["data-parallel-shard-degree"]
        replicate = parallel["data-parallel-replicate-degree"]
        assert shard * replicate == spec.dp and (shard > 1) == (spec.zero >= 2 and spec.dp > 1)
        assert parallel["seq-len"] == spec.seq
        assert parallel["global-batch-size"] == spec.micro_batch * spec.microbatches * spec.dp
        accumulation = parallel["global-batch-size"] // (parallel["local-batch-size"] * spec.dp)
        assert accumulation == (1 if spec.pp > 1 else spec.microbatches)
        if spec.tp > 1:
            key = "no-enable-sequence-parallel" if not spec.sp else "enable-sequence-parallel"
            assert parallel[key] is spec.sp
        if spec.pp > 1:
            assert parallel["pipeline-parallel-microbatch-size"] == spec.micro_batch
            schedule = "Interleaved1F1B" if spec.virtual_stages > 1 else "1F1B"
            assert parallel["pipeline-parallel-schedule"] == schedule
            per_stage = parallel["pipeline-parallel-layers-per-stage"]
            assert per_stage * spec.pp * spec.virtual_stages == spec.layers
        assert parallel.get("enable-cpu-offload", False) is (spec.optimizer_offload == "cpu")
        # torchtitan's default "fused" unsaid; bf16 moments: the fused kernel's bf16 path
        counted = optimizer_implementation(spec)
        if spec.optimizer == "adamw-bf16":
            counted = "fused_opt_states_bf16"
        assert parallel.get("implementation", "fused") == counted
        if spec.experts:
            assert parallel["expert-parallel-degree"] == spec.ep


def test_torchtitan_03_refuses_pipelining_under_cuda_graphs(torchtitan_03):
    """The export turns CUDA graphs off (--training.disable-cuda-graphs); without that,
    torchtitan 0.3.0's Trainer.Config rejects a pipelined layout."""
    _, without = torchtitan_03
    assert "disable_cuda_graphs" in without.get("error", ""), without
