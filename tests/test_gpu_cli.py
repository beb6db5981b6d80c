"""The command line with --gpu: presets, errors, JSON `time`, ranking by step time."""

import json

import pytest

TIME_KEYS = {
    "step_seconds",
    "forward_seconds",
    "backward_seconds",
    "recompute_seconds",
    "communication_seconds",
    "bubble_seconds",
    "overhead",
    "mfu",
    "hfu",
    "tokens_per_second_per_gpu",
}


def test_gpus_lists_presets(cli):
    code, out, _ = cli("gpus")
    assert code == 0
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "mi300x", "rtx-4090"):
        assert name in out


def test_gpus_json_and_one(cli):
    code, out, _ = cli("gpus", "--json")
    data = json.loads(out)
    assert code == 0 and data["h100-sxm"]["bf16_flops"] == 989e12
    code, out, _ = cli("gpus", "h200", "--json")
    assert code == 0 and json.loads(out)["memory_bytes"] == 143156 * 2**20
    code, out, _ = cli("gpus", "l40s")
    assert code == 0 and "datasheet" in out


def test_estimate_json_time_object(cli):
    code, out, err = cli(
        "estimate", "megatron-22b", "--strategy", "selective", "--gpu", "a100-80gb"
    )
    assert code == 0, err
    assert "Step time on a100-80gb" in out and "MFU" in out and "matmul" in out
    code, out, _ = cli(
        "estimate",
        "megatron-22b",
        "--strategy",
        "selective",
        "--gpu",
        "a100-80gb",
        "--json",
    )
    data = json.loads(out)
    assert set(data["time"]) >= TIME_KEYS
    assert data["usable_bytes"] == 81158 * 2**20 - 2 * 2**30  # --gpu set the budget
    time = data["time"]
    assert 0 < time["mfu"] < 1 and time["hfu"] >= time["mfu"]
    assert time["overhead"] > 0 and time["recompute_seconds"] > 0


def test_estimate_without_gpu_has_no_time(cli):
    code, out, _ = cli("estimate", "gpt2", "--json")
    assert code == 0 and "time" not in json.loads(out)


def test_budget_wins_over_gpu(cli):
    code, out, _ = cli("estimate", "gpt2", "--gpu", "a100-80gb", "--budget", "40GB", "--json")
    assert code == 0 and json.loads(out)["usable_bytes"] == 40 * 10**9 - 2 * 2**30


def test_set_gpu_key(cli):
    argv = ["estimate", "gpt2", "--gpu", "a100-80gb", "--json"]
    _, base, _ = cli(*argv)
    _, slow, _ = cli(*argv, "--set", "gpu.matmul_efficiency=0.4", "--set", "seq=1024")
    assert json.loads(slow)["time"]["step_seconds"] > json.loads(base)["time"]["step_seconds"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["estimate", "gpt2", "--gpu", "a100"], "unknown GPU 'a100': expected one of a100-40gb"),
        (["estimate", "gpt2", "--set", "gpu.matmul_efficiency=0.5"], "need --gpu"),
        (
            ["estimate", "gpt2", "--gpu", "h100-sxm", "--set", "gpu.matmul_eff=0.5"],
            "unknown key 'matmul_eff'",
        ),
        (
            ["estimate", "gpt2", "--gpu", "h100-sxm", "--set", "gpu.matmul_efficiency=2"],
            "must be in (0, 1]",
        ),
        (["estimate", "gpt2", "--gpu", "missing.yaml"], "missing.yaml: no such file"),
        (["sweep", "gpt2", "--rank", "time"], "--budget SIZE"),
        (["sweep", "gpt2", "--budget", "8GB", "--rank", "time"], "--rank time needs --gpu"),
        (["sweep", "gpt2", "--gpu", "a100-80gb", "--rank", "fast"], "--rank 'fast'"),
        (["check", "gpt2", "--gpu", "nope"], "unknown GPU 'nope'"),
        (["schedule", "gpt2", "--gpu", "nope"], "unknown GPU 'nope'"),
    ],
)
def test_gpu_bad_input(cli, argv, fragment):
    code, out, err = cli(*argv)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1 and out == ""


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("name: x\nbf16_flops: [1\n", "malformed YAML at line"),
        ("- 1\n- 2\n", "expected a YAML mapping"),
        ("name: x\nbf16_flop: 1\n", "unknown key 'bf16_flop'"),
        ("name: x\n", "missing required key 'memory_bytes'"),
    ],
)
def test_bad_gpu_file(cli, tmp_path, text, fragment):
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    code, out, err = cli("estimate", "gpt2", "--gpu", str(path))
    assert code == 2 and fragment in err and str(path) in err
    assert len(err.strip().splitlines()) == 1 and out == ""


def test_gpu_file_works(cli, tmp_path):
    path = tmp_path / "mine.yml"
    path.write_text(
        "name: mine\nmemory_bytes: 24e9\nbf16_flops: 100e12\nfp32_flops: 20e12\n"
        "hbm_bytes_per_s: 1e12\nlink_bytes_per_s: 32e9\ngpus_per_node: 4\n"
        "network_bytes_per_s: 12.5e9\n"
    )
    code, out, err = cli("estimate", "gpt2", "--gpu", str(path), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["usable_bytes"] == 24 * 10**9 - 2 * 2**30 and data["time"]["step_seconds"] > 0


def test_sweep_ranks_by_time(cli):
    argv = ["sweep", "llama3-70b", "--gpu", "h100-sxm", "--set", "tp=8", "--set", "pp=4"]
    argv += ["--set", "sp=true", "--set", "microbatches=16", "--json"]
    code, out, err = cli(*argv)
    assert code == 0, err
    data = json.loads(out)
    assert data["rank"] == "time" and data["gpu"] == "h100-sxm"
    fitting = [plan for plan in data["plans"] if plan["fits"]]
    fastest = min(plan["time"]["step_seconds"] for plan in fitting)
    assert data["best"]["time"]["step_seconds"] == fastest
    code, out, _ = cli(*argv, "--rank", "flops")
    by_flops = json.loads(out)
    least = min(plan["flops"]["total"] for plan in by_flops["plans"] if plan["fits"])
    assert by_flops["rank"] == "flops" and by_flops["best"]["flops"]["total"] == least


def test_sweep_table_with_gpu(cli):
    code, out, _ = cli("sweep", "gpt2", "--gpu", "a100-40gb", "--batch", "8")
    assert code == 0 and "step" in out and "time ovh" in out and "Best plan that fits" in out


def test_check_and_schedule_with_gpu(cli):
    code, out, _ = cli("check", "megatron-22b", "--gpu", "a100-80gb", "--json")
    result = json.loads(out)["results"][0]
    assert code == 0 and set(result["plan"]["time"]) >= TIME_KEYS
    assert json.loads(out)["budget_bytes"] == 81158 * 2**20  # the memory CUDA reports
    code, out, _ = cli("schedule", "gpt2", "--batch", "8", "--gpu", "rtx-4090", "--json")
    assert code == 0 and set(json.loads(out)["time"]) >= TIME_KEYS


def test_set_gpu_memory_sets_the_budget(cli):
    code, out, _ = cli(
        "estimate", "gpt2", "--gpu", "a100-80gb", "--set", "gpu.memory_bytes=40e9", "--json"
    )
    assert code == 0 and json.loads(out)["usable_bytes"] == 40 * 10**9 - 2 * 2**30


def test_seed_formula_with_gpu_says_why_no_time(cli):
    code, out, _ = cli("estimate", "gpt2", "--formula", "seed", "--gpu", "a100-80gb")
    assert code == 0 and "No step time on a100-80gb" in out


def test_mfu_in_another_convention(cli):
    """--mfu-convention counts the same step's FLOPs as another publisher would: causal
    attention halves the attention core, so MFU falls; HFU (what ran) stays."""
    runs = {}
    for convention in ("full", "causal", "6n"):
        code, out, _ = cli(
            "estimate", "gpt2", "--gpu", "h100-sxm", "--mfu-convention", convention, "--json"
        )
        assert code == 0
        runs[convention] = json.loads(out)["time"]
    assert runs["causal"]["mfu"] < runs["full"]["mfu"]
    assert runs["causal"]["hfu"] == runs["full"]["hfu"]
    assert {run["mfu_convention"] for run in runs.values()} == {"full", "causal", "6n"}
    code, out, _ = cli(
        "plan", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--top", "1",
        "--mfu-convention", "causal", "--json",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["layouts"][0]["time"]["mfu_convention"] == "causal"
    code, _, err = cli("sweep", "gpt2", "--gpu", "a100-80gb", "--mfu-convention", "palm")
    assert code == 2 and "--mfu-convention 'palm': expected one of full" in err
