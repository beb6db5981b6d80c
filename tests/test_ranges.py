"""Every size key has a documented range: its ends are accepted, one past them is a one-line error,
and the largest models inside it are answered with exact integers."""

import json
from pathlib import Path

import pytest

from ckplan.cli import main
from ckplan.model.spec import SIZE_RANGES, SpecError, spec_from_mapping

BASE = {"name": "t", "layers": 4, "hidden": 64, "heads": 4, "seq": 16, "micro_batch": 2}
MODELS_PAGE = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text("utf-8")


def corner(key: str, value: int) -> dict:
    """BASE with `key` at `value`, and whatever other keys that value needs to be consistent."""
    spec = {**BASE, key: value}
    if key in ("heads", "kv_heads", "tp"):
        spec |= {"hidden": max(64, value), "heads": max(4, value)}
    if key in ("pp", "virtual_stages"):
        spec |= {"layers": max(4, value)}
    if key == "cp":
        spec |= {"seq": max(16, value)}
    if key == "cp_a2a_size":  # a2a+p2p's groups, unchecked against cp 1
        spec |= {"framework": "megatron", "cp_attention": "a2a+p2p"}
    if key == "mlp_tiles":  # at most one token a tile
        spec |= {"seq": max(spec.get("seq", 1), value)}
    if key == "tp":
        spec |= {"kv_heads": max(4, value)}
    moe_keys = ("ep", "top_k", "shared_experts", "shared_ffn_hidden", "etp", "moe_ffn_hidden")
    if key in moe_keys and value > 0:
        spec |= {"experts": max(8, value) if key in ("ep", "top_k") else 8}
        if key == "etp":
            spec |= {"moe_ffn_hidden": max(256, value)}
        if key in ("ep", "etp"):
            spec |= {"dp": value}  # expert groups are carved from the data-parallel GPUs
    if key in ("moe_router_num_groups", "moe_router_group_topk") and value > 0:
        groups = max(8, value)  # one expert a group; top_k 1 fits any group_topk
        chosen = value if key == "moe_router_group_topk" else 1
        spec |= {"experts": groups, "top_k": 1, "moe_router_num_groups": groups}
        spec |= {"moe_router_group_topk": chosen}
    mla_keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if key in mla_keys and value > 0:
        spec = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8}
        spec |= {**BASE, "v_head_dim": 8, "bias": False, key: value}
    if key in ("first_stage_layers", "last_stage_layers"):
        spec |= {"pp": 2, "layers": value + 1}
    if key == "lora_rank":
        spec |= {"training": "lora"}
    if key == "fsdp_version":  # the Hugging Face Trainer's FSDP
        spec |= {"framework": "hf"}
    if key == "mtp_layers" and value > 0:  # each depth reads the embedding, feeds the head
        spec |= {"vocab": 64}
    if key == "microbatch_group_size":  # the interleaved schedule's, pp <= N <= microbatches
        spec |= {"pp": 1 if value == 1 else 2, "virtual_stages": 2, "microbatches": value}
    return spec


@pytest.mark.parametrize("key", sorted(SIZE_RANGES))
def test_both_ends_of_every_range_are_accepted(key):
    low, high = SIZE_RANGES[key]
    for value in (low, high):
        if key == "hidden" and value == 1:
            spec = spec_from_mapping({**BASE, "hidden": 1, "heads": 1})
        elif key in ("heads", "kv_heads") and value == 1:
            spec = spec_from_mapping({**BASE, "heads": 1, "kv_heads": 1})
        else:
            spec = spec_from_mapping(corner(key, value))
        assert getattr(spec, key) == value


@pytest.mark.parametrize("key", sorted(SIZE_RANGES))
def test_one_past_either_end_is_a_one_line_error_naming_the_key(key):
    low, high = SIZE_RANGES[key]
    for value in (low - 1, high + 1, 10**40, -(10**40)):
        with pytest.raises(SpecError) as info:
            spec_from_mapping({**BASE, key: value}, "m.yaml")
        message = str(info.value)
        assert f"'{key}'" in message and "\n" not in message and len(message) < 200


def test_every_range_is_documented():
    table = MODELS_PAGE[MODELS_PAGE.index("## Ranges") :]
    for key in SIZE_RANGES:
        assert f"`{key}`" in table, key


def test_the_largest_shapes_are_exact_integers(capsys):
    """hidden 2^20, 2^16 heads, 16M tokens, a 16M vocabulary, a 1M micro-batch: every byte and
    FLOP count is an exact int (far beyond float precision), and the terms add up exactly."""
    settings = (
        "hidden=1048576 heads=65536 seq=16777216 vocab=16777216 micro_batch=1048576 "
        "ffn_hidden=4194304 dtype_bytes=8 dropout=0.1"
    )
    code = main(["estimate", "gpt2", "--json", *(f"--set={s}" for s in settings.split())])
    data = json.loads(capsys.readouterr().out)
    memory, flops = data["memory"], data["flops"]
    assert code == 0
    assert all(isinstance(v, int) for v in (*memory["breakdown"].values(), *flops.values()))
    assert sum(memory["breakdown"].values()) == memory["per_layer_activation_bytes"] > 2**80
    assert memory["total_bytes"] == memory["activation_bytes"] + memory["model_state_bytes"]
    assert flops["total"] == flops["forward"] + flops["backward"] + flops["recompute"]


def test_the_deepest_model_is_answered(capsys):
    code = main(["estimate", "gpt2", "--layers", "100000", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["model"]["layers"] == 100_000
    assert (
        data["memory"]["activation_bytes"] > 100_000 * data["memory"]["per_layer_activation_bytes"]
    )


def test_every_integer_key_has_a_range():
    """A new size key (MoE experts, MLA ranks, ...) needs its documented range too."""
    from ckplan.model.spec import model_keys

    integers = {key for key, f in model_keys().items() if f.type.startswith("int")}
    assert integers == set(SIZE_RANGES)
