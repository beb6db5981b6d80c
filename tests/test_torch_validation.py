"""ckplan's per-op accounting against PyTorch autograd (validation/torch_saved_bytes.py) and
its backward walk against PyTorch's memory profiler (validation/torch_backward_peak.py).

Skipped (and reported) where torch is not installed, failed under CKPLAN_REQUIRE_TORCH=1 (CI
installs the CPU build and sets it; `make validate` installs it too).
Where the measured code does what ckplan models (1-byte dropout masks, fused norms, GQA-aware
attention, Megatron's fused SwiGLU), every op matches to the byte except the norms' per-token
statistics, which ckplan leaves out on purpose (Korthikanti Table 2 leaves them out too); so
does the peak of one layer's backward.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
from needs_torch import torch_or_skip

torch = torch_or_skip()

SCRIPT = Path(__file__).resolve().parent.parent / "validation" / "torch_saved_bytes.py"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("torch_saved_bytes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _config(harness, name):
    return next(c for c in harness.default_configs() if c.name == name)


@pytest.mark.parametrize(
    "name",
    [
        "gpt-bf16-dropout-native",
        "gpt-bf16-nodrop",
        "gpt-bf16-sdpa",
        "llama-bf16-fused",
        "gpt-fp32-dropout-native",  # precision fp32: 4-byte activations, 1-byte dropout masks
    ],
)
def test_every_op_matches_but_norm_statistics(harness, name):
    config = _config(harness, name)
    measured = harness.measure(config)
    predicted = harness.ckplan_prediction(config)
    tokens = config.seq * config.micro_batch
    # The attention output is one storage saved by SDPA and by out_proj: compare the sum.
    for group in (("attention_core", "out_proj"),):
        got = sum(measured.by_op.get(op, 0) for op in group)
        assert got == sum(predicted.get(op, 0) for op in group)
    for op, value in predicted.items():
        if op in ("norm1", "norm2", "attention_core", "out_proj"):
            continue
        assert measured.by_op.get(op, 0) == value, op
    # LayerNorm keeps mean and rstd per token (activation dtype on CPU, fp32 on CUDA); a fused
    # RMSNorm keeps an fp32 rstd per token.
    stats = 2 * tokens * config.dtype_bytes if config.arch == "gpt" else 4 * tokens
    for op in ("norm1", "norm2"):
        assert measured.by_op[op] - predicted[op] == stats, op


def test_korthikanti_34sbh_5as2b_measured(harness):
    """The paper's layer (bf16, dropout with 1-byte masks, standard attention) measures
    34sbh + 5as²b plus the LayerNorm statistics."""
    config = _config(harness, "gpt-bf16-dropout-native")
    measured = harness.measure(config)
    s, b, h, a = config.seq, config.micro_batch, config.hidden, config.heads
    assert measured.total == 34 * s * b * h + 5 * a * s * s * b + 2 * 2 * s * b * 2


# ---- the backward peak (validation/torch_backward_peak.py) ---------------------------------

BACKWARD_SCRIPT = SCRIPT.parent / "torch_backward_peak.py"


@pytest.fixture(scope="module")
def backward_harness(harness):
    spec = importlib.util.spec_from_file_location("torch_backward_peak", BACKWARD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # imports torch_saved_bytes: the `harness` module above
    return module


def _norm_statistics(config):
    """Bytes of the per-token statistics ckplan leaves out, both norms: LayerNorm's mean and
    rstd (activation dtype on CPU), a fused RMSNorm's fp32 rstd."""
    tokens = config.seq * config.micro_batch
    return 2 * (2 * tokens * config.dtype_bytes if config.arch == "gpt" else 4 * tokens)


SCALARS = 64  # a few 8-byte scalars alive (the 1/√d factor), not activations


@pytest.mark.parametrize(
    "name",
    [
        "gpt-bf16-dropout-native",
        "gpt-bf16-nodrop",
        "gpt-bf16-sdpa",
        "llama-bf16-fused",
        "gpt-bf16-nodrop-s512",
    ],
)
def test_backward_peak_matches_the_walk(backward_harness, name):
    """The measured peak of one layer's forward + backward, against ckplan's walk: the peak is in
    the backward, at the op the walk names, and exceeds the prediction only by what ckplan leaves
    out on purpose. Tolerance: the norms' per-token statistics (at most both norms') + 64 B.
    (The MLP peaks in the s = 128 configs; in gpt-bf16-nodrop-s512, as/h = 16, the softmax's.)"""
    config = next(c for c in backward_harness.default_configs() if c.name == name)
    measured = backward_harness.measure_layer(config)
    predicted = backward_harness.predict_layer(config)
    difference = measured.backward_peak_bytes - predicted["peak_bytes"]
    assert 0 <= difference <= _norm_statistics(config) + SCALARS
    assert predicted["chain_peak_bytes"] == predicted["peak_bytes"]
    assert predicted["peak_bytes"] > predicted["previous_model_bytes"]
    peak_op = max(predicted["walk"], key=lambda p: p["live_bytes"])["op"]
    at_peak = [s.op for s in measured.steps if s.peak_bytes == measured.backward_peak_bytes]
    assert peak_op in at_peak


def test_backward_walk_per_op(backward_harness):
    """Op by op (gpt-bf16-dropout-native): every op the CPU runs as ckplan models it matches
    within the statistics. Not these, each explained in docs/validation.md: the dropouts (the
    CPU's native_dropout_backward also casts the mask to the gradient's dtype), attn_scores
    (eager `* 1/√d` allocates one more (b, a, s, s) gradient), qkv_proj (ckplan's figure is an
    upper bound: the cat frees dQ, dK, dV before the input gradient is allocated)."""
    config = next(
        c for c in backward_harness.default_configs() if c.name == "gpt-bf16-dropout-native"
    )
    measured = backward_harness.measure_layer(config)
    walk = {p["op"]: p["live_bytes"] for p in backward_harness.predict_layer(config)["walk"]}
    by_op = {}
    for step in measured.steps:
        by_op[step.op] = max(by_op.get(step.op, 0), step.peak_bytes)
    stream = config.seq * config.micro_batch * config.hidden * config.dtype_bytes
    scores = config.heads * config.seq * config.seq * config.micro_batch * config.dtype_bytes
    tolerance = _norm_statistics(config) + SCALARS
    for op in ("fc2", "act", "fc1", "norm2", "out_proj", "attn_values", "softmax", "norm1"):
        assert 0 <= by_op[op] - walk[op] <= tolerance, op
    for op, cast in (("mlp_dropout", stream), ("out_dropout", stream), ("attn_dropout", scores)):
        assert 0 <= by_op[op] - walk[op] - cast <= tolerance, op
    assert by_op["qkv_proj"] < walk["qkv_proj"]


def test_output_stage_megatron_cross_entropy(backward_harness):
    """The output stage with Megatron's in-place cross-entropy peaks at tape + B·sbV (the bf16
    copy of the fp32 gradient), as ckplan's output_backward_peak_bytes; measured on top of x and
    the int64 targets, which ckplan does not count (x as the tape's final-norm input it does)."""
    config = next(
        c for c in backward_harness.default_configs() if c.name == "gpt-bf16-dropout-native"
    )
    measured = backward_harness.measure_output(config, "megatron")
    predicted = backward_harness.predict_output(config)
    targets = 8 * config.seq * config.micro_batch
    difference = measured.backward_peak_bytes - targets - predicted["peak_bytes"]
    assert 0 <= difference <= _norm_statistics(config) // 2 + SCALARS  # the final norm's


def test_blas_workspace_is_only_what_the_gemm_calls_free_inside_themselves(backward_harness):
    """The peaks above leave out the CPU GEMM library's own workspace (oneDNN's bf16 scratchpad,
    allocated and freed inside one aten::mm/bmm call; docs/validation.md). Only that: each backward
    GEMM call, run alone on operands of the same dtype, sizes and strides, frees inside itself
    exactly what it does in the layer; only nodes that run a GEMM get a workspace; the peak moves
    by at most the largest call's. Where the probe finds none, nothing moves."""
    config = next(
        c for c in backward_harness.default_configs() if c.name == "gpt-bf16-dropout-native"
    )
    measured = backward_harness.measure_layer(config)
    assert measured.gemm_calls and measured.notes == []
    largest = {}
    for call in measured.gemm_calls:
        assert call.probe_bytes == call.trace_bytes, call
        largest[call.node] = max(largest.get(call.node, 0), call.probe_bytes)
    for step in measured.steps:
        assert step.blas_workspace_bytes <= largest.get(step.node, 0), step
    excluded = measured.raw_backward_peak_bytes - measured.backward_peak_bytes
    assert 0 <= excluded <= max(largest.values())


def test_blas_workspace_replay(backward_harness):
    """The replay leaves out only the events marked as GEMM workspace, and reports them per step:
    baseline 100; a GEMM's output 50, its workspace 30 alive meanwhile, then freed."""
    events = [
        (1, 50, "AddmmBackward0", 7, False),
        (2, 30, "AddmmBackward0", 7, True),
        (3, -30, "AddmmBackward0", 7, True),
        (4, -20, "GeluBackward0", 6, False),
    ]
    forward, backward, raw, end, steps = backward_harness._replay(events, 100, None)
    assert (forward, backward, raw, end) == (100, 150, 180, 130)
    assert [(s.node, s.peak_bytes, s.blas_workspace_bytes) for s in steps] == [
        ("AddmmBackward0", 150, 30),
        ("GeluBackward0", 130, 0),
    ]


# ---- MoE and MLA (validation/torch_moe_mla.py) ----------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "moe-bf16",
        "mla-bf16",
        "moe-bf16-torchtitan",
        "mla-bf16-torchtitan",
        "moe-bf16-hf",
        "mla-bf16-hf",
    ],
)
def test_moe_and_mla_layers_match_op_by_op(harness, name):
    """A Megatron-Core MoE layer and a DeepSeek-V3-style MLA layer, and the same with
    torchtitan's and Hugging Face's experts' combine and MLA views: every op as predicted but
    the fused RMSNorms' fp32 rstd (4 bytes per token, the latent norms included), the router's
    int64 tokens-per-expert (8·E) and scalar aux loss (4 bytes) that its aux loss keeps, and the
    attention output, one storage saved by the core and by out_proj (compared as a sum)."""
    config = _config(harness, name)
    measured = harness.measure(config)
    predicted = harness.ckplan_prediction(config)
    tokens = config.seq * config.micro_batch
    pair = ("attention_core", "out_proj")
    assert sum(measured.by_op.get(op, 0) for op in pair) == sum(predicted[op] for op in pair)
    norms = {"norm1", "norm2", "q_norm", "kv_norm"}
    for op, value in predicted.items():
        if op in pair:
            continue
        extra = 4 * tokens if op in norms else 0
        if op == "router_probs":
            extra = 8 * config.experts + 4
        assert measured.by_op.get(op, 0) - value == extra, op
    assert set(measured.by_op) <= set(predicted)


def test_mlp_module_recompute_saves_what_ckplan_predicts(harness, monkeypatch):
    """The dense MLP under torch.utils.checkpoint (reentrant: it saves its input, norm2's
    output, and nothing inside) drops exactly what ckplan's `mlp` module drops: the MLP ops'
    saved tensors less the kept input."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from ckplan.calibrate import layers as torch_layers
    from ckplan.inputs.presets import spec_from_values
    from ckplan.model.op import DENSE_MLP, in_group
    from ckplan.model.ops import group_input_bytes, layer_ops

    config = _config(harness, "llama-bf16-fused")
    plain = harness.measure(config).total

    swiglu = torch_layers.FusedSwiGLU

    class Identity:
        @staticmethod
        def apply(y):
            return y

    def checkpointed(cfg):
        layer = torch_layers.LlamaLayer(cfg)
        fc1, down = layer.fc1, layer.down_proj

        def mlp(y):
            return down(swiglu.apply(fc1(y)))

        class Checkpointed(nn.Module):
            def forward(self, y):
                return checkpoint(mlp, y, use_reentrant=True)

        layer.fc1, layer.down_proj = Checkpointed(), nn.Identity()
        layer.register_module("mlp_weights", nn.ModuleList([fc1, down]))  # parameters excluded
        return layer

    monkeypatch.setattr(torch_layers, "FusedSwiGLU", Identity)
    monkeypatch.setattr(harness, "LlamaLayer", checkpointed)
    recomputed = harness.measure(config).total

    spec = spec_from_values(harness.ckplan_mapping(config))
    members = [op for op in layer_ops(spec) if in_group(op, DENSE_MLP)]
    dropped = sum(op.saved_bytes for op in members) - group_input_bytes(spec.chain, DENSE_MLP)
    assert plain - recomputed == dropped > 0


def test_chunked_output_loss_matches_ckplan():
    """torchtune's chunked output and compiled per-chunk cross-entropy hold what
    `chunked-output:N` says, forward, through the loss's backward and while the output
    weight's gradients are summed (validation/torch_chunked_output_loss.py), each within the
    chunks' input gradients and per-token statistics."""
    path = SCRIPT.parent / "torch_chunked_output_loss.py"
    spec = importlib.util.spec_from_file_location("torch_chunked_output_loss", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for trains in (True, False):
        row = module.measure(512, 384, 4096, 4, trains=trains)
        for name in ("forward", "loss_backward", "weight_sum"):
            measured, predicted = row[f"{name}_peak_bytes"], row[f"ckplan_{name}_bytes"]
            assert abs(measured - predicted) <= row["slack_bytes"], (name, trains, row)


def _torchao_step_script():
    path = SCRIPT.parent / "torchao_8bit_step_transient.py"
    spec = importlib.util.spec_from_file_location("torchao_8bit_step_transient", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchao_8bit_step_transient_on_the_cpu():
    """One compiled step of torchao's AdamW8bit over a bf16 parameter allocates, on the CPU,
    its two block-scaled fp32 moments and their new scales beyond the parameter, gradient and
    states: PyTorch's memory profiler against the closed form, to the byte, for two sizes (so
    the form's slope and intercept both hold; validation/torchao_8bit_step_transient.py).
    Skipped without torchao, which ckplan does not depend on."""
    pytest.importorskip("torchao.prototype.low_bit_optim")
    module = _torchao_step_script()
    for rows in (512, 1024):
        numel = rows * 768
        measured = module.measure_executed(rows, 768)
        assert measured == module.cpp_step_transient_bytes(numel) > 8 * numel


def test_torchao_8bit_step_transient_in_triton_code():
    """The same step as Inductor writes it for Triton, the GPU's code, keeps the scaled moments
    in registers: the wrapper allocates the two moments' new uint8 codes and their new scales,
    2 bytes a value and 8 a block (validation/torchao_8bit_step_transient.py). Skipped without
    torchao or triton."""
    pytest.importorskip("torchao.prototype.low_bit_optim")
    pytest.importorskip("triton")
    module = _torchao_step_script()
    numel = 512 * 768
    peak, _ = module.triton_wrapper_peaks(512, 768)
    assert peak == module.triton_step_transient_bytes(numel) == 2 * numel + 8 * numel // 256


def test_wrapper_peak_counts_allocations_and_frees_in_order():
    """The wrapper reader used for the Triton code: live buffers summed line by line, a `del`
    freeing every name it lists."""
    module = _torchao_step_script()
    source = (
        "def call(self, args):\n"
        "    buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)\n"
        "    buf1 = empty_strided_cuda((16, ), (1, ), torch.uint8)\n"
        "    del buf0\n"
        "    buf2 = empty_strided_cuda((10, ), (1, ), torch.bfloat16)\n"
        "    del buf1, buf2\n"
    )
    assert module.wrapper_peak_bytes(source) == 4 * 8 * 4 + 16


def test_wrapper_autotune_peak_clones_each_stored_argument():
    """At a Triton kernel's first launch the autotuner clones every argument the kernel stores
    into, one clone per argument even where one tensor is passed twice (torch 2.5.1
    `CachingAutotuner.clone_args`), on top of the wrapper's live buffers."""
    module = _torchao_step_script()
    source = (
        "k0 = async_compile.triton('triton_', '''\n"
        "@triton_heuristics.reduction(\n"
        "    inductor_meta={'mutated_arg_names': ['in_ptr1', 'out_ptr0']},\n"
        ")\n"
        "@triton.jit\n"
        "def triton_(in_ptr0, in_ptr1, out_ptr0, out_ptr1, xnumel, XBLOCK : tl.constexpr):\n"
        "    pass\n"
        "''', device_str='cuda')\n"
        "def call(args):\n"
        "    buf0 = empty_strided_cuda((100, ), (1, ), torch.float32)\n"
        "    k0.run(arg0_1, arg1_1, arg1_1, buf0, 100, grid=grid(100), stream=stream0)\n"
        "    del buf0\n"
        "def benchmark_compiled_module(times=10, repeat=10):\n"
        "    arg0_1 = rand_strided((100, ), (1, ), device='cuda', dtype=torch.bfloat16)\n"
        "    arg1_1 = rand_strided((100, ), (1, ), device='cuda', dtype=torch.uint8)\n"
    )
    assert module.wrapper_peak_bytes(source) == 400
    assert module.wrapper_autotune_peak_bytes(source) == 400 + 2 * 100
