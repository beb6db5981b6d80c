"""A seeded fuzzer of ckplan's CLI: hostile-but-plausible invocations of every command.

    python tests/fuzz_cli.py --cases 2000 --seed 1        # `make fuzz FUZZ_CASES=.. FUZZ_SEED=..`
    python tests/fuzz_cli.py --seed 1 --only 17 --show    # one case again, with its output

Case i of seed S is generated from its own random.Random(f"S:i"), so `--only i` replays it. Each
case runs alone (one at a time) in a fresh directory holding its files, in a child process with a
wall timeout (--timeout, 10 s) and an address-space limit (--memory, 4 GiB): by default a fork of
this process, which has imported ckplan once, calls `ckplan.cli.main(argv)` (fast); `--exec` runs
`python -m ckplan` instead (a real start-up, slower). The outcome is classified from the exit code
and the output against ckplan's contract (one `error: ...` line on stderr for bad input, exit 2;
exit 1 for does-not-fit; exit 3 only for an internal error, which is a bug):

    ok-0 ok-1 ok-2     the contract holds
    exit-3             an internal error (a bug to report)
    exit-other         any other exit code (or a signal)
    timeout            no answer within --timeout
    traceback          "Traceback" on stderr
    multiline          a failing exit (1, 2) whose stderr is not exactly one `error: ` line
                       (exit 1 may print nothing on stderr)
    stdout-on-2        bad input that also printed on stdout
    written            a failing run that left the directory changed

It prints a summary table, then every bad case with a reproducer: the shell command and the case
as a tests/corpus/*.yaml entry (paste it, set `code` and `error`). Exit status: 0 when no case is
bad, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("COLUMNS", "120")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from tree_snapshot import snapshot  # noqa: E402

PRESETS = ROOT / "presets"
PROFILES = ROOT / "profiles"
HF_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"

MODEL_COMMANDS = ["estimate", "sweep", "check", "schedule", "plan", "export", "presets"]
ALL_COMMANDS = [*MODEL_COMMANDS, "gpus", "verify", "calibrate"]
SMALL_PRESETS = ["gpt2", "gpt2-xl", "llama3-8b", "mistral-7b", "gemma2-9b", "mixtral-8x7b"]
BIG_PRESETS = ["deepseek-v3", "qwen3-30b-a3b", "llama3-70b", "megatron-22b", "example-8192"]
GPU_NAMES = [
    "a100-40gb",
    "a100-80gb",
    "b200",
    "gb200",
    "h100-pcie",
    "h100-sxm",
    "h200",
    "h800",
    "l40s",
    "mi300x",
    "rtx-4090",
]
BASE_MODEL = {
    "name": "fuzz",
    "layers": 4,
    "hidden": 64,
    "heads": 4,
    "seq": 32,
    "micro_batch": 2,
    "vocab": 100,
}
MOE_MODEL = {**BASE_MODEL, "experts": 4, "top_k": 2, "moe_ffn_hidden": 32}
MLA_MODEL = {
    **BASE_MODEL,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
WINDOW_MODEL = {**BASE_MODEL, "sliding_window": 8, "sliding_window_layers": "0-:2"}

# ---- hostile values ---------------------------------------------------------------------------

INT_VALUES = [
    "0", "-1", "-0", "1", "2", "3", "7", "2.5", "1.0", "1e3", "1e400", "true", "false", "yes",
    "no", "on", "null", "~", "''", '""', "[]", "{}", "[1, 2]", "{a: 1}", ".inf", "-.inf", ".nan",
    "0x10", "0o17", "010", "1_000", "99999999999999999999999999999", "65536", "65537", "100001",
    "1048577", "16777217", "4194305", "2**10", "١٢", "１２", "٣", "१२", "½", "Ⅻ", "12 ", " 12",
    "12abc", "abc", "!!int 3", "!!str 3", "!!float 3", "!!binary AAAA", "&a 3", "*a", "|\n  3",
    "!!python/object:os.system ls", "!!set {a}", "!!timestamp 2001-01-01", "2001-01-01", "1:30",
    "+3", "3.", ".5", "1e-3", "NaN", "Infinity", "-Infinity",
]  # fmt: skip
STR_VALUES = [
    "", " ", "x", "FLASH", "Flash", "flash ", "layernorm", "rmsnorm", "rms_norm", "swiglu",
    "gelu", "geglu", "relu", "standard", "rope", "learned", "alibi", "transformer", "mlp",
    "moe", "1", "true", "null", "[a]", "{a: b}", "\u0000", "caf\u00e9", "\u202eevil",
    "a\nb", "\x1b[2J",
]  # fmt: skip
LAYER_SETS = [
    "all", "none", "", " ", "ALL", "0", "3-", "0-:2", "1-:2", "0-3", "3-0", "0-3:0", "0-3:-1",
    "0--3", "-1", "0,1,2", "0, 1", "0,,1", ",", "0-", "-", ":", "0-:", "0-:0", "0-99999",
    "99999999999999999999", "0-99999999999999999999", "0-:99999999999999999999", "1-2-3",
    "a-b", "[0, 1]", "[]", "[true]", "[0.5]", "[-1]", "[99]", "{0: 1}", "true", "1.5", "٠-٣",
    "０-", "0-3;4", "0 - 3", "first", "even", "odd",
]  # fmt: skip
SIZES = [
    "80GB", "80GiB", "80e9", "80 GB", "80gb", "80Gb", "80G", "80", "0", "0GB", "-1GB", "+80GB",
    "1e400GB", "1e-9GB", "0.5B", "1.5B", "80GB ", " 80GB", "80GiBs", "GB", "", "nan", "inf",
    "NaNGB", "infGB", "1,000GB", "1_000GB", "80٫5GB", "٨٠GB", "８０GB", "0x50GB", "2000000000TB",
    "999999999999999999999999999999999", "80PB", "80EB", "80ZB", "80KB", "80KiB", "80MB",
    "3MiB", "12345678.5", "1e10", "1e100", "80\u00a0GB", "80\tGB", "eighty", "80GBGB", "GB80",
    "1/2GB", "80.GB", ".5GB", "80e9B", "2GiB", "4.5GB", "40GB", "100GB",
]  # fmt: skip
STRATEGIES = [
    "none", "full", "sqrt", "selective", "optimal", "auto", "uniform:1", "uniform:2",
    "uniform:0", "uniform:-1", "uniform:99999", "uniform:", "uniform", "sequential:2",
    "sequential:0", "block:0", "block:1", "block:-1", "block:99", "revolve:1", "revolve:2",
    "revolve:0", "revolve:99999999", "selective+full", "selective+optimal", "selective+",
    "selective+selective", "moe+full", "experts+block:2", "selective+moe+block:2",
    "moe+moe+full", "moe+", "experts+selective", "full+selective", "FULL", " full", "full ",
    "uniform:２", "uniform:٢", "uniform: 2", "uniform:2.0", "uniform:1e1", "block:+1",
    "none,full", "", "+", ":", "optimal:3", "revolve:99999999999999999999999",
    "full+offload", "offload+full", "block:2+offload", "uniform:2+offload", "offload+offload",
    "full+offload+offload", "selective+full+offload", "offload+", "+offload", "sqrt+offload",
    "block:99+offload", "revolve:1+offload", "sac+full+offload", "moe+full+offload",
    "every:2", "every:0", "every:-1", "every:", "every:99999", "every:٢", "selective+every:2",
    # per-op policies: torchtitan's words, the op list and the scoped grammar
    "sac", "sac-fused", "SAC", "sac-fused+mixed", "sac+mixed", "sac-fused+block:2",
    "sac+block:2", "sac-fused+offload", "sac-fused+sac", "sac-fusedd", "sac-fused:x", "sac:",
    "sac:matmuls", "sac:matmuls%2", "sac:matmuls%0", "sac:matmuls%", "sac:matmuls%nan",
    "sac:matmuls%-1", "sac:matmuls%１", "sac:fused_qkv,matmuls%2", "sac:flex_attention",
    "sac:all_to_all", "sac:q_proj,,k_proj", "sac:ａttention", "sac:attention,rope",
    "sac@", "sac@=", "sac@mlp", "sac@attention", "sac@attention=", "sac@attention=/mlp",
    "sac@nosuch=x", "sac@attention=nosuch", "sac@mlp/mlp", "sac@mlp/mlp=gate_proj",
    "sac@mlp=gate_proj,up_proj", "sac@mlp=gate_proj,,up_proj", "sac@mlp=,", "sac@/mlp",
    "sac@mlp/", "sac@mlp=gate_proj=up_proj", "sac@MLP", "SAC@mlp", "sac@ｍlp",
    "sac@attention/core_attn", "sac@norm1/attention=v_proj,attention/mlp_act",
    "sac@moe=all_to_all", "sac@experts/moe", "sac@router/experts=up_proj",
    "sac@shared_experts", "sac@norm2_moe=router", "sac@mlp+block:2", "sac@mlp+mixed",
    "sac@mlp+offload", "sac@mlp+selective", "sac@mlp+sac", "sac@mlp=matmuls%2",
    "sac@mlp=fused_qkv", "sac@core_attn=attention",
]  # fmt: skip


def pick(rng: random.Random, options: list) -> Any:
    return options[rng.randrange(len(options))]


def hostile_int(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return str(rng.choice([-1, 1]) * rng.randrange(0, 10 ** rng.randrange(1, 40)))
    if rng.random() < 0.05:
        return "9" * rng.choice([20, 400, 4400, 5000])
    return pick(rng, INT_VALUES)


_BOOLS = {
    "bias", "tied_embeddings", "fused_swiglu", "sp", "qkv_bias", "qk_norm", "post_norms",
    "parallel_residual", "shared_expert_gate", "expert_bias", "attention_sinks",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
}  # fmt: skip
_ENUM_VALUES = {
    "kind": ["transformer", "mlp"],
    "norm": ["layernorm", "rmsnorm"],
    "mlp": ["gelu", "swiglu", "geglu"],
    "attention": ["standard", "flash"],
    "qk_norm_width": ["head", "full", "all", ""],
    "positions": ["learned", "rope"],
    "profile": ["fused", "torch-eager", "torch-sdpa"],
    "moe_imbalance": ["average", "worst", "1.5", "8"],
    "dropout": ["0.0", "0.1", "0.5"],
    "capacity_factor": ["1.0", "1.25", "2", "0.5"],
    "framework": ["megatron", "torchtitan", "deepspeed", "hf"],
    "framework_version": [
        "2024.12",
        "0.3",
        "0.2",
        "0.30",
        "2024.10",
        "",
        "v0.3",
        "nan",
        "te1.8",
        "te2.9",
        "te2.17",
        "2.9",
        "TE2.9",
    ],
    "grad_sync": ["micro_batch", "step", "STEP", "micro-batch", "", "never"],
    "kernels": ["fused", "eager", "compiled"],
    "attention_kernel": ["flash2", "flash3", "cudnn", "triton", "sdpa"],
    "precision": ["bf16", "fp16", "fp8", "fp32"],
    "fp8_recipe": ["delayed", "current", "mxfp8", "blockwise", "tensorwise", ""],
    "loss": ["fused", "eager", "xentropy", "compiled", "chunked:4", "chunked:1", "chunked:"],
    "training": ["full", "lora", "qlora", "frozen"],
    "optimizer_offload": ["none", "cpu", "cpu", "CPU", ""],
    "fsdp_backward_prefetch": ["none", "backward_pre", "backward_post", "BACKWARD_PRE", ""],
    "fsdp_reduce_dtype": ["fp32", "bf16", "fp16", "float32", "FP32", ""],
    "fsdp_version": ["1", "2", "2", "0", "3", "two", ""],
    "optimizer_implementation": ["fused", "foreach", "foreach", "for-loop", "FUSED", ""],
    "param_offload": ["none", "cpu", "cpu", "nvme"],
    "weight_format": ["nf4", "fp4", "int8", "bf16", "fp32", "int4"],
    "optimizer": ["adamw", "adamw-bf16", "adamw-8bit", "sgd", "lion", "adafactor"],
    "cp_attention": ["ring", "allgather", "a2a", "a2a+p2p", "p2p", "", "A2A", "a2a+P2P"],
}
# keys that only one framework takes: the framework set beside them most of the time
_FRAMEWORK_KEYS = {
    "framework_version": ["torchtitan", "torchtitan", "hf", "megatron"],
    "grad_sync": ["hf", "hf", "torchtitan", "deepspeed"],
    "fsdp_backward_prefetch": ["hf", "hf", "hf", "megatron"],
    "fsdp_reduce_dtype": ["hf", "hf", "hf", "torchtitan"],
    "fsdp_version": ["hf", "hf", "hf", "torchtitan"],
    "optimizer_implementation": ["hf", "hf", "torchtitan", "megatron"],
    "cp_attention": ["megatron", "megatron", "torchtitan", "hf"],
    "cp_a2a_size": ["megatron", "megatron", "megatron", "torchtitan"],
}
PLAUSIBLE = ["1", "2", "3", "4", "8", "16", "32", "64", "0", "5", "6", "7", "12", "128"]


def hostile_value(rng: random.Random, key: str) -> str:
    if rng.random() < 0.35:  # in range but in odd combinations: where divisions go wrong
        if key in ("moe_layers", "sliding_window_layers"):
            return pick(rng, ["all", "none", "0", "1-", "0-:2", "1-:3", "0,2", "3-"])
        if key in _BOOLS:
            return pick(rng, ["true", "false"])
        if key in _ENUM_VALUES:
            return pick(rng, _ENUM_VALUES[key])
        return pick(rng, PLAUSIBLE)
    if key in ("moe_layers", "sliding_window_layers"):
        return pick(rng, LAYER_SETS)
    texts = ("name", "source", "kind", "norm", "mlp", "attention", "positions", "profile")
    if key in texts and rng.random() < 0.7:
        return pick(rng, STR_VALUES)
    if key in ("dropout", "capacity_factor", "moe_imbalance") and rng.random() < 0.5:
        return pick(
            rng,
            [
                "0.5",
                "1",
                "1.0",
                "0.999",
                "-0.1",
                "2",
                "average",
                "worst",
                "1/2",
                "3/2",
                "1/0",
                "0/0",
                "1e-400",
                "1.5",
                "nan",
                "AVERAGE",
                " worst",
            ],
        )
    return hostile_int(rng)


def misspell(rng: random.Random, key: str) -> str:
    ops = [
        lambda k: k[:-1],
        lambda k: k + "s",
        lambda k: k.upper(),
        lambda k: k.replace("_", "-"),
        lambda k: k.replace("_", ""),
        lambda k: k[1:] + k[0],
        lambda k: " " + k,
        lambda k: k + " ",
        lambda k: k.replace("a", "\u0430"),  # Cyrillic a
        lambda k: k.title(),
    ]
    return pick(rng, ops)(key) or "x"


def yaml_scalar_text(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


# ---- model files ------------------------------------------------------------------------------


def mutate_model_text(rng: random.Random, base: dict) -> str:
    """A model YAML with one to three hostile mutations, written as text (tags, anchors...)."""
    lines = {key: yaml_scalar_text(value) for key, value in base.items()}
    keys = list(lines)
    from ckplan.model.spec import field_names

    fields = field_names()
    extra: list[str] = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        key = pick(rng, keys)
        if kind < 0.45:
            lines[key] = hostile_value(rng, key)
        elif kind < 0.6:
            field = pick(rng, fields)
            lines[field] = hostile_value(rng, field)
        elif kind < 0.7:
            lines[misspell(rng, key)] = lines.pop(key)
            keys = list(lines)
        elif kind < 0.77:
            lines.pop(key)
            keys = list(lines) or ["layers"]
        elif kind < 0.83:
            lines[key] = f"&anchor {lines[key]}"
            other = pick(rng, fields)
            lines[other] = "*anchor"
        elif kind < 0.88:
            lines[key] = pick(
                rng,
                [
                    "!!str 4",
                    "!!int '4'",
                    "!!float 4",
                    "!custom 4",
                    "!!null ''",
                    "!!python/tuple [1]",
                    "!!map {}",
                    "!!seq []",
                ],
            )
        elif kind < 0.92:
            extra.append(f"{key}: {hostile_value(rng, key)}")  # a duplicate key
        elif kind < 0.96:
            extra.append(
                pick(
                    rng,
                    [
                        "<<: {layers: 2}",
                        "? [a]\n: 1",
                        "--- \nlayers: 2",
                        "%YAML 1.1",
                        "\t layers: 2",
                        "layers: [",
                        "'layers': 2",
                        "1: 2",
                        "null: 3",
                        "true: 1",
                        "[1]: 2",
                    ],
                )
            )
        else:
            lines[key] = "\n" + "".join(f"  - {hostile_int(rng)}\n" for _ in range(2)).rstrip()
    body = "".join(f"{key}: {value}\n" for key, value in lines.items())
    return body + "".join(f"{line}\n" for line in extra)


def preset_mapping(rng: random.Random) -> dict:
    name = pick(rng, [*SMALL_PRESETS, "deepseek-v3", "qwen3-30b-a3b", "gemma2-9b"])
    data = yaml.safe_load((PRESETS / f"{name}.yaml").read_text(encoding="utf-8"))
    data.pop("source", None)
    return data


# ---- HF config.json ---------------------------------------------------------------------------

HF_FAMILIES = sorted(p.name for p in HF_FIXTURES.iterdir() if (p / "config.json").is_file())
JSON_VALUES = [
    0, -1, 1, 2, 2.5, 1e300, True, False, None, "4", "", "٤", [], [1], {}, {"a": 1}, 10**40,
    "NaN", "float8", "bfloat16", "float32", "int8", "silu", "gelu", "relu", "gelu_pytorch_tanh",
]  # fmt: skip
HF_EXTRA_KEYS = [
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim", "torch_dtype",
    "hidden_act", "tie_word_embeddings", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "num_local_experts", "num_experts_per_tok", "num_experts",
    "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size",
    "shared_expert_intermediate_size", "n_routed_experts",
    "first_k_dense_replace", "moe_layer_freq", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "attention_bias", "mlp_bias", "n_layer", "n_embd", "n_head",
    "n_positions", "n_inner", "attn_pdrop", "rope_scaling", "quantization_config", "text_config",
    "sliding_window_pattern", "num_nextn_predict_layers", "topk_method", "n_shared_experts",
    "no_rope_layers", "no_rope_layer_interval", "use_qk_norm", "n_group", "topk_group",
    "swiglu_limit", "clip_qkv", "norm_topk_prob", "attention_out_bias", "attention_dropout",
    "residual_dropout", "embedding_dropout", "use_bias", "use_mtp", "num_mtp_modules",
    "moe_num_experts", "moe_k", "moe_layer_start_index", "moe_layer_end_index",
    "moe_layer_interval", "shared_intermediate_size",
]  # fmt: skip


def hf_config_text(rng: random.Random) -> tuple[str, str]:
    family = pick(rng, HF_FAMILIES)
    config = json.loads((HF_FIXTURES / family / "config.json").read_text(encoding="utf-8"))
    # keep the shapes small so that a valid answer is fast
    for key, small in (("num_hidden_layers", 4), ("n_layer", 4)):
        if key in config and rng.random() < 0.7:
            config[key] = small
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if isinstance(config.get("text_config"), dict) and rng.random() < 0.5:
            # a multimodal file: its language model's keys, inside text_config
            text = config["text_config"]
            inner = pick(rng, list(text)) if text else "model_type"
            text[inner if kind < 0.6 else pick(rng, HF_EXTRA_KEYS)] = pick(rng, JSON_VALUES)
            continue
        key = pick(rng, list(config)) if config else "model_type"
        if kind < 0.5:
            config[key] = pick(rng, JSON_VALUES)
        elif kind < 0.75:
            config[pick(rng, HF_EXTRA_KEYS)] = pick(rng, JSON_VALUES)
        elif kind < 0.85:
            config.pop(key, None)
        elif kind < 0.93:
            config["model_type"] = pick(
                rng,
                [
                    *HF_FAMILIES,
                    "llama4",
                    "gemma3",
                    "bert",
                    "LLAMA",
                    "deepseek_v3",
                    "qwen2_moe",
                    "qwen3_moe",
                    "glm4_moe",
                    "smollm3",
                    "phi3",
                    "gpt_neox",
                    "gpt_oss",
                    "olmo2",
                    "olmo3",
                    "olmoe",
                    "mistral3",
                    "qwen3_vl",
                    "qwen3_vl_moe",
                    "qwen3_vl_text",
                    "qwen2_vl",
                    "qwen2_5_vl",
                    "ministral",
                    "ministral3",
                    "seed_oss",
                    "ernie4_5",
                    "helium",
                    "starcoder2",
                    "exaone4",
                    "minimax_m2",
                    "ernie4_5_moe",
                    "granitemoe",
                    "granitemoeshared",
                    "hunyuan_v1_dense",
                    "",
                ],
            )
        else:
            config[misspell(rng, key)] = config.pop(key)
    text = json.dumps(config, allow_nan=True)
    if rng.random() < 0.05:
        text = text[: rng.randrange(len(text))]
    return text, family


# ---- GPU and profile files --------------------------------------------------------------------


def gpu_file_text(rng: random.Random) -> str:
    data = yaml.safe_load((PRESETS / "gpus" / f"{pick(rng, GPU_NAMES)}.yaml").read_text())
    from ckplan.hardware.gpus import _FIELDS as GPU_FIELDS

    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        key = pick(rng, list(data) or ["name"])
        if kind < 0.6:
            data[key] = pick(rng, [*JSON_VALUES, "1.5e12", "312_000e9", "0.0", "-0.5", "1e-300"])
        elif kind < 0.75:
            data.pop(key, None)
        elif kind < 0.85:
            data[misspell(rng, key)] = data.pop(key, 1)
        else:
            data[pick(rng, list(GPU_FIELDS))] = pick(rng, JSON_VALUES)
    text = yaml.safe_dump(data, allow_unicode=True)
    if rng.random() < 0.1:
        text = pick(
            rng,
            [
                "",
                "[1, 2]",
                "name: [\n",
                "a: &a 1\nb: *a\n",
                "42\n",
                "!!python/none\n",
                "memory_bytes: !!binary AAAA\n",
            ],
        )
    return text


def profile_file_text(rng: random.Random) -> str:
    name = pick(rng, ["fused", "torch-eager", "torch-sdpa"])
    data = yaml.safe_load((PROFILES / f"{name}.yaml").read_text(encoding="utf-8"))
    ops = data.get("ops", {})
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.4 and ops:
            op = pick(rng, list(ops))
            part = pick(rng, ["saved", "workspace", "output_grad", "input_grad"])
            entry = ops[op] if isinstance(ops[op], dict) else {}
            entry[part] = pick(
                rng,
                [
                    {"sbh": "B"},
                    {"sbh": -1},
                    {"sbh": "2B+"},
                    {"xyz": 1},
                    {"sbh": "1/0"},
                    [],
                    "B",
                    {"sbh": True},
                    {"sbh": None},
                    {"as2b": "4-2B"},
                    {"sbh": "B*B"},
                    {"sbh": "1e3"},
                ],
            )
            ops[op] = entry
        elif kind < 0.55 and ops:
            ops[misspell(rng, pick(rng, list(ops)))] = {"saved": {"sbh": "B"}}
        elif kind < 0.7:
            data["requires"] = pick(
                rng,
                [
                    "attention=flash",
                    "attention=",
                    "nosuch=1",
                    "",
                    "x",
                    "attention=standard,norm=rmsnorm",
                    3,
                ],
            )
        elif kind < 0.8:
            data.pop(pick(rng, list(data)), None)
        else:
            data[pick(rng, ["name", "description", "ops", "when"])] = pick(rng, JSON_VALUES)
    return yaml.safe_dump(data, allow_unicode=True)


# ---- option values ----------------------------------------------------------------------------

OUTPUT_NAMES = [
    "out.png", "out.svg", "out.PNG", "out.pdf", "out", "sub/out.png", "out.png/", ".png", "-",
    "out.svg.png", "o\u00e9.svg", "out .svg", "",
]  # fmt: skip


def model_arg(rng: random.Random, files: dict) -> str:
    r = rng.random()
    if r < 0.35:
        return pick(rng, SMALL_PRESETS)
    if r < 0.42:
        return pick(rng, BIG_PRESETS)
    if r < 0.65:
        base = pick(rng, [BASE_MODEL, MOE_MODEL, MLA_MODEL, WINDOW_MODEL, BASE_MODEL])
        if rng.random() < 0.3:
            base = preset_mapping(rng)
        files["model.yaml"] = mutate_model_text(rng, base)
        return "model.yaml"
    if r < 0.85:
        text, family = hf_config_text(rng)
        files[f"{family}/config.json"] = text
        return f"{family}/config.json"
    if r < 0.92:
        files["model.yaml"] = yaml.safe_dump(
            pick(rng, [BASE_MODEL, MOE_MODEL, MLA_MODEL, WINDOW_MODEL])
        )
        return "model.yaml"
    return pick(
        rng,
        [
            "nosuch",
            "gpt3",
            "",
            "model.yml",
            "./gpt2",
            "GPT2",
            "gpt2.yaml",
            "config.json",
            "\u202egpt2",
            "-",
            "--",
            "llama3-8b ",
            "presets/gpt2.yaml",
        ],
    )


def set_args(rng: random.Random, moe: bool = False) -> list[str]:
    from ckplan.hardware.gpus import _FIELDS as GPU_FIELDS
    from ckplan.model.spec import field_names

    out: list[str] = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.6:
            key = pick(rng, field_names())
            if moe and rng.random() < 0.5:
                key = pick(
                    rng,
                    [
                        "experts",
                        "top_k",
                        "moe_ffn_hidden",
                        "moe_layers",
                        "ep",
                        "etp",
                        "capacity_factor",
                        "moe_imbalance",
                        "shared_experts",
                        "shared_ffn_hidden",
                        "expert_bias",
                        "sliding_window",
                        "sliding_window_layers",
                        "kv_lora_rank",
                        "q_lora_rank",
                    ],
                )
            out.append(f"{key}={hostile_value(rng, key)}")
            if key in _FRAMEWORK_KEYS and rng.random() < 0.7:
                out.append(f"framework={pick(rng, _FRAMEWORK_KEYS[key])}")
        elif r < 0.75:
            key = pick(rng, list(GPU_FIELDS))
            out.append(f"gpu.{key}={hostile_value(rng, key)}")
        elif r < 0.85:
            out.append(f"{misspell(rng, pick(rng, field_names()))}=2")
        else:
            out.append(
                pick(
                    rng,
                    [
                        "layers",
                        "=",
                        "==",
                        "layers==2",
                        "layers = 2",
                        "gpu.=1",
                        "gpu.",
                        "gpu.gpu.name=x",
                        ".layers=2",
                        "layers=2=3",
                        "tp=2,pp=2",
                        "layers=\u0000",
                        "name=" + "x" * 3000,
                        "layers=1 # c",
                    ],
                )
            )
    return [arg for value in out for arg in ("--set", value)]


def policy_framework(rng: random.Random, strategy: str) -> list[str]:
    """A framework whose layers a per-op policy runs on, most of the time beside one (megatron,
    the default, refuses them all before anything else is checked)."""
    if not strategy.lower().startswith("sac") or rng.random() < 0.3:
        return []
    return ["--set", f"framework={pick(rng, ['torchtitan', 'torchtitan', 'hf', 'deepspeed'])}"]


def budget_arg(rng: random.Random) -> list[str]:
    return ["--budget", pick(rng, SIZES)]


def gpu_arg(rng: random.Random, files: dict) -> list[str]:
    r = rng.random()
    if r < 0.65:
        return ["--gpu", pick(rng, GPU_NAMES)]
    if r < 0.85:
        files["gpu.yaml"] = gpu_file_text(rng)
        return ["--gpu", "gpu.yaml"]
    return [
        "--gpu",
        pick(
            rng,
            [
                "h100",
                "H100-SXM",
                "a100",
                "",
                "gpu.yml",
                "nosuch.yaml",
                "h100-sxm ",
                "mi300",
                "tpu-v5",
                "a100-80gb.yaml",
                "\u0430100-80gb",
            ],
        ),
    ]


def profile_arg(rng: random.Random, files: dict) -> list[str]:
    if rng.random() < 0.5:
        files["prof.yaml"] = profile_file_text(rng)
        return ["--profile", "prof.yaml"]
    return [
        "--profile",
        pick(
            rng,
            [
                "fused",
                "torch-eager",
                "torch-sdpa",
                "eager",
                "",
                "FUSED",
                "prof.yml",
                "nosuch.yaml",
                "torch_eager",
            ],
        ),
    ]


def shortcut(rng: random.Random, option: str) -> list[str]:
    return [
        option,
        pick(
            rng,
            [
                "0",
                "-1",
                "1",
                "2",
                "8",
                "2.5",
                "abc",
                "99999999999999999999",
                "1e3",
                "٣",
                "",
                "4096",
                "100001",
                "16777217",
            ],
        ),
    ]


def common_model_options(rng: random.Random, files: dict, command: str) -> list[str]:
    argv: list[str] = []
    if rng.random() < 0.45:
        argv += set_args(rng, moe=rng.random() < 0.5)
    if command != "plan":
        for option in ("--seq", "--batch", "--layers"):
            if rng.random() < 0.12:
                argv += shortcut(rng, option)
    elif rng.random() < 0.15:
        argv += shortcut(rng, "--seq")
    if command in ("estimate", "sweep", "check", "schedule", "plan") and rng.random() < 0.15:
        argv += profile_arg(rng, files)
    if command in ("estimate", "sweep", "check", "schedule") and rng.random() < 0.1:
        argv += [
            "--moe-imbalance",
            pick(
                rng,
                [
                    "average",
                    "worst",
                    "1",
                    "1.5",
                    "0.5",
                    "-1",
                    "nan",
                    "inf",
                    "3/2",
                    "1/0",
                    "",
                    "AVERAGE",
                    "1e400",
                ],
            ),
        ]
    if command != "calibrate" and rng.random() < 0.1:
        argv += ["--reserve", pick(rng, SIZES)]
    if command in ("sweep", "check", "schedule", "plan", "export") and rng.random() < 0.1:
        argv += ["--slots", pick(rng, ["1", "2", "0", "-1", "20000", "20001", "abc", "1e3"])]
    if command in ("estimate", "sweep", "check", "plan") and rng.random() < 0.1:
        argv += [
            "--format",
            pick(rng, ["table", "json", "csv", "markdown", "md", "", "JSON", "xml"]),
        ]
    if command not in ("export",) and rng.random() < 0.15:
        argv.append("--json")
    return argv


def generate(seed: int, index: int) -> dict:
    """Case `index` of `seed`: {argv, files, family}. No argument holds a NUL byte, which no
    process can receive."""
    case = _generate(seed, index)
    case["argv"] = [arg.replace("\x00", "\x01") for arg in case["argv"]]
    return case


# Per-op policies: valid layouts (which the mutations above rarely leave standing) under which a
# policy, mostly well-formed and now and then with one character of noise, reaches the models of
# regions and units, the searches that try them (sweep, plan) and the exports that refuse them
POLICY_PRESETS = ["llama3-8b", "mistral-7b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"]
POLICY_LAYOUTS = [
    ["framework=torchtitan"],
    ["framework=hf"],
    ["framework=deepspeed"],
    ["framework=hf", "dropout=0"],
    ["framework=torchtitan", "tp=2", "sp=true"],
    ["framework=torchtitan", "kernels=compiled"],
    ["framework=torchtitan", "kernels=compiled", "tp=8", "sp=true", "tp_comm_overlap=true"],
    [
        "framework=torchtitan",
        "kernels=compiled",
        "tp=4",
        "sp=true",
        "tp_comm_overlap=true",
        "seq=6",
    ],
    ["framework=torchtitan", "cp=2"],
    ["framework=torchtitan", "zero=3", "dp=8"],
    ["framework=torchtitan", "zero=3", "dp=8", "ep=8"],
    ["framework=torchtitan", "zero=3", "dp=8", "framework_version=2024.12"],
    ["framework=megatron", "cp=2", "framework_version=te1.8"],
    ["framework=megatron", "cp=2", "framework_version=te2.4"],
    ["framework=megatron", "cp=4", "cp_attention=a2a+p2p", "cp_a2a_size=2"],
    ["framework=torchtitan", "zero=2", "dp=8", "microbatches=4"],
    ["framework=torchtitan", "pp=2", "microbatches=4"],
    ["framework=hf", "zero=3", "dp=8", "microbatches=4", "grad_sync=step"],
    ["framework=hf", "zero=3", "dp=8", "microbatches=4", "grad_sync=micro_batch"],
    ["framework=megatron"],
]
POLICY_NOISE = ["", "=", ",", "/", " ", "\uff4d", "%2", "@", "+", ":", "\u00e9"]


def policy_text(rng: random.Random) -> str:
    """A per-op policy: torchtitan's words, an op list, or a scoped policy of one to three
    regions, each keeping up to three units; one in ten parts with a character of noise."""
    from ckplan.model.op_policy import GROUP_ITEMS, REGION_NAMES, UNIT_NAMES

    if rng.random() < 0.15:
        return pick(rng, ["sac", "sac-fused", "sac:matmuls%2,attention", "sac:fused_qkv,matmuls%2"])
    parts = []
    for _ in range(rng.randint(1, 3)):
        part = pick(rng, list(REGION_NAMES))
        if rng.random() < 0.6:
            units = [*UNIT_NAMES, *GROUP_ITEMS]
            part += "=" + ",".join(pick(rng, units) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.1:
            at = rng.randrange(len(part) + 1)
            part = part[:at] + pick(rng, POLICY_NOISE) + part[at:]
        parts.append(part)
    text = "sac@" + "/".join(parts)
    if rng.random() < 0.25:
        text += pick(rng, ["+block:2", "+mixed", "+offload", "+full", "+every:2", "+selective"])
    return text


def policy_case(rng: random.Random) -> dict:
    command = pick(rng, ["estimate", "estimate", "export", "export", "check", "schedule"])
    command = pick(rng, [command, command, command, "sweep", "plan"])
    argv = [command, pick(rng, POLICY_PRESETS)]
    strategy = policy_text(rng)
    if command in ("estimate", "check", "schedule"):
        argv += ["--strategy", strategy]
    if command == "export":
        targets = ["torch", "torch", "torchtitan", "megatron", "deepspeed", "yaml", "peft"]
        argv += ["--plan", strategy, "--to", pick(rng, targets)]
        if rng.random() < 0.15:
            argv += ["--torchtitan-version", pick(rng, ["0.2", "0.3"])]
    if command == "plan":
        argv += ["--gpus", pick(rng, ["8", "16", "72"]), "--gpu", pick(rng, ["gb200", "h100-sxm"])]
    elif command in ("check", "schedule", "sweep") or "mixed" in strategy or rng.random() < 0.3:
        if command != "export" and rng.random() < 0.5:
            argv += ["--gpu", pick(rng, ["gb200", "h100-sxm", "a100-80gb"])]
        else:
            argv += ["--budget", pick(rng, ["20GB", "40GB", "80GB"])]
    layout = list(pick(rng, POLICY_LAYOUTS))
    if rng.random() < 0.6:
        layout.append("layers=4")
    if rng.random() < 0.1:  # one key of the layout hostile
        key = pick(rng, ["grad_sync", "framework_version", "kernels", "dp", "zero"])
        layout.append(f"{key}={hostile_value(rng, key)}")
    argv += [arg for value in layout for arg in ("--set", value)]
    if command != "export" and rng.random() < 0.3:
        argv.append("--json")
    return {"argv": argv, "files": {}, "family": f"policy/{command}"}


def _generate(seed: int, index: int) -> dict:
    rng = random.Random(f"{seed}:{index}")
    files: dict[str, str] = {}
    if rng.random() < 0.15:
        return policy_case(rng)
    command = pick(rng, [*MODEL_COMMANDS, *MODEL_COMMANDS, "gpus", "verify", "calibrate"])
    argv: list[str] = [command]
    if command == "gpus":
        if rng.random() < 0.8:
            argv.append(pick(rng, [*GPU_NAMES, "h100", "", "nosuch", "gpu.yaml", "A100-80GB"]))
            if argv[-1] == "gpu.yaml":
                files["gpu.yaml"] = gpu_file_text(rng)
        if rng.random() < 0.3:
            argv.append("--json")
        return {"argv": argv, "files": files, "family": "gpus"}
    if command == "verify":
        for option, values in (
            ("--layers", ["1", "2", "4", "0", "-1", "100001", "abc"]),
            # verify may run for minutes by design (its FLOP cap is 1e13): sizes stay small
            # here, or beyond the ranges, which fail at once
            ("--hidden", ["8", "16", "0", "-8", "1048577", "1e3"]),
            ("--ffn-hidden", ["8", "32", "0", "4194305"]),
            ("--batch", ["1", "4", "0", "99999999"]),
            ("--repeats", ["1", "0", "101", "-1"]),
            ("--seed", ["0", "-1", "99999999999999999999", "7"]),
            ("--tolerance", ["0.05", "0", "1", "nan", "inf", "-0.1", "1e-300"]),
        ):
            if rng.random() < 0.3:
                argv += [option, pick(rng, values)]
        if "--layers" not in argv:
            argv += ["--layers", "4"]
        if "--hidden" not in argv:
            argv += ["--hidden", "16"]
        if "--ffn-hidden" not in argv:
            argv += ["--ffn-hidden", "32"]
        if "--batch" not in argv:
            argv += ["--batch", "4"]
        if "--repeats" not in argv:
            argv += ["--repeats", "1"]
        if rng.random() < 0.5:
            argv += ["--strategy", pick(rng, STRATEGIES)]
        if rng.random() < 0.3:
            argv += budget_arg(rng)
        return {"argv": argv, "files": files, "family": "verify"}
    if command == "presets":
        if rng.random() < 0.85:
            argv.append(model_arg(rng, files))
        if rng.random() < 0.3:
            argv.append("--json")
        return {"argv": argv, "files": files, "family": "presets"}
    model = model_arg(rng, files)
    argv.append(model)
    if command == "check" and rng.random() < 0.3:
        argv.append(pick(rng, ["gpt2", "*.yaml", "*/config.json", "nothing-*", "[", "**"]))
    family = (
        "hf"
        if model.endswith("config.json")
        else "model-file"
        if model.endswith(".yaml")
        else "preset"
    )
    if command == "calibrate":
        # Keep calibrate cheap: almost always something invalid before torch runs.
        bad = [
            ["--set", f"layers={hostile_int(rng)}"],
            ["--device", pick(rng, ["cuda", "tpu", "", "CPU", "cuda:9"])],
            ["--out", pick(rng, ["p.txt", "p.yaml", "", "sub/p.yaml"])],
            ["--name", ""],
            ["--seq", "0"],
            ["--batch", "-1"],
            ["--layers", "abc"],
            ["--set", "gpu.sm_count=0"],
            ["--bogus"],
        ]
        argv += pick(rng, bad)
        return {"argv": argv, "files": files, "family": "calibrate"}
    if (command in ("sweep", "check") and rng.random() < 0.85) or (
        command in ("schedule", "export") and rng.random() < 0.5
    ):
        argv += budget_arg(rng) if rng.random() < 0.6 else gpu_arg(rng, files)
    if command == "estimate" and rng.random() < 0.4:
        argv += budget_arg(rng)
    if command in ("estimate", "sweep", "check", "schedule") and rng.random() < 0.35:
        argv += gpu_arg(rng, files)
    if command in ("estimate", "check", "schedule") and rng.random() < 0.5:
        argv += ["--strategy", pick(rng, STRATEGIES)]
        argv += policy_framework(rng, argv[-1])
    if command in ("estimate", "sweep") and rng.random() < 0.1:
        argv += ["--formula", pick(rng, ["derived", "seed", "", "exact"])]
    if command == "sweep":
        if rng.random() < 0.15:
            argv += ["--rank", pick(rng, ["time", "flops", "memory", "", "TIME"])]
        if rng.random() < 0.1:
            argv += ["--micro-batch", pick(rng, ["auto", "4", "", "AUTO"])]
        if rng.random() < 0.1:
            argv += ["--seq", pick(rng, ["auto", "4096", " 512", "4k", "", "AUTO", "2_048"])]
        if rng.random() < 0.1:
            argv.append("--all")
    if command in ("estimate", "check", "plan") and rng.random() < 0.1:
        option = pick(rng, ["--seq", "--micro-batch"])
        argv += [option, pick(rng, ["auto", "Auto", "auto,", "", "4096"])]
    if command in ("estimate", "sweep", "check", "schedule", "plan") and rng.random() < 0.08:
        conventions = ["full", "causal", "recompute", "6n", "6n-all", "", "palm", "FULL"]
        argv += ["--mfu-convention", pick(rng, conventions)]
    if command in ("sweep", "check", "export") and rng.random() < 0.3:
        argv.append("--quiet")
    if command == "plan":
        if rng.random() < 0.9:
            argv += [
                "--gpus",
                pick(
                    rng, ["1", "2", "8", "16", "64", "0", "-8", "8.5", "1048577", "abc", "3", "12"]
                ),
            ]
        if rng.random() < 0.9:
            argv += gpu_arg(rng, files)
        if rng.random() < 0.3:
            argv += [
                "--global-batch",
                pick(rng, ["1", "8", "16", "0", "-1", "7", "1e3", "abc", "512"]),
            ]
        if rng.random() < 0.2:
            argv += ["--top", pick(rng, ["1", "0", "-1", "3", "1000", "abc"])]
        if rng.random() < 0.2:
            argv += budget_arg(rng)
        if rng.random() < 0.4:
            argv += [
                "--set",
                pick(
                    rng,
                    [
                        "tp=2",
                        "tp=3",
                        "pp=2",
                        "pp=4",
                        "cp=2",
                        "dp=2",
                        "ep=2",
                        "zero=1",
                        "zero=4",
                        "sp=true",
                        "virtual_stages=2",
                        "microbatches=4",
                        "tp=0",
                        "etp=2",
                        "first_stage_layers=1",
                        "pipeline_layout=Et|(t|)*2L",
                        "pipeline_layout=E(tt|)*9999L",
                        "pipeline_layout=Etm|tL",
                        "mtp_layers=1",
                        "tp=-1",
                        "dp=0",
                        "sp=maybe",
                        "framework=torchtitan",
                        "framework=hf",
                        "framework=deepspeed",
                        "framework_version=2024.12",
                        "grad_sync=step",
                    ],
                ),
            ]
    if command == "export":
        if rng.random() < 0.92:
            argv += ["--plan", pick(rng, STRATEGIES)]
            argv += policy_framework(rng, argv[-1])
        if rng.random() < 0.92:
            argv += [
                "--to",
                pick(
                    rng,
                    [
                        "megatron",
                        "torch",
                        "deepspeed",
                        "torchtitan",
                        "yaml",
                        "Megatron",
                        "",
                        "json",
                        "nemo",
                        "torch ",
                    ],
                ),
            ]
        if rng.random() < 0.15:
            argv.append(pick(rng, ["--recompute-modules", "--no-recompute-modules"]))
        if rng.random() < 0.2:
            versions = ["0.3", "0.2", "0.3.0", "", "0.4", "nan", "０.３", " 0.3", "-1"]
            argv += ["--torchtitan-version", pick(rng, versions)]
    if command in ("estimate", "sweep") and rng.random() < 0.06:
        argv += ["--plot", pick(rng, OUTPUT_NAMES)]
    argv += common_model_options(rng, files, command)
    if rng.random() < 0.03:  # an option twice, or an unknown one
        argv.append(pick(rng, ["--bogus", "--json", "-", "--", "--set", "--budget"]))
    return {"argv": argv, "files": files, "family": f"{command}/{family}"}


# ---- running ----------------------------------------------------------------------------------


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8", "surrogateescape"))


def limit_memory(memory: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def run_forked(
    argv: list[str], root: Path, timeout: float, memory: int
) -> tuple[int | None, str, str, float]:
    """Fork: the child chdirs, limits its memory and calls ckplan.cli.main(argv)."""
    out_path, err_path = root.parent / "stdout", root.parent / "stderr"
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child
        code = 4
        try:
            os.chdir(root)
            limit_memory(memory)
            out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            from ckplan.cli import main

            code = main(argv)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 5
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code if isinstance(code, int) else 4)
    deadline = start + timeout
    code: int | None = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    elapsed = time.monotonic() - start
    out = out_path.read_bytes().decode("utf-8", "replace") if out_path.exists() else ""
    err = err_path.read_bytes().decode("utf-8", "replace") if err_path.exists() else ""
    return code, out, err, elapsed


def run_exec(
    argv: list[str], root: Path, timeout: float, memory: int
) -> tuple[int | None, str, str, float]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    start = time.monotonic()
    try:
        result = subprocess.run(
            [os.fsencode(sys.executable), b"-m", b"ckplan", *(os.fsencode(a) for a in argv)],
            cwd=root,
            env=env,
            capture_output=True,
            timeout=timeout,
            preexec_fn=lambda: limit_memory(memory),
        )
    except subprocess.TimeoutExpired as expired:
        out = (expired.stdout or b"").decode("utf-8", "replace")
        err = (expired.stderr or b"").decode("utf-8", "replace")
        return None, out, err, time.monotonic() - start
    return (
        result.returncode,
        result.stdout.decode("utf-8", "replace"),
        result.stderr.decode("utf-8", "replace"),
        time.monotonic() - start,
    )


def classify(code: int | None, out: str, err: str, changed: bool) -> list[str]:
    """The contract's verdicts for one run: ['ok-N'] or the problems."""
    if code is None:
        return ["timeout"]
    problems = []
    if "Traceback" in err:
        problems.append("traceback")
    if code == 3:
        problems.append("exit-3")
    elif code not in (0, 1, 2):
        problems.append("exit-other")
    lines = err.splitlines()
    if code == 2 and (len(lines) != 1 or not lines[0].startswith("error: ")):
        problems.append("multiline")
    # exit 1 may carry notes before its error line, or nothing on stderr
    if code == 1 and lines and not any(line.startswith("error: ") for line in lines):
        problems.append("multiline")
    if code == 2 and out.strip():
        problems.append("stdout-on-2")
    if code not in (0, 1) and changed:  # exit 1 is an answer: its --plot may be written
        problems.append("written")
    return problems or [f"ok-{code}"]


def corpus_entry(case: dict, code: int | None, err: str) -> str:
    line = err.splitlines()[0] if err.splitlines() else ""
    entry: dict[str, Any] = {"id": f"fuzz-{case['seed']}-{case['index']}", "argv": case["argv"]}
    if case["files"]:
        entry["files"] = case["files"]
    entry["code"] = code
    entry["error"] = line.removeprefix("error: ")[:80]
    return yaml.safe_dump([entry], allow_unicode=True, width=100, sort_keys=False).rstrip()


def reproducer(case: dict) -> str:
    parts = []
    for name, text in case["files"].items():
        folder = os.path.dirname(name)
        if folder:
            parts.append(f"mkdir -p {shlex.quote(folder)}")
        parts.append(f"printf %s {shlex.quote(text)} > {shlex.quote(name)}")
    parts.append("python -m ckplan " + " ".join(shlex.quote(a) for a in case["argv"]))
    return " && ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, nargs="*", help="run only these case indices")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per case")
    parser.add_argument("--memory", type=float, default=4.0, help="GiB of address space per case")
    parser.add_argument("--exec", action="store_true", help="run `python -m ckplan` per case")
    parser.add_argument("--show", action="store_true", help="print every case's output")
    parser.add_argument("--jsonl", help="append every case and its outcome to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress dots")
    args = parser.parse_args()
    memory = int(args.memory * 2**30)
    runner = run_exec if args.exec else run_forked
    if not args.exec:
        import ckplan.cli

        ckplan.cli.click_command()
    indices = args.only if args.only is not None else range(args.cases)
    counts: collections.Counter = collections.Counter()
    by_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    bad: list[tuple[dict, list[str], int | None, str, str, float]] = []
    slowest: list[tuple[float, int]] = []
    started = time.monotonic()
    log = open(args.jsonl, "a", encoding="utf-8") if args.jsonl else None  # noqa: SIM115
    for n, index in enumerate(indices):
        case = generate(args.seed, index) | {"seed": args.seed, "index": index}
        with tempfile.TemporaryDirectory(prefix="ckplan-fuzz-") as tmp:
            root = Path(tmp, "case")
            root.mkdir()
            write_files(root, case["files"])
            before = snapshot(root)
            code, out, err, elapsed = runner(case["argv"], root, args.timeout, memory)
            changed = snapshot(root) != before
        verdicts = classify(code, out, err, changed)
        for verdict in verdicts:
            counts[verdict] += 1
            by_family[case["family"].split("/")[0]][verdict] += 1
        slowest.append((elapsed, index))
        if not verdicts[0].startswith("ok-"):
            bad.append((case, verdicts, code, out, err, elapsed))
        if log:
            log.write(
                json.dumps(
                    {
                        **case,
                        "code": code,
                        "verdicts": verdicts,
                        "err": err[:2000],
                        "seconds": round(elapsed, 3),
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
        if args.show:
            print(f"--- case {index} ({case['family']}): exit {code}, {elapsed:.2f}s, {verdicts}")
            print("$ " + reproducer(case))
            print(out[-3000:], end="")
            print(err[-3000:], end="", file=sys.stdout)
        elif not args.quiet and n % 50 == 49:
            print(
                f"{n + 1} cases, {len(bad)} bad, {time.monotonic() - started:.0f}s", file=sys.stderr
            )
    if log:
        log.close()
    total = len(list(indices))
    print(f"\nckplan fuzz: seed {args.seed}, {total} cases, {time.monotonic() - started:.0f}s")
    verdict_names = sorted({v for c in by_family.values() for v in c})
    header = f"{'family':<12}" + "".join(f"{v:>12}" for v in verdict_names)
    print(header)
    for family in sorted(by_family):
        print(f"{family:<12}" + "".join(f"{by_family[family][v]:>12}" for v in verdict_names))
    print(f"{'total':<12}" + "".join(f"{counts[v]:>12}" for v in verdict_names))
    slowest.sort(reverse=True)
    print("slowest: " + ", ".join(f"#{i} {s:.1f}s" for s, i in slowest[:5]))
    for case, verdicts, code, _out, err, elapsed in bad:
        print(
            f"\n=== BAD case {case['index']} of seed {case['seed']} ({case['family']}): "
            f"{', '.join(verdicts)}; exit {code}, {elapsed:.1f}s"
        )
        print("stderr: " + (err.strip()[-1500:] or "(empty)"))
        print(
            "replay: python tests/fuzz_cli.py --seed {} --only {} --show".format(
                case["seed"], case["index"]
            )
        )
        print("$ " + reproducer(case))
        print(corpus_entry(case, code, err))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
