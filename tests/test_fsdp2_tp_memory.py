"""torchtitan's 2-D step (FSDP2 x tensor parallel, sequence parallel, loss parallel) by hand,
against what PyTorch's FSDPMemTracker measured of torchtitan's Llama 3 at the 70B shapes on
32 x 8 fake ranks (validation/torch_fsdp2_tp_memory.py;
validation/results-fsdp2-tp-memory-torch-2.13.0.json), and against a rerun of the same
measurement at a small shape where torch, torchtitan and transformers install.

Llama 3 70B, FSDP 32 x TP 8, local batch 16 at 8192 tokens (Table 4 of torchtitan's December
2024 benchmark): T = 131,072 tokens, T_r = T/8 = 16,384 of them on a rank under sequence
parallelism; the residual stream X = 2·16,384·8192 = 268,435,456 bytes; the logits on a rank
L = 131,072·128,256/8 = 2,101,346,304.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from needs_frameworks import framework_or_skip
from needs_torch import torch_or_skip

from ckplan.inputs.presets import load_mapping, spec_from_values
from ckplan.model import loss, memory
from ckplan.model.op import LayerShapes, column_parallel_saved_input_bytes
from ckplan.model.ops import layer_ops
from ckplan.plan import evaluate, parse_strategy
from ckplan.published.predict import run_spec
from ckplan.published.suite import suite_runs

ROOT = Path(__file__).resolve().parent.parent
RESULTS = json.loads(
    (ROOT / "validation" / "results-fsdp2-tp-memory-torch-2.13.0.json").read_text()
)
CASES = {case["layers"]: case for case in RESULTS["cases"]}
RUN = "torchtitan-202412-llama3-70b-256gpu-fsdp32-tp8"
X, L, RANK_TOKENS = 268_435_456, 2_101_346_304, 16_384


def _run_spec(**changes):
    (run,) = [r for r in suite_runs() if r.name == RUN]
    spec = run_spec(run)
    return spec.replace(**changes) if changes else spec


def test_final_norm_by_hand():
    spec = _run_spec()
    assert loss.stream_bytes(spec.chain) == X
    assert loss.logits_elements(spec.chain) == L
    # torchtitan 9dec370's eager RMSNorm: fp32 input 4·n, fp32 rstd 4·T_r, bf16 product 2·n
    assert loss.final_norm_saved_bytes(spec.chain) == 3 * X + 4 * RANK_TOKENS == 805_371_904
    # frozen weight: no product saved
    frozen = spec.chain.replace(training="lora")
    assert loss.final_norm_saved_bytes(frozen) == 2 * X + 4 * RANK_TOKENS
    # torchtitan 0.3 (nn.RMSNorm) and the other frameworks: the input, X
    assert loss.final_norm_saved_bytes(spec.chain.replace(framework_version="0.3")) == X
    assert loss.final_norm_saved_bytes(spec.chain.replace(framework="hf")) == X


def test_output_stage_tape_by_hand():
    # the final norm's 3X + 4·T_r, the output layer's all-gathered input t·X, and the fp32
    # log-probabilities 4L
    spec = _run_spec()
    assert loss.output_saved_bytes(spec.chain) == 3 * X + 4 * RANK_TOKENS + 8 * X + 4 * L
    # the loss-parallel backward: 12L beside that tape
    assert loss.output_backward_peak_bytes(spec.chain) - loss.output_saved_bytes(spec.chain) == (
        12 * L
    )


def test_without_sequence_parallelism_the_norm_sees_every_token():
    base, origin = load_mapping("llama3-8b")
    values = {
        **base,
        "framework": "torchtitan",
        "framework_version": "2024.12",
        "zero": 3,
        "dp": 8,
        "seq": 8192,
        "micro_batch": 2,
    }
    spec = spec_from_values(values, origin)
    stream = 2 * 16_384 * 4096
    assert loss.final_norm_saved_bytes(spec.chain) == 3 * stream + 4 * 16_384


def test_measured_peak_is_the_loss_backward():
    for case in RESULTS["cases"]:
        assert case["peak_phase"] == "loss_backward"
        assert (case["dp_shard"], case["tp"], case["ac"]) == (32, 8, "full")


def test_per_block_term_is_the_checkpointed_input():
    """Two and three blocks: at the loss's backward a block adds only its checkpointed input,
    the sequence shard of the residual stream (`memory.layer_input_bytes`)."""
    spec = _run_spec()
    two, three = (CASES[n]["phases"]["loss_backward"] for n in (2, 3))
    assert three["Activation"] - two["Activation"] == memory.layer_input_bytes(spec) == X
    assert three["Temp"] == two["Temp"]


def test_recorded_measurement_term_by_term():
    """The 80-block step against ckplan's plan of the published run, term by term at the peak
    (the loss's backward)."""
    spec = _run_spec()
    plan = evaluate(spec, parse_strategy("full", spec))
    states = plan.model_states
    peak = CASES[80]["phases"]["loss_backward"]
    assert peak["Sharded Param"] == states.weights
    # AdamW's moments and a 4-byte step per parameter tensor: 9 a block (separate wq, wk, wv),
    # the embedding, final norm and output
    assert peak["OptState"] - 4 * (80 * 9 + 3) == states.optimizer
    # the kept unsharded copies: the root module and the last block, bf16, /t
    assert peak["Unsharded Param"] == states.buffers
    assert peak["All Gather"] == peak["Reduce Scatter"] == peak["Sharded Grad"] == 0
    # what autograd keeps: 80 checkpointed inputs, the output stage's tape; beyond them the
    # measurement holds the positions (int64 per token, 1 MiB; ckplan counts the embedding's
    # token ids instead) and scalars
    tape = 80 * X + loss.output_saved_bytes(spec.chain)
    positions = 8 * 131_072
    assert 0 <= peak["Activation"] - tape - positions < 64
    # the loss parallel's backward: 12L, and its per-token index and mask tensors (33 bytes a
    # token, which ckplan leaves out)
    assert peak["Temp"] - 12 * L == 33 * 131_072
    # the whole allocated peak: ckplan's, less the output layer's sharded gradients it counts
    # at the peak (written only after the loss's backward), to 0.01 %
    measured = peak["Total"] - peak["Buffer"] - peak["Inputs"]
    assert abs(measured - (plan.total_bytes - states.gradients)) < 1e-4 * measured


def test_final_norm_closes_the_gap_to_the_measurement():
    """Before the eager final norm, ckplan's activations were 2X + 4·T_r under the measured."""
    spec = _run_spec()
    plan = evaluate(spec, parse_strategy("full", spec))
    extra = loss.final_norm_saved_bytes(spec.chain) - loss.stream_bytes(spec.chain)
    assert extra == 2 * X + 4 * RANK_TOKENS == 536_936_448
    peak = CASES[80]["phases"]["loss_backward"]
    activations = peak["Activation"] + peak["Temp"]
    assert 0 < activations - plan.activation_bytes < 5 * 2**20


SMALL = {"dim": 256, "heads": 4, "kv_heads": 2, "ffn": 768, "layers": 2, "vocab": 8192}


@pytest.mark.parametrize("layers", [2])
def test_rerun_at_a_small_shape(layers):
    """The measurement itself on 2 x 2 fake ranks at a small shape: the peak in the loss's
    backward, the final norm's eager fp32 copies, the all-gathered output-layer input, the
    log-probabilities and the loss parallel's 12L, by hand."""
    torch_or_skip()
    framework_or_skip("torchtitan", "the 2-D step was not remeasured")
    framework_or_skip("transformers", "the 2-D step was not remeasured")
    harness = _harness()
    batch, seq = 2, 128
    case = {"layers": layers, "micro_batch": batch, "seq": seq}
    result = harness.measure(case, SMALL, dp_shard=2, tp=2)
    assert result["peak_phase"] == "loss_backward"
    peak = result["phases"]["loss_backward"]
    tokens = batch * seq
    stream = 2 * tokens * 256 // 2  # bf16, the sequence shard
    logits = tokens * 8192 // 2
    norm = 4 * (stream // 2) + stream + 4 * tokens // 2
    tape = layers * stream + norm + 2 * stream + 4 * logits
    positions = 8 * tokens
    assert 0 <= peak["Activation"] - tape - positions < 64
    assert peak["Temp"] - 12 * logits == 33 * tokens


def test_column_parallel_saved_input_by_hand():
    """torchtitan's sequence-parallel blocks save the all-gathered sequence before the QKV
    projection and fc1: in bf16 t·X = 2,147,483,648 bytes at the 70B run's shapes, in
    December 2024's float8 (the run's precision) one byte an element, 1,073,741,824;
    Megatron-LM's the shard, X; torchtitan's without sequence parallelism the replicated
    stream it already holds."""
    spec = _run_spec()
    assert spec.precision == "float8"
    gathered = 131_072 * 8192
    bf16 = spec.replace(precision="bf16")
    for each, saved in ((spec, gathered), (bf16, 2 * gathered)):
        by_name = {op.name: op.saved_bytes for op in layer_ops(each.chain)}
        assert by_name["qkv_proj"] == by_name["fc1"] == saved
        shapes = LayerShapes.of(each.chain)
        assert column_parallel_saved_input_bytes(each.chain, shapes) == saved
    # torchtitan 0.3's float8 is taken to keep bf16 inputs, as ckplan's float8 elsewhere
    newer = spec.chain.replace(framework_version="0.3")
    assert column_parallel_saved_input_bytes(newer, LayerShapes.of(newer)) == 2 * gathered
    megatron = bf16.chain.replace(framework="megatron", framework_version=None)
    by_name = {op.name: op.saved_bytes for op in layer_ops(megatron)}
    assert by_name["qkv_proj"] == by_name["fc1"] == X
    no_sp = bf16.chain.replace(sp=False)
    assert column_parallel_saved_input_bytes(no_sp, LayerShapes.of(no_sp)) == 2 * gathered
    # Megatron-like fused kernels under torchtitan's state layout (a private stack, as the
    # Llama 3 paper's runs are described) save the shard, as Megatron-LM does
    fused = bf16.chain.replace(kernels="fused")
    assert column_parallel_saved_input_bytes(fused, LayerShapes.of(fused)) == X


def test_full_recomputation_adds_the_gathered_inputs_in_the_recomputed_block():
    """Under full recomputation the stored tape is the layer inputs, as before; the recomputed
    block holds the two gathered inputs: in bf16 2·(t - 1)·X beyond Megatron's shards, in
    December 2024's float8 2·(t/2 - 1)·X. Besides, December 2024's attention kernel saves K and
    V repeated to the rank's 8 query heads from its 1 K/V head (ckplan.model.repeat_kv):
    2·2·(s·b)·(8 - 1)·128 bytes more."""
    spec = _run_spec()
    assert memory.layer_input_bytes(spec) == X
    repeated = 2 * 2 * (8192 * 16) * (8 - 1) * 128
    for each, extra in ((spec, 2 * 3 * X), (spec.replace(precision="bf16"), 2 * 7 * X)):
        megatron = each.replace(framework="megatron", framework_version=None)
        torchtitan_layer = sum(op.saved_bytes for op in layer_ops(each.chain))
        megatron_layer = sum(op.saved_bytes for op in layer_ops(megatron.chain))
        assert torchtitan_layer - megatron_layer == extra + repeated


def test_blocks_save_the_gathered_sequence_on_fake_ranks():
    """The measurement's model without recomputation, at a small shape on 2 x 2 fake ranks:
    autograd saves two storages of the whole sequence (b, s, h) per block, the attention's and
    the MLP's gathered inputs, and one more for the output layer."""
    torch = torch_or_skip()
    framework_or_skip("torchtitan", "the gathered inputs were not remeasured")
    framework_or_skip("transformers", "the gathered inputs were not remeasured")
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    harness = _harness()
    batch, seq, layers = 2, 96, 3  # b·s = 192: no weight has a dimension of that size
    shape = {**SMALL, "layers": layers, "seq": seq}
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    whole = set()

    def pack(tensor):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        # F.linear on a DTensor saves the (b·s, h) view of the gathered (b, s, h) tensor
        if tuple(local.shape) in ((batch * seq, 256), (batch, seq, 256)):
            whole.add(local.untyped_storage()._cdata)
        return tensor

    try:
        with harness.fake_dtensor_workarounds(FakeTensorMode()):
            model = harness.build(torch, shape, mesh, ac="none")
            tokens = torch.randint(0, SMALL["vocab"], (batch, seq))
            positions = torch.arange(seq).repeat(batch, 1)
            with loss_parallel(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(tokens, positions)
    finally:
        dist.destroy_process_group()
    assert len(whole) == 2 * layers + 1


def _harness():
    path = ROOT / "validation" / "torch_fsdp2_tp_memory.py"
    module_spec = importlib.util.spec_from_file_location("torch_fsdp2_tp_memory", path)
    harness = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = harness
    module_spec.loader.exec_module(harness)
    return harness
