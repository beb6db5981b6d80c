"""The dispatch of DeepSeek-V3's training: FP8 dispatch (report arXiv 2412.19437 §3.3.3,
"Low-Precision Communication") and node-limited routing sent once per node over the network
(§2.1.2, §3.2.2): `moe.dispatch_row_bytes`, `moe.node_reach_probability`,
`expert_parallel.node_limited_all_to_all_seconds`."""

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from ckplan.hardware.communication import hierarchical_all_to_all_seconds
from ckplan.hardware.expert_parallel import (
    combine_bytes,
    dispatch_bytes,
    expert_parallel_comm,
    node_limited_all_to_all_seconds,
)
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.moe import dispatch_row_bytes, expected_nodes_reached, node_reach_probability
from ckplan.model.op import LayerShapes
from ckplan.model.spec import SpecError

HF_FIXTURES = Path(__file__).parent / "fixtures" / "hf"
H800_RUN = {
    "precision": "fp8",
    "pp": 16,
    "first_stage_layers": 4,
    "last_stage_layers": 1,
    "ep": 64,
    "dp": 128,
}


def test_fp8_dispatch_row_by_hand(spec_of):
    """h = 7168: 7168 FP8 bytes and 7168/128 = 56 FP32 scales, 7392 bytes, against 14336 in
    BF16; a width that is no multiple of 128 rounds its last tile up."""
    bf16 = spec_of("deepseek-v3", **H800_RUN)
    fp8 = spec_of("deepseek-v3", **H800_RUN, moe_dispatch_fp8=True)
    assert dispatch_row_bytes(bf16, 2) == 14336
    assert dispatch_row_bytes(fp8, 2) == 7168 + 4 * 56 == 7392
    odd = spec_of("qwen3-30b-a3b", precision="fp8", moe_dispatch_fp8=True, hidden=2100)
    assert dispatch_row_bytes(odd, 2) == 2100 + 4 * 17


def test_fp8_dispatch_leaves_the_combine_in_bf16(spec_of):
    """T·k = 4096·8 rows each way: the dispatch sends 7392 bytes and a 2-byte probability a
    row, the combine 2·7168."""
    fp8 = spec_of("deepseek-v3", **H800_RUN, moe_dispatch_fp8=True)
    shapes = LayerShapes.of(fp8)
    rows = 4096 * 8
    assert dispatch_bytes(fp8, shapes) == rows * (7392 + 2)
    assert combine_bytes(fp8, shapes) == rows * 2 * 7168


def test_node_reach_by_hand():
    """4 experts on 2 nodes, top 2: of the 6 pairs 2 sit on one node, 4 on both, 10/6 nodes a
    token; with 2 groups (= nodes) and 1 chosen, always 1 node."""
    assert node_reach_probability(4, 2, 2) == Fraction(5, 6)
    assert expected_nodes_reached(4, 2, 2) == Fraction(5, 3)
    assert expected_nodes_reached(4, 2, 2, groups=2, group_topk=1) == 1
    assert node_reach_probability(8, 2, 1) == 1  # one node: always reached


def _enumerated_reach(experts, top_k, nodes, groups, group_topk):
    """Probability that node 0 is reached, by enumerating every choice of groups and then of
    experts inside them, each equally likely (the uniform-routing assumption)."""
    per_group, per_node = experts // groups, experts // nodes
    total, hits = Fraction(0), Fraction(0)
    for chosen in itertools.combinations(range(groups), group_topk):
        pool = [e for g in chosen for e in range(g * per_group, (g + 1) * per_group)]
        picks = list(itertools.combinations(pool, top_k))
        for pick in picks:
            weight = Fraction(1, math.comb(groups, group_topk) * len(picks))
            total += weight
            hits += weight if any(e < per_node for e in pick) else 0
    assert total == 1
    return hits


@pytest.mark.parametrize(
    ("experts", "top_k", "nodes", "groups", "group_topk"),
    [(8, 2, 2, 4, 2), (12, 3, 3, 6, 2), (16, 4, 4, 4, 2), (8, 3, 2, 8, 3)],
)
def test_node_reach_against_enumeration(experts, top_k, nodes, groups, group_topk):
    """The hypergeometric sum equals the enumeration of every routing; 8 experts in 4 groups on
    2 nodes, 2 groups of 2 chosen, top 2: 1 - (1/6 + 4/6 · 1/6) = 13/18."""
    expected = _enumerated_reach(experts, top_k, nodes, groups, group_topk)
    assert node_reach_probability(experts, top_k, nodes, groups, group_topk) == expected
    if (experts, top_k, nodes, groups, group_topk) == (8, 2, 2, 4, 2):
        assert expected == Fraction(13, 18)


def test_deepseek_v3_nodes_by_hand():
    """E 256 on 8 nodes, k 8, 8 groups of which 4: half the tokens choose a given node's group,
    and then miss it with C(96,8)/C(128,8); without the limit C(224,8)/C(256,8)."""
    miss_in_pool = Fraction(math.prod(range(89, 97)), math.prod(range(121, 129)))
    reach = node_reach_probability(256, 8, 8, 8, 4)
    assert reach == Fraction(1, 2) * (1 - miss_in_pool)
    assert expected_nodes_reached(256, 8, 8, 8, 4) == 4 * (1 - miss_in_pool)
    assert 3.62 < float(expected_nodes_reached(256, 8, 8, 8, 4)) < 3.63
    unlimited = 1 - Fraction(math.prod(range(217, 225)), math.prod(range(249, 257)))
    assert node_reach_probability(256, 8, 8) == unlimited
    # groups that straddle nodes (8 nodes, 4 groups): the limit is not counted
    assert node_reach_probability(256, 8, 8, 4, 2) == unlimited


def test_flex_all_to_all_by_hand(spec_of):
    """EP 64 on 8 nodes of h800 (network 50e9 · 0.85, NVLink 200e9 · 0.7): per S bytes of
    copies, 7·p/8 · S over the network (p the node reach) and 8 · 7/8 · S/8 over NVLink; the
    alltoall dispatcher sends 56/64 · S over the network."""
    gpu = load_gpu("h800")
    spec = spec_of("deepseek-v3", **H800_RUN, moe_token_dispatcher_type="flex")
    size = 1_000_000
    p = node_reach_probability(256, 8, 8, 8, 4)
    network, link = 50e9 * 0.85, 200e9 * 0.7
    inter = float(7 * p) * size / 8 / network
    intra = 8 * 7 / 8 * size / 8 / link
    assert node_limited_all_to_all_seconds(size, spec, gpu) == pytest.approx(max(inter, intra))
    assert inter > intra  # InfiniBand is the bottleneck, as §3.2.2 designs for
    alltoall = hierarchical_all_to_all_seconds(size, 64, 1, gpu)
    assert alltoall == pytest.approx(56 / 64 * size / network)


def test_dispatchers_agree_inside_one_node(spec_of):
    """ep 8 within a node: no network; every copy not for the rank itself crosses NVLink,
    7/8 of them by either dispatcher."""
    gpu = load_gpu("h800")
    alltoall = spec_of("qwen3-30b-a3b", ep=8, dp=8)
    flex = alltoall.replace(moe_token_dispatcher_type="flex")
    assert expert_parallel_comm(flex, gpu).dispatch == pytest.approx(
        expert_parallel_comm(alltoall, gpu).dispatch
    )


def test_routing_groups_alone_leave_alltoall_time(spec_of):
    """The alltoall dispatcher sends every copy: group-limited routing does not change its
    bytes (the deepseek-v3 preset's groups, h100 run layout)."""
    gpu = load_gpu("h800")
    grouped = spec_of("deepseek-v3", **H800_RUN)
    ungrouped = grouped.replace(moe_router_num_groups=0, moe_router_group_topk=0)
    assert expert_parallel_comm(grouped, gpu) == expert_parallel_comm(ungrouped, gpu)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"moe_router_num_groups": 8}, "go together"),
        ({"moe_router_num_groups": 7, "moe_router_group_topk": 4}, "must divide experts"),
        ({"moe_router_num_groups": 8, "moe_router_group_topk": 9}, "at most"),
        ({"moe_router_num_groups": 128, "moe_router_group_topk": 2}, "fewer than top_k"),
        ({"moe_dispatch_fp8": True, "precision": "bf16"}, "needs precision fp8"),
    ],
)
def test_bad_routing_and_dispatch_keys(spec_of, changes, message):
    base = {"moe_router_num_groups": 0, "moe_router_group_topk": 0, "precision": "fp8"}
    with pytest.raises(SpecError, match=message):
        spec_of("deepseek-v3", **{**base, **changes})


def test_dense_model_refuses_the_moe_dispatch_keys(spec_of):
    for changes in (
        {"moe_router_num_groups": 2, "moe_router_group_topk": 1},
        {"moe_token_dispatcher_type": "flex"},
        {"moe_dispatch_fp8": True, "precision": "fp8"},
    ):
        with pytest.raises(SpecError, match="needs a mixture of experts"):
            spec_of("llama3-8b", **changes)


def test_config_json_routing_groups(tmp_path):
    """DeepSeek-V3's config.json: n_group 8, topk_group 4 (HF deepseek-ai/DeepSeek-V3, the
    preset's); V2-Lite routes greedily (topk_method greedy): no groups; V2's
    group_limited_greedy keeps its groups (n_group 8, topk_group 3)."""
    v3 = load_spec(str(HF_FIXTURES / "DeepSeek-V3" / "config.json"))
    assert (v3.moe_router_num_groups, v3.moe_router_group_topk) == (8, 4)
    lite = load_spec(str(HF_FIXTURES / "DeepSeek-V2-Lite" / "config.json"))
    assert (lite.moe_router_num_groups, lite.moe_router_group_topk) == (0, 0)
    config = json.loads((HF_FIXTURES / "DeepSeek-V2-Lite" / "config.json").read_text())
    config |= {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    grouped = load_spec(str(path))
    assert (grouped.moe_router_num_groups, grouped.moe_router_group_topk) == (8, 3)
