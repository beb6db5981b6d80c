"""Activation and model-state bytes against hand-computed values from the papers."""

import importlib.util
from pathlib import Path

import pytest

from ckplan.model import allocator
from ckplan.model.loss import (
    loss_moved_bytes,
    output_backward_peak_bytes,
    output_forward_workspace_bytes,
    output_saved_bytes,
)
from ckplan.model.memory import (
    activation_breakdown,
    activation_bytes_by_op,
    activation_bytes_per_layer,
    layer_input_bytes,
    model_state_bytes,
    parameter_count,
    parameters_per_gpu,
    selective_activation_bytes_per_layer,
)
from ckplan.model.op import ATTENTION_CORE
from ckplan.model.spec import SpecError

KORTHIKANTI_PRESETS = ["megatron-22b", "megatron-175b", "megatron-530b", "megatron-1t"]


def _sbh_as2b(spec):
    s, b, h, a = spec.seq, spec.micro_batch, spec.hidden, spec.heads
    return s * b * h, a * s * s * b


@pytest.mark.parametrize("name", KORTHIKANTI_PRESETS)
def test_korthikanti_table2_single_gpu(spec_of, name):
    """Table 2 (B = 2, F = 4h, dropout, standard attention), t = 1: 34sbh + 5as²b;
    selective 34sbh; full recompute 2sbh; breakdown of §4.1: attention 11sbh + 5as²b, MLP 19sbh,
    norms 4sbh."""
    spec = spec_of(name, tp=1, sp=False, pp=1)
    sbh, as2b = _sbh_as2b(spec)
    assert activation_bytes_per_layer(spec) == 34 * sbh + 5 * as2b
    assert selective_activation_bytes_per_layer(spec, ATTENTION_CORE) == 34 * sbh
    assert layer_input_bytes(spec) == 2 * sbh
    assert activation_breakdown(spec) == {
        "attention": 11 * sbh + 5 * as2b,
        "mlp": 19 * sbh,
        "norm": 4 * sbh,
    }


@pytest.mark.parametrize("name", KORTHIKANTI_PRESETS)
def test_korthikanti_table2_tensor_and_sequence_parallel(spec_of, name):
    """Table 2's parallel rows with the paper's t = 8, per GPU:
    TP sbh(10 + 24/t + 5as/ht); TP+SP sbh(34/t + 5as/ht); TP+selective sbh(10 + 24/t);
    TP+SP+selective 34sbh/t; full recompute with SP 2sbh/t."""
    tp_only = spec_of(name, sp=False, pp=1)
    t = tp_only.tp
    assert t == 8
    sbh, as2b = _sbh_as2b(tp_only)
    assert activation_bytes_per_layer(tp_only) == 10 * sbh + 24 * sbh // t + 5 * as2b // t
    assert selective_activation_bytes_per_layer(tp_only, ATTENTION_CORE) == 10 * sbh + 24 * sbh // t
    with_sp = spec_of(name, sp=True, pp=1)
    assert activation_bytes_per_layer(with_sp) == 34 * sbh // t + 5 * as2b // t
    assert selective_activation_bytes_per_layer(with_sp, ATTENTION_CORE) == 34 * sbh // t
    assert layer_input_bytes(with_sp) == 2 * sbh // t


def test_dropout_off_removes_masks_and_dropout_output(spec_of):
    spec = spec_of("megatron-22b", tp=1, sp=False, pp=1, dropout=0.0)
    sbh, as2b = _sbh_as2b(spec)
    # 34sbh + 5as²b less the two sbh masks, the as²b mask and the 2as²b dropout output.
    assert activation_bytes_per_layer(spec) == 32 * sbh + 2 * as2b
    assert "attn_dropout" not in activation_bytes_by_op(spec)


def test_flash_attention_gqa_swiglu(spec_of):
    """Derived for Llama-3-8B (B = 2, a = 32, g = 8, d = 128, F = 14336, fused SwiGLU):
    norms 2·2sbh; QKV input 2sbh; flash saves Q (2sbh), K and V at g·d = h/4 (2·2·sbh/4), fp32
    logsumexp 4·a·s·b; out-proj input 2sbh; fc1 input 2sbh; fc1 output 2·2·sbF; fc2 input 2sbF."""
    spec = spec_of("llama3-8b")
    s, b, h, a, F = spec.seq, spec.micro_batch, spec.hidden, spec.heads, spec.ffn_hidden
    sbh = s * b * h
    by_op = activation_bytes_by_op(spec)
    assert by_op["attention_core"] == 2 * sbh + 2 * 2 * sbh // 4 + 4 * a * s * b
    assert by_op["act"] == 2 * 2 * s * b * F
    expected = (
        4 * sbh
        + 2 * sbh
        + by_op["attention_core"]
        + 2 * sbh
        + 2 * sbh
        + 4 * s * b * F
        + 2 * s * b * F
    )
    assert activation_bytes_per_layer(spec) == expected
    eager = spec_of("llama3-8b", fused_swiglu=False)
    assert activation_bytes_per_layer(eager) - activation_bytes_per_layer(spec) == 2 * s * b * F


def test_standard_attention_with_gqa_saves_repeated_kv(spec_of):
    """K and V repeated to a heads before the matmuls (Megatron repeat_interleave, HF repeat_kv)
    are what autograd saves; selective keeps the g·d-wide K, V as the core's input."""
    spec = spec_of("llama3-8b", attention="standard", seq=1024)
    s, b, h = spec.seq, spec.micro_batch, spec.hidden
    sbh = s * b * h
    by_op = activation_bytes_by_op(spec)
    assert by_op["attn_scores"] == 2 * 2 * sbh and by_op["attn_values"] == 2 * sbh
    assert selective_activation_bytes_per_layer(spec, ATTENTION_CORE) == (
        activation_bytes_per_layer(spec)
        - (4 * sbh + 2 * spec.heads * s * s * b + 2 * sbh)
        + 2 * (sbh + 2 * sbh // 4)
    )


def test_output_layer_fp32_logits(spec_of):
    """Korthikanti §4.3: final norm and output-layer inputs 4sbh/t, fp32 logits 4sbV/t (SP on)."""
    spec = spec_of("megatron-22b", pp=1)
    s, b, h, V, t = spec.seq, spec.micro_batch, spec.hidden, spec.vocab, spec.tp
    assert output_saved_bytes(spec) == 4 * s * b * h // t + 4 * s * b * V // t


def test_xentropy_loss_saves_the_bf16_logits_and_the_fp32_lse(spec_of):
    """flash-attn's CrossEntropyLoss (v2.5.0): saves (logits, lse, labels), returns fp32 losses
    and z-losses, backward allocates the logits' gradient with empty_like."""
    spec = spec_of("gpt2", seq=1024, micro_batch=2, loss="xentropy")
    s, b, h, V = spec.seq, spec.micro_batch, spec.hidden, spec.vocab
    T, X, L = s * b, 2 * s * b * h, s * b * V
    saved = 2 * X + 2 * L + 4 * T
    assert output_saved_bytes(spec) == saved == 4 * s * b * h + 2 * 2048 * 50257 + 4 * 2048
    assert output_forward_workspace_bytes(spec) == saved - X + 8 * T
    assert output_backward_peak_bytes(spec) == saved + 2 * L
    assert loss_moved_bytes(spec) == (2 * L, 4 * L)
    # Megatron's fused loss saves the fp32 softmax instead: 2L more
    assert output_saved_bytes(spec.replace(loss="fused")) - saved == 2 * L - 4 * T


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("gpt2", 124_439_808),  # HF gpt2 num_parameters()
        ("llama3-8b", 8_030_261_248),  # HF Meta-Llama-3-8B
        ("llama2-7b", 6_738_415_616),  # HF Llama-2-7b-hf
        ("mistral-7b", 7_241_732_096),  # HF Mistral-7B-v0.1
        ("llama3-70b", 70_553_706_496),  # HF Meta-Llama-3-70B
    ],
)
def test_parameter_counts_match_published(spec_of, name, params):
    assert parameter_count(spec_of(name)).total == params


def test_model_states_18_bytes_per_param_and_zero(spec_of):
    spec = spec_of("llama3-8b")
    params = parameter_count(spec).total
    assert model_state_bytes(spec).total == 18 * params
    dp = 8
    zero1 = model_state_bytes(spec_of("llama3-8b", dp=dp, zero=1))
    assert (zero1.weights, zero1.gradients, zero1.optimizer) == (
        2 * params,
        4 * params,
        12 * params // dp,
    )
    zero3 = model_state_bytes(spec_of("llama3-8b", dp=dp, zero=3))
    assert zero3.total == (2 + 4 + 12) * params // dp


def test_parameters_per_gpu_split_by_tp_and_pp(spec_of):
    spec = spec_of("megatron-175b")
    whole = parameter_count(spec)
    per_gpu = parameters_per_gpu(spec)
    # about 1/(t·p) of the model, plus the vocab-parallel embedding share on the first stage
    assert whole.total / (8 * 8) < per_gpu < 1.2 * whole.total / (8 * 8)


def test_tp_beyond_kv_heads_replicates_one_kv_head(spec_of):
    """Megatron replicates query groups when tp > g: each rank keeps one K and one V head."""
    spec = spec_of("llama3-8b", tp=16, sp=True)
    s, b, h, d = spec.seq, spec.micro_batch, spec.hidden, spec.head_dim
    logsumexp = 4 * s * b * spec.heads // 16
    assert (
        activation_bytes_by_op(spec)["attention_core"] == 2 * s * b * (h // 16 + 2 * d) + logsumexp
    )
    tp4 = spec_of("llama3-8b", tp=4)
    assert (
        activation_bytes_by_op(tp4)["attention_core"]
        == 2 * s * b * (h // 4 + 2 * 2 * d) + 4 * s * b * 8
    )


def test_tp_and_kv_heads_must_divide_one_another(spec_of):
    with pytest.raises(SpecError, match="must divide one another"):
        spec_of("gpt2", kv_heads=4, tp=6)


def test_the_loss_per_term_in_estimate_json(cli):
    """estimate --json names the loss and what it holds; a chunked loss saves no logits."""
    import json

    terms = {}
    for kind in ("fused", "eager", "compiled", "chunked:8"):
        code, out, _ = cli("estimate", "llama3-8b", "--set", f"loss={kind}", "--json")
        assert code == 0
        terms[kind] = json.loads(out)["memory"]["loss"]
        assert terms[kind]["kind"] == kind
    assert terms["fused"]["saved_bytes"] == terms["eager"]["saved_bytes"]
    assert terms["eager"]["backward_peak_bytes"] > terms["fused"]["backward_peak_bytes"]
    assert terms["chunked:8"]["saved_bytes"] < terms["fused"]["saved_bytes"] // 10
    # compiled: bf16 logits where eager keeps fp32 log-probabilities
    assert terms["compiled"]["saved_bytes"] < terms["eager"]["saved_bytes"]
    assert terms["compiled"]["backward_peak_bytes"] < terms["fused"]["backward_peak_bytes"]


def _fit_allocator():
    path = Path(__file__).resolve().parents[1] / "validation" / "fit_allocator.py"
    spec = importlib.util.spec_from_file_location("fit_allocator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_allocator_slack_is_the_fit_on_the_gpu_measurements():
    """The constants are validation/fit_allocator.py's medians of the committed H200 runs."""
    fit = _fit_allocator()
    assert fit.fitted_slack(expandable_segments=False) == allocator.ALLOCATOR_SLACK
    assert fit.fitted_slack(expandable_segments=True) == allocator.EXPANDABLE_SLACK
    # by hand: the default allocator's six plans, sorted; the median is the mean of the middle two
    slacks = sorted(fit.measured_slacks(fit.MEASUREMENTS[False]).values())
    assert len(slacks) == 6 and round((slacks[2] + slacks[3]) / 2, 4) == allocator.ALLOCATOR_SLACK


@pytest.mark.parametrize("expandable", [False, True])
def test_reserved_bytes_add_the_slack_in_2_mib_blocks(expandable):
    gib = 2**30
    reserved = allocator.reserved_bytes(10 * gib, expandable)
    slack = allocator.slack(expandable)
    assert reserved % allocator.ROUND_LARGE == 0
    assert 10 * gib * (1 + slack) <= reserved < 10 * gib * (1 + slack) + allocator.ROUND_LARGE


def test_the_budget_takes_the_allocated_blocks_and_the_cache_gives_way():
    """Under pressure the allocator releases its cache: the budget holds the allocated peak's
    2 MiB blocks, and the reserved peak shrinks to what is available, never below them."""
    mib = 2**20
    assert allocator.budgeted_bytes(0) == 0
    assert allocator.budgeted_bytes(1) == 2 * mib
    assert allocator.budgeted_bytes(4 * mib) == 4 * mib
    assert allocator.budgeted_bytes(4 * mib + 1) == 6 * mib
    assert allocator.allocatable_bytes(7 * mib) == 6 * mib
    for allocated in (1, 6 * mib, 6 * mib + 1, 10 * 2**30):
        assert allocator.budgeted_bytes(allocator.allocatable_bytes(allocated)) <= allocated
    allocated = 10 * 2**30
    plenty = allocator.reserved_bytes(allocated)
    assert allocator.reserved_within(allocated, 100 * 2**30) == plenty
    assert allocator.reserved_within(allocated, allocated + 100 * mib) == allocated + 100 * mib
    assert allocator.reserved_within(allocated, allocated // 2) == allocated


def test_compiled_loss_by_hand(spec_of):
    """torch.compile's cross-entropy on upcast logits keeps the bf16 logits and two fp32
    statistics per token (validation/torch_float8_sac.py) and writes a bf16 gradient."""
    from ckplan.model.loss import loss_moved_bytes, output_backward_peak_bytes

    spec = spec_of("llama3-8b", seq=8192, micro_batch=1, loss="compiled")
    T, V, h = 8192, 128256, 4096
    X, L = 2 * T * h, T * V
    assert output_saved_bytes(spec) == 2 * X + 2 * L + 8 * T == 2_235_629_568
    assert output_backward_peak_bytes(spec) == 2 * X + 4 * L + 8 * T == 4_336_975_872
    eager = spec_of("llama3-8b", seq=8192, micro_batch=1, loss="eager")
    # eager holds the fp32 log-probabilities and, in backward, two fp32 gradients: 12L
    assert output_backward_peak_bytes(eager) - output_backward_peak_bytes(spec) == 8 * L - 8 * T
    assert loss_moved_bytes(spec) == (4 * L, 4 * L)


def test_chunked_output_loss_by_hand(spec_of):
    """torchtune's CEWithChunkedOutputLoss under compile (`chunked-output:N`): the compiled
    loss's tape; in backward one chunk's gradient beyond it, or, when the output layer trains,
    two more weight-sized gradients less two chunks' (validation/torch_chunked_output_loss.py)."""
    from ckplan.model.loss import (
        chunk_output_backward_bytes,
        loss_moved_bytes,
        output_backward_peak_bytes,
        output_forward_workspace_bytes,
    )

    spec = spec_of("llama3-8b", seq=8192, micro_batch=1, loss="chunked-output:8")
    T, V, h = 8192, 128256, 4096
    X, L, W = 2 * T * h, T * V, 2 * V * h
    compiled = spec_of("llama3-8b", seq=8192, micro_batch=1, loss="compiled")
    assert output_saved_bytes(spec) == output_saved_bytes(compiled) == 2 * X + 2 * L + 8 * T
    assert output_forward_workspace_bytes(spec) == output_saved_bytes(spec) - X
    # summing the weight's gradients outweighs a chunk: 2W - 2·(2L/8) > 2L/8
    assert chunk_output_backward_bytes(spec) == 2 * W - 2 * (2 * L // 8)
    assert output_backward_peak_bytes(spec) == output_saved_bytes(spec) + 2 * W - L // 2
    assert loss_moved_bytes(spec) == (4 * L, 4 * L + 7 * 3 * W)
    lora = spec_of("llama3-8b", seq=8192, micro_batch=1, loss="chunked-output:8", training="lora")
    assert chunk_output_backward_bytes(lora) == 2 * L // 8
    assert loss_moved_bytes(lora) == (4 * L, 4 * L)


def test_torchtitan_tensor_parallel_output_stage_by_hand(spec_of):
    """torchtitan's loss parallel (eager loss over vocabulary-split logits) holds exp(x) and a
    sum beside the scattered gradient: 12L beside the saved 4L where the plain path holds 8L
    (validation/torch_loss_parallel.py: 14.06 vs 10.02 bytes per logit above the start)."""
    from ckplan.model.loss import output_backward_peak_bytes

    spec = spec_of("llama3-70b", framework="torchtitan", tp=8, sp=True, loss="eager")
    T, V, h = spec.seq * spec.micro_batch, 128256, 8192
    X, L = 2 * T * h // 8, T * V // 8
    # the output layer saves its all-gathered input (T·h·2), the final norm its shard (X)
    assert output_backward_peak_bytes(spec) == X + 2 * T * h + 4 * L + 12 * L
    plain = spec_of("llama3-70b", framework="torchtitan", loss="eager")
    L1 = T * V
    assert output_backward_peak_bytes(plain) == 2 * (2 * T * h) + 4 * L1 + 8 * L1


def test_the_policy_per_term_in_estimate_json(cli):
    """estimate --json names a per-op policy's kept units and its stored layer; compiled, w2's
    output (s·b·h·2 = 8192·4096·2 bytes) is not saved."""
    import json

    terms = {}
    for kernels in ("eager", "compiled"):
        code, out, _ = cli(
            "estimate", "llama3-8b", "--set", "framework=torchtitan", "--set",
            f"kernels={kernels}", "--strategy", "sac", "--json",
        )  # fmt: skip
        assert code == 0
        terms[kernels] = json.loads(out)["memory"]["policy"]
    assert terms["eager"]["kept"] == ["q_proj", "v_proj", "attention", "gate_proj", "fc2"]
    assert terms["eager"]["compile_unread_bytes"] == 0
    assert terms["compiled"]["compile_unread_bytes"] == 8192 * 4096 * 2
    assert terms["eager"]["tape_bytes"] - terms["compiled"]["tape_bytes"] == 8192 * 4096 * 2
    code, out, _ = cli("estimate", "llama3-8b", "--strategy", "full", "--json")
    assert "policy" not in json.loads(out)["memory"]
