"""The command line on MoE, MLA and mixed-layer models: the expert-parallel layout in the
breakdown, --moe-imbalance, HF configs as MODEL."""

import json
from pathlib import Path

HF = Path(__file__).parent / "fixtures" / "hf"
# DeepSeek-V3 as trained (DeepSeek-V3 report §3.2): no TP, PP 16, EP 64, ZeRO-1 data parallel;
# its 61 layers split 1 + 15 x 4 over the stages.
DEEPSEEK_LAYOUT = [
    *("--set", "tp=1", "--set", "ep=64", "--set", "dp=128", "--set", "pp=16"),
    *("--set", "first_stage_layers=1", "--set", "zero=1", "--set", "microbatches=64"),
]


def test_sweep_deepseek_v3_shows_the_expert_parallel_layout(cli):
    code, out, _ = cli("sweep", "deepseek-v3", "--budget", "80GB", *DEEPSEEK_LAYOUT)
    assert code == 0
    assert "Experts: 256 (top-8) over ep=64: 4 per GPU" in out
    assert "expert data parallel 2" in out
    code, out, _ = cli("sweep", "deepseek-v3", "--budget", "80GB", *DEEPSEEK_LAYOUT, "--json")
    best = json.loads(out)["best"]
    layout = best["memory"]["expert_parallel"]
    assert (layout["ep"], layout["experts_per_gpu"], layout["expert_data_parallel"]) == (64, 4, 2)
    assert layout["routed_rows_per_gpu"] == 4096 * 8
    experts = best["memory"]["model_states"]["experts"]
    assert 0 < experts["total"] < best["memory"]["model_state_bytes"]
    assert best["fits"]


def test_estimate_moe_imbalance_worst_needs_more_memory(cli):
    layout = ["--set", "ep=8", "--set", "dp=8"]
    _, average, _ = cli("estimate", "mixtral-8x7b", *layout, "--json")
    _, worst, _ = cli("estimate", "mixtral-8x7b", *layout, "--moe-imbalance", "worst", "--json")
    average, worst = json.loads(average), json.loads(worst)
    assert (
        worst["memory"]["per_layer_activation_bytes"]
        > (average["memory"]["per_layer_activation_bytes"])
    )
    assert (
        worst["memory"]["expert_parallel"]["routed_rows_per_gpu"]
        == 4 * (average["memory"]["expert_parallel"]["routed_rows_per_gpu"])
    )
    code, _, err = cli("estimate", "mixtral-8x7b", "--moe-imbalance", "half")
    assert code == 2 and "moe_imbalance" in err and len(err.strip().splitlines()) == 1


def test_estimate_view_of_a_mixed_model(cli):
    code, out, _ = cli("estimate", "deepseek-v3", *DEEPSEEK_LAYOUT, "--strategy", "moe")
    assert code == 0
    assert "dense layer (3 of 61: 0-2)" in out and "moe layer (58 of 61: 3-)" in out
    assert "of which experts" in out and "active" in out


def test_hf_config_as_model(cli):
    config = str(HF / "Qwen3-30B-A3B" / "config.json")
    code, out, _ = cli("estimate", config, "--seq", "4096", "--json")
    assert code == 0 and json.loads(out)["parameters"]["total"] == 30_532_122_624


def test_unsupported_hf_model_type_is_one_line(cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mamba", "num_hidden_layers": 2}))
    code, _, err = cli("estimate", str(path))
    assert code == 2 and "unsupported model_type 'mamba'; supported: llama" in err
    assert len(err.strip().splitlines()) == 1
