"""The command line: exit codes, JSON schema, one-line errors."""

import json
import subprocess
import sys

import pytest


def test_estimate_json_schema(cli):
    code, out, err = cli("estimate", "llama3-70b", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["ckplan_version"] == "0.1.0"
    assert data["model"]["name"] == "llama3-70b" and data["model"]["kv_heads"] == 8
    assert data["strategy"] == "none" and data["formula"] == "derived"
    memory = data["memory"]
    for key in (
        "per_layer_activation_bytes",
        "activation_bytes",
        "model_state_bytes",
        "total_bytes",
    ):
        assert isinstance(memory[key], int)
    assert set(memory["breakdown"]) == {"attention", "mlp", "norm"}
    assert sum(memory["breakdown"].values()) == memory["per_layer_activation_bytes"]
    assert memory["total_bytes"] == memory["activation_bytes"] + memory["model_state_bytes"]
    assert data["parameters"]["total"] == 70_553_706_496
    flops = data["flops"]
    assert flops["total"] == flops["forward"] + flops["backward"] + flops["recompute"]
    assert data["overhead"] == 0.0


def test_estimate_table_selective(cli):
    code, out, _ = cli("estimate", "gpt3-175b", "--strategy", "selective")
    assert code == 0
    assert "strategy selective" in out and "GiB" in out and "attn_scores" in out


def test_estimate_overrides(cli):
    code, out, _ = cli(
        "estimate",
        "gpt2",
        "--seq",
        "512",
        "--batch",
        "4",
        "--set",
        "dropout=0",
        "--set",
        "layers=6",
        "--json",
    )
    model = json.loads(out)["model"]
    assert code == 0 and (
        model["seq"],
        model["micro_batch"],
        model["dropout"],
        model["layers"],
    ) == (512, 4, 0.0, 6)


def test_estimate_simple_formula_by_its_old_name(cli):
    code, out, _ = cli("estimate", "seed", "--formula", "seed", "--strategy", "uniform:4", "--json")
    data = json.loads(out)
    assert code == 0 and data["formula"] == "simple"  # seed, the old name, reads as simple
    assert data["overhead"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["estimate", "nosuchmodel"], "unknown model 'nosuchmodel'"),
        (["estimate", "gpt2", "--set", "hiden=4"], "unknown key 'hiden' (did you mean 'hidden'?)"),
        (["estimate", "gpt2", "--set", "heads=7"], "key 'heads' (7) must divide hidden (768)"),
        (["estimate", "gpt2", "--set", "layers=-1"], "key 'layers' must be a positive integer"),
        (["estimate", "gpt2", "--set", "noequals"], "expected key=value"),
        (["estimate", "gpt2", "--strategy", "uniform:0"], "K must be in 1..12"),
        (["estimate", "gpt2", "--strategy", "magic"], "unknown strategy 'magic'"),
        (["estimate", "gpt2", "--formula", "guess"], "--formula 'guess'"),
        (["estimate", "gpt2", "--seq", "abc"], "Invalid value for '--seq'"),
        (["estimate", "missing.yaml"], "missing.yaml: no such file"),
        (["estimate"], "Missing argument"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_input_is_one_line_exit_2(cli, argv, fragment):
    code, out, err = cli(*argv)
    assert code == 2
    assert fragment in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and out == ""


def test_malformed_yaml_file(cli, tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("name: x\nlayers: [1\n")
    code, _, err = cli("estimate", str(path))
    assert code == 2 and "malformed YAML" in err and str(path) in err


def test_user_yaml_file(cli, tmp_path):
    path = tmp_path / "mine.yml"
    path.write_text(
        "name: mine\nlayers: 4\nhidden: 256\nheads: 4\nseq: 128\nmicro_batch: 2\nvocab: 1000\n"
    )
    code, out, _ = cli("estimate", str(path), "--json")
    assert code == 0 and json.loads(out)["model"]["name"] == "mine"


def test_presets_list_and_show(cli):
    code, out, _ = cli("presets")
    assert code == 0 and "llama3-405b" in out and "megatron-1t" in out
    code, out, _ = cli("presets", "mistral-7b", "--json")
    assert code == 0 and json.loads(out)["kv_heads"] == 8
    code, _, err = cli("presets", "nope")
    assert code == 2 and "unknown model" in err


def test_python_dash_m():
    result = subprocess.run(
        [sys.executable, "-m", "ckplan", "presets", "gpt2", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0 and json.loads(result.stdout)["layers"] == 12


def test_estimate_with_budget(cli):
    code, out, _ = cli("estimate", "gpt2", "--batch", "8", "--budget", "16GB", "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] and data["usable_bytes"] == 16 * 10**9 - 2 * 2**30
    memory = data["memory"]
    assert data["headroom_bytes"] == data["usable_bytes"] - memory["budgeted_bytes"]
    # the budget holds the allocated peak's 2 MiB blocks; the slack only while memory is spare
    assert memory["budgeted_bytes"] == -(-memory["total_bytes"] // 2**21) * 2**21
    assert memory["reserved_bytes"] > memory["budgeted_bytes"]
    code, out, _ = cli("estimate", "gpt2", "--batch", "8", "--budget", "4GB")
    assert code == 1 and "does not fit" in out
    code, out, _ = cli("estimate", "gpt2", "-s", "optimal", "--batch", "8", "--budget", "8GB")
    assert code == 0 and "fits:" in out
    code, _, err = cli("estimate", "gpt2", "-s", "optimal", "--budget", "4GB")
    assert code == 1 and "no optimal schedule fits" in err


def test_version(cli):
    code, out, _ = cli("--version")
    assert code == 0 and out.strip() == "ckplan 0.1.0"


# ---- integer options read as Typer reads them, with or without its pydantic adapter -------


@pytest.mark.parametrize("text", ["4096", "0004096", " 4096", "4_096", "+4096"])
def test_integer_options_read_as_typer_reads_them(cli, text):
    code, out, err = cli("estimate", "gpt2", "--seq", text, "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["seq"] == 4096


@pytest.mark.parametrize("text", ["4k", "1e3", "٤٠٩٦", ""])
def test_integer_options_refuse_as_typer_does(cli, text):
    code, out, err = cli("estimate", "gpt2", "--seq", text)
    assert code == 2 and out == ""
    assert "'--seq'" in err
