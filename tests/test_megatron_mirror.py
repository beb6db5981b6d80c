"""tests/megatron_mirror.py: ArgumentGroupFactory's rules (megatron/training/argument_utils.py,
NVIDIA/Megatron-LM core_v0.19.0) read from a small source tree, and the generated mirror."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_flags
import megatron_mirror

CONFIG = """
import enum
from dataclasses import dataclass, field
from typing import List, Literal, Optional

from .base import BaseConfig


class Backend(enum.Enum):
    flash = 1
    auto = 5


@dataclass
class Config(BaseConfig):
    num_layers: int = field(default=0, metadata={"argparse_meta": {"default": None}})
    granularity: Optional[Literal["full", "selective"]] = None
    modules: Optional[List[str]] = None
    offload: list[str] = field(default_factory=list)
    size: int = 1024 * 1024
    backend: Backend = Backend.auto
    use_bias: bool = field(default=True, metadata={"argparse_meta": {"arg_names": ["--no-bias"]}})
    fused: bool = True
    hidden: int | None = None
    internal: int = field(default=0, init=False)
    skipped: int = 3
"""
BASE = """
from dataclasses import dataclass


@dataclass
class BaseConfig:
    offloading: bool = False
"""
ARGUMENTS = """
def _add_args(parser):
    from pkg.config import Config
    exclude = ["skipped"]
    ArgumentGroupFactory(Config, exclude=exclude).build_group(parser, "config")
"""


def test_factory_rules_on_a_source_tree(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text(CONFIG)
    (package / "base.py").write_text(BASE)
    (package / "arguments.py").write_text(ARGUMENTS)
    calls = megatron_mirror.all_factory_calls(megatron_mirror.Sources(tmp_path), "pkg.arguments")
    flags = {tuple(names): keywords for names, keywords in calls}
    assert flags == {
        ("--offloading",): {"dest": "offloading", "default": False, "action": "store_true"},
        ("--num-layers",): {"dest": "num_layers", "default": None, "type": "int"},
        ("--granularity",): {
            "dest": "granularity",
            "default": None,
            "type": "str",
            "choices": ("full", "selective"),
        },
        ("--modules",): {"dest": "modules", "default": None, "type": "str", "nargs": "+"},
        ("--offload",): {"dest": "offload", "default": [], "type": "str", "nargs": "+"},
        ("--size",): {"dest": "size", "default": 1048576, "type": "int"},
        ("--backend",): {
            "dest": "backend",
            "default": "auto",
            "type": "str",
            "choices": ["flash", "auto"],
        },
        ("--no-bias",): {"dest": "use_bias", "default": True, "action": "store_false"},
        ("--no-fused", "--disable-fused"): {
            "dest": "fused",
            "default": True,
            "action": "store_false",
        },
        ("--hidden",): {"dest": "hidden", "default": None, "type": "int"},
    }


@pytest.mark.parametrize(
    "annotation", ["Union[int, str] = 1", "int | str = 1", "Callable = None", "tuple[int] = ()"]
)
def test_a_type_argparse_cannot_take_fails_as_in_megatron(tmp_path, annotation):
    """_extract_type raises on these, and build_group with it (no argparse_meta to defer to)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "base.py").write_text(BASE)
    (package / "config.py").write_text(
        "from dataclasses import dataclass\nfrom typing import Callable, Union\n\n\n"
        f"@dataclass\nclass Config:\n    value: {annotation}\n"
    )
    (package / "arguments.py").write_text(ARGUMENTS)
    with pytest.raises(megatron_mirror.FactoryError, match=r"Config\.value"):
        megatron_mirror.all_factory_calls(megatron_mirror.Sources(tmp_path), "pkg.arguments")


def test_the_mirror_has_the_config_flags_of_core_v0_19_0():
    """Flags that exist at core_v0.19.0 only through the factory parse with their types."""
    assert megatron_flags.RELEASE == "core_v0.19.0"
    args = megatron_flags.parser().parse_args(
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "2",
            "--cpu-offloading-num-layers",
            "3",
            "--fine-grained-activation-offloading",
            "--offload-modules",
            "core_attn",
            "attn_proj",
            "--disable-bias-linear",
        ]
    )
    assert args.recompute_granularity == "full" and args.recompute_num_layers == 2
    assert args.cpu_offloading_num_layers == 3
    assert args.fine_grained_activation_offloading
    assert args.offload_modules == ["core_attn", "attn_proj"]
    assert args.add_bias_linear is False
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        megatron_flags.parser().parse_args(["--recompute-granularity", "partial"])


# ---- activation offload at core_v0.19.0 --------------------------------------------------


def _exported(model: str, name: str, **overrides) -> str:
    from ckplan import exports
    from ckplan.inputs.presets import load_spec
    from ckplan.plan import evaluate
    from ckplan.plan.strategies import parse_strategy

    spec = load_spec(model, overrides)
    return exports.export(evaluate(spec, parse_strategy(name, spec)), "megatron").text


def test_cpu_offloading_stops_one_layer_short_of_every_layer():
    """gpt2 has 12 layers: Megatron-Core offloads at most 11 of them, so ckplan's `offload`
    (every layer's tape and the embedding's on host) has no flag."""
    from megatron_args import MegatronArgError, parse, validate

    text = _exported("gpt2", "none")
    assert validate(parse(text + " --cpu-offloading-num-layers 11", 1)).cpu_offloading
    with pytest.raises(MegatronArgError, match="only for layers less than 12"):
        validate(parse(text + " --cpu-offloading-num-layers 12", 1))


def test_cpu_offloading_refuses_recomputation_and_pipeline_stages():
    from megatron_args import MegatronArgError, parse, validate

    with pytest.raises(MegatronArgError, match="activation recomputation is enabled"):
        validate(parse(_exported("gpt2", "full") + " --cpu-offloading-num-layers 1", 1))
    with pytest.raises(MegatronArgError, match="activation recomputation is enabled"):
        validate(parse(_exported("gpt2", "selective") + " --cpu-offloading-num-layers 1", 1))
    staged = _exported("gpt2", "none", pp=2, microbatches=4)
    with pytest.raises(MegatronArgError, match="Pipeline parallelism"):
        validate(parse(staged + " --cpu-offloading-num-layers 1", 8))


def test_fine_grained_offloading_takes_submodule_inputs():
    """--offload-modules names submodules whose inputs go to host, beside recomputation too."""
    from megatron_args import MegatronArgError, parse, validate

    text = _exported("gpt2", "selective") + " --fine-grained-activation-offloading"
    args = validate(parse(text + " --offload-modules attn_norm core_attn attn_proj", 1))
    assert args.offload_modules == ["attn_norm", "core_attn", "attn_proj"]
    with pytest.raises(MegatronArgError, match="without core_attn"):
        validate(parse(text + " --offload-modules attn_proj", 1))
    with pytest.raises(MegatronArgError, match="Invalid choices"):
        validate(parse(text + " --offload-modules layer", 1))


@pytest.mark.parametrize(
    ("name", "because"),
    [
        ("offload", "at most num_layers - 1 layers"),
        ("selective+offload", "refuses CPU offloading beside recomputation"),
        ("full+offload", "refuses CPU offloading beside recomputation"),
        ("block:4+offload", "refuses CPU offloading beside recomputation"),
    ],
)
def test_offload_plans_are_refused_naming_the_release(name, because):
    from ckplan import exports
    from ckplan.inputs.presets import load_spec
    from ckplan.plan import evaluate
    from ckplan.plan.strategies import parse_strategy

    spec = load_spec("gpt2")
    why = exports.why_not(evaluate(spec, parse_strategy(name, spec)), "megatron")
    assert "Megatron-LM core_v0.19.0" in why and because in why


def test_the_shared_expert_gate_is_a_flag_from_core_v0_16_0():
    """Qwen2-MoE's sigmoid gate on the shared experts: `--moe-shared-expert-gate` (absent from
    core_v0.15.0's flags), which the core_v0.19.0 mirror parses into the config field."""
    from megatron_args import parse, validate

    text = _exported("qwen3-30b-a3b", "full", shared_experts=1, shared_expert_gate=True)
    args = validate(parse(text, 1))
    assert args.moe_shared_expert_gate and args.moe_shared_expert_intermediate_size == 768
    plain = _exported("qwen3-30b-a3b", "full", shared_experts=1)
    assert not validate(parse(plain, 1)).moe_shared_expert_gate


def test_the_fused_moe_kernels_and_padded_capacity_are_flags_the_mirror_parses():
    """`moe_permute_fusion` and `moe_router_fusion` export as `--moe-permute-fusion` and
    `--moe-router-fusion` (store_true, default False in the core_v0.19.0 mirror), a capacity
    factor as `--moe-expert-capacity-factor` with `--moe-pad-expert-input-to-capacity`; the
    defaults export none of them."""
    from megatron_args import parse, validate

    fused = dict(moe_permute_fusion=True, moe_router_fusion=True, capacity_factor=1.0)
    args = validate(parse(_exported("qwen3-30b-a3b", "full", **fused), 1))
    assert args.moe_permute_fusion and args.moe_router_fusion
    assert args.moe_expert_capacity_factor == 1.0 and args.moe_pad_expert_input_to_capacity
    plain = validate(parse(_exported("qwen3-30b-a3b", "full"), 1))
    assert not plain.moe_permute_fusion and not plain.moe_router_fusion
    assert plain.moe_expert_capacity_factor is None and not plain.moe_pad_expert_input_to_capacity


def test_the_fp8_recipe_is_a_flag_the_mirror_parses():
    """`fp8_recipe` current exports as `--fp8-recipe tensorwise` (Megatron-LM's name for
    Transformer Engine's Float8CurrentScaling), mxfp8 as `--fp8-recipe mxfp8`, blockwise as
    `--fp8-recipe blockwise` (Float8BlockScaling); delayed is
    Megatron-LM's default and exports no flag. Under current scaling the layernorm module's
    recomputation, which Megatron-Core refuses under delayed scaling, parses and validates."""
    from megatron_args import parse, validate

    current = validate(
        parse(_exported("llama3-8b", "full", precision="fp8", fp8_recipe="current"), 1)
    )
    assert current.fp8 == "hybrid" and current.fp8_recipe == "tensorwise"
    mxfp8 = _exported("llama3-8b", "full", precision="fp8", fp8_recipe="mxfp8")
    assert validate(parse(mxfp8, 1)).fp8_recipe == "mxfp8"
    delayed = _exported("llama3-8b", "full", precision="fp8")
    assert "--fp8-recipe" not in delayed
    assert validate(parse(delayed, 1)).fp8_recipe == "delayed"
    text = _exported("llama3-8b", "layernorm+selective", precision="fp8", fp8_recipe="current")
    args = validate(parse(text, 1))
    assert "layernorm" in args.recompute_modules and args.fp8_recipe == "tensorwise"
    # blockwise: Transformer Engine's Float8BlockScaling, `--fp8-recipe blockwise`, which also
    # allows the layernorm module's recomputation
    text = _exported("llama3-8b", "layernorm+selective", precision="fp8", fp8_recipe="blockwise")
    assert "--fp8-recipe blockwise" in text
    args = validate(parse(text, 1))
    assert "layernorm" in args.recompute_modules and args.fp8_recipe == "blockwise"


def test_fp8_primary_weights_are_a_flag_the_mirror_parses():
    """`fp8_param_gather` exports as `--fp8-param-gather` beside `--use-distributed-optimizer`
    (zero 1), which validate_args requires of it; without the key no flag."""
    from megatron_args import MegatronArgError, parse, validate

    keys = dict(precision="fp8", fp8_recipe="current", dp=8, zero=1)
    text = _exported("llama3-8b", "full", fp8_param_gather=True, **keys)
    args = validate(parse(text, 8))
    assert args.fp8_param_gather and args.use_distributed_optimizer
    assert args.fp8_recipe == "tensorwise"
    assert not validate(parse(_exported("llama3-8b", "full", **keys), 8)).fp8_param_gather
    alone = text.replace("--use-distributed-optimizer\n", "")
    with pytest.raises(MegatronArgError, match="fp8-param-gather"):
        validate(parse(alone, 8))
