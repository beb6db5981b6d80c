"""The published fine-tuning memory runs (validation/runs/memory-torchtune-*.yaml): which ckplan
keys each becomes (ckplan.published.predict), and that they are scored; the pure functions the
predictor adds, by hand."""

from __future__ import annotations

import dataclasses

import pytest

from ckplan.model.frameworks import buffer_bytes
from ckplan.model.memory import layer_input_bytes
from ckplan.model.optimizers import paged_state_bytes
from ckplan.model.spec import spec_from_mapping
from ckplan.plan import evaluate, parse_strategy
from ckplan.published.predict import (
    checkpoint_offload_activation_bytes,
    liger_chunks,
    offloads_checkpoints,
    outside_allocator_bytes,
    predict,
    run_spec,
    unmodelled,
)
from ckplan.published.suite import suite_runs

TORCHTUNE = "torchtune-llama3.2-3b-"


def torchtune_runs():
    return {
        run.name.removeprefix(TORCHTUNE): run
        for run in suite_runs()
        if run.name.startswith(TORCHTUNE)
    }


def test_the_torchtune_runs_are_all_scored():
    """Each of the nine rows is scored now; the error only within a sanity bound (the values are
    reported in docs/fine-tuning.md, not fixed here)."""
    runs = torchtune_runs()
    assert len(runs) == 9
    for name, run in runs.items():
        assert unmodelled(run) is None, name
        prediction = predict(run)
        assert prediction.scored, (name, prediction.status)
        assert abs(prediction.error) < 0.6, name


def test_torchtune_trains_in_pure_bf16():
    """torchtune: bf16 weights, gradients and AdamW moments, no master copy and no autocast
    copy of the weights."""
    for name, run in torchtune_runs().items():
        spec = run_spec(run)
        assert (spec.weight_bytes, spec.grad_bytes, spec.master_bytes) == (2, 2, 0), name
        assert spec.framework == "hf"
        expected = "adamw-8bit" if name.endswith("8bitadam") else "adamw-bf16"
        assert spec.optimizer == expected, name
        assert spec.optimizer_bytes == (2 if expected == "adamw-8bit" else 4)
        if spec.training == "full":
            assert predict(run).plan.model_states.buffers == 0


def test_each_row_s_flags_become_keys():
    runs = torchtune_runs()
    for name, run in runs.items():
        spec = run_spec(run)
        assert (spec.kernels == "compiled") == ("compile" in name or "lora" in name), name
        assert spec.loss == ("chunked-output:8" if "chunkedce" in name else "eager"), name
        assert spec.optimizer_in_backward == ("optinbwd" in name), name
        assert offloads_checkpoints(run) == ("actoffload" in name), name
    lora = run_spec(runs["lora-a100-packed-compile-chunkedce-ac-actoffload"])
    assert lora.training == "lora" and lora.lora_rank == 64
    # torchtune's output_proj, w1, w2, w3 are PEFT's o_proj, gate_proj, down_proj, up_proj
    assert lora.lora_targets == "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    qlora = run_spec(runs["qlora-a100-packed-compile-chunkedce-ac-actoffload"])
    assert qlora.training == "qlora" and qlora.weight_format == "nf4"


def test_offloading_needs_torchtune_s_checkpointed_inputs():
    run = torchtune_runs()["full-a100-packed-compile-chunkedce-ac-optinbwd-actoffload"]
    assert unmodelled(run) is None
    other = dataclasses.replace(run, recompute="none")
    assert "offload activations" in unmodelled(other)
    other = dataclasses.replace(run, framework="hf")
    assert "offload activations" in unmodelled(other)


def test_autocast_copies_only_fp32_weights():
    """PyTorch's autocast caches a bf16 cast of fp32 leaf weights only: Hugging Face's Trainer
    over fp32 weights holds 2 bytes per parameter more, bf16 weights none."""
    base = {
        "name": "m",
        "layers": 2,
        "hidden": 64,
        "heads": 4,
        "ffn_hidden": 128,
        "vocab": 256,
        "seq": 16,
        "micro_batch": 1,
        "framework": "hf",
    }
    fp32 = spec_from_mapping(base)
    bf16 = spec_from_mapping({**base, "weight_bytes": 2, "grad_bytes": 2})
    assert buffer_bytes(fp32, 1000, 100, 10) == 2 * 1000
    assert buffer_bytes(bf16, 1000, 100, 10) == 0


def test_paged_states_outside_the_allocator_by_hand():
    """bitsandbytes pages the uint8 states of tensors of 1e5 values or more: 2 bytes per value;
    a smaller tensor's states, and every other optimizer's, stay in PyTorch's allocator."""
    tensors = {(3072, 8192): 3, (3072,): 2, (300, 300): 1}
    assert paged_state_bytes("paged-adamw-8bit", tensors) == 3 * 2 * 3072 * 8192
    assert paged_state_bytes("adamw-8bit", tensors) == 0
    assert paged_state_bytes("adamw", tensors) == 0


def test_paged_states_are_left_out_of_the_allocator_figure():
    """The README's 8-bit row runs AdamW8bit, whose states the allocator holds; were it
    bitsandbytes' PagedAdamW8bit, the uint8 states of every matrix would be left out."""
    run = torchtune_runs()["full-a100-packed-compile-chunkedce-ac-optinbwd-actoffload-8bitadam"]
    assert run.training["optimizer"] == "adamw-8bit"
    assert outside_allocator_bytes(run_spec(run)) == 0
    paged_run = dataclasses.replace(run, training={**run.training, "optimizer": "paged-adamw-8bit"})
    spec = run_spec(paged_run)
    paged = outside_allocator_bytes(spec)
    # every matrix of Llama 3.2 3B (the tied embedding once) has 1e5 values or more
    matrices = spec.layers * (2 * 3072 * 3072 + 2 * 1024 * 3072 + 3 * 3072 * 8192) + 128256 * 3072
    assert paged == 2 * matrices
    prediction = predict(paged_run)
    assert (
        prediction.predicted
        == prediction.plan.model_states.total
        + (checkpoint_offload_activation_bytes(prediction.plan))
        - paged
    )


def test_offloaded_checkpoints_by_hand():
    """Full recomputation of Llama 3.2 3B's 28 layers: the plan peaks in the chunked loss's
    backward, every layer input held. torchtune's forward stash keeps the newest 5 packed
    tensors, and the eager final RMSNorm packs 6 after the last layer's input, and the stash is
    emptied once the backward starts, so all 28 inputs (48 MiB each) are on the host there: the
    README's -1.3 GiB."""
    run = torchtune_runs()["full-a100-packed-compile-chunkedce-ac-optinbwd-actoffload"]
    spec = run_spec(run)
    plan = evaluate(spec, parse_strategy("full", spec))
    X = layer_input_bytes(spec)
    assert X == 2 * 2 * 4096 * 3072
    assert plan.activation_bytes - checkpoint_offload_activation_bytes(plan) == 28 * X


@pytest.mark.parametrize("layers", [2, 4, 8])
def test_only_layer_inputs_move(layers):
    """Whatever the depth, what moves to the host is layer inputs: the offloaded peak lies
    between the plan's and the plan's less every layer input."""
    spec = spec_from_mapping(
        {
            "name": "m",
            "layers": layers,
            "hidden": 64,
            "heads": 4,
            "ffn_hidden": 128,
            "vocab": 256,
            "seq": 16,
            "micro_batch": 1,
            "framework": "hf",
        }
    )
    plan = evaluate(spec, parse_strategy("full", spec))
    offloaded = checkpoint_offload_activation_bytes(plan)
    X = layer_input_bytes(spec)
    assert plan.activation_bytes - layers * X <= offloaded <= plan.activation_bytes


def test_liger_s_chunk_count_by_hand():
    """Liger-Kernel's fused linear cross-entropy splits BT tokens into chunks of
    next_power_of_2(⌈BT/⌈V/h⌉⌉): Llama-3-8B (V 128,256, h 4,096) gives ⌈V/h⌉ = 32, so 8 x 1,024
    tokens make chunks of 256, 32 of them, and every power-of-two length the same count."""
    runs = [run for run in suite_runs() if run.name.startswith("liger-e2e-llama3-8b-liger")]
    assert len(runs) == 5
    for run in runs:
        assert liger_chunks(run) == 32
        assert run_spec(run).loss == "chunked:32"
        assert predict(run).scored
    odd = dataclasses.replace(runs[0], seq=1000)  # 8,000 tokens: chunks of 256, the last short
    assert liger_chunks(odd) == 32
    small = dataclasses.replace(runs[0], seq=64, micro_batch=1)  # 64 tokens: chunks of 2
    assert liger_chunks(small) == 32
    hf = next(run for run in suite_runs() if run.name == "liger-e2e-llama3-8b-hf-seq1024")
    assert run_spec(hf).loss == "eager"
