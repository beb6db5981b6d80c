"""torchtitan's asynchronous TP (ckplan.model.async_tp): its symmetric-memory workspace, by hand,
and where it is counted (nvidia-smi) and where not (the caching allocator's peaks)."""

from __future__ import annotations

import json

from ckplan.hardware.device_memory import device_memory
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.async_tp import (
    async_tp_workspace_bytes,
    uses_async_tp,
    workspace_allocation_bytes,
    workspace_request_bytes,
)
from ckplan.published.predict import predict
from ckplan.published.suite import suite_runs

MIB = 2**20
PLAIN = "torchtitan-202412-llama3-70b-256gpu-fsdp32-tp8"
ASYNC = "torchtitan-202412-llama3-70b-256gpu-fsdp32-tp8-asynctp"


def seventy_b(**changes):
    """Llama 3 70B as torchtitan's December 2024 Table 4 runs it: TP 8 with sequence
    parallelism, FSDP 32, local batch 16 at 8192 tokens, compiled float8 blocks."""
    values = dict(
        framework="torchtitan",
        framework_version="2024.12",
        kernels="compiled",
        precision="float8",
        tp=8,
        sp=True,
        dp=32,
        zero=3,
        seq=8192,
        micro_batch=16,
        tp_comm_overlap=True,
    )
    return load_spec("llama3-70b").replace(**{**values, **changes})


def test_the_reduce_scatter_asks_for_two_chunks_of_the_product():
    # 131,072 tokens / 8 ranks x 8192 = 134,217,728 elements a shard; the float8 gather asks
    # for 134,217,728 bytes, the reduce-scatter for 2 chunks of bf16: 536,870,912 bytes
    assert workspace_request_bytes(131072, 8192, 8, 1, 2) == 536870912
    # a 4-byte gather beside 1-byte products: the gather is the larger, 4 x 134,217,728
    assert workspace_request_bytes(131072, 8192, 8, 4, 1) == 536870912
    assert workspace_request_bytes(8192, 4096, 2, 2, 2) == 2 * 4096 * 4096 * 2


def test_the_allocation_adds_the_signal_pad_and_rounds_to_the_granularity():
    # 512 MiB + 2,048 B of signal pad: 257 pages of 2 MiB
    assert workspace_allocation_bytes(536870912) == 257 * 2 * MIB
    # 1 B rounds to 16, plus the pad: one page
    assert workspace_allocation_bytes(1) == 2 * MIB
    assert workspace_allocation_bytes(0) == 0


def test_async_tp_needs_torchtitan_tp_sequence_parallel_overlap_and_compile():
    assert uses_async_tp("torchtitan", 8, True, True, "compiled")
    assert not uses_async_tp("torchtitan", 8, True, False, "compiled")  # plain TP
    assert not uses_async_tp("torchtitan", 8, True, True, "eager")  # refused without compile
    assert not uses_async_tp("torchtitan", 1, True, True, "compiled")
    assert not uses_async_tp("torchtitan", 8, False, True, "compiled")
    assert not uses_async_tp("megatron", 8, True, True, "compiled")  # userbuffers: not this


def test_the_70b_run_maps_514_mib_of_symmetric_memory():
    assert async_tp_workspace_bytes(seventy_b()) == 257 * 2 * MIB
    assert async_tp_workspace_bytes(seventy_b(tp_comm_overlap=False)) == 0
    # bf16 gathers: 256 MiB a shard, still below the reduce-scatter's 512 MiB
    assert async_tp_workspace_bytes(seventy_b(precision="bf16")) == 257 * 2 * MIB


def test_nvidia_smi_counts_the_workspace_beside_the_reserved_peak():
    gpu = load_gpu("h100-sxm")
    allocated = 50 * 2**30
    overlapped = device_memory(allocated, seventy_b(), gpu)
    plain = device_memory(allocated, seventy_b(tp_comm_overlap=False), gpu)
    assert overlapped.symmetric_memory == 257 * 2 * MIB
    assert plain.symmetric_memory == 0
    assert overlapped.reserved == plain.reserved  # outside the caching allocator
    assert overlapped.total - plain.total == 257 * 2 * MIB


def test_the_published_reserved_peaks_do_not_count_the_workspace():
    runs = {run.name: run for run in suite_runs() if run.name in (PLAIN, ASYNC)}
    plain, overlapped = predict(runs[PLAIN]), predict(runs[ASYNC])
    assert overlapped.spec.tp_comm_overlap and not plain.spec.tp_comm_overlap
    assert async_tp_workspace_bytes(overlapped.spec) == 257 * 2 * MIB
    # torch.cuda.memory_stats' reserved bytes: the same prediction for both rows
    assert overlapped.predicted == plain.predicted


def test_estimate_json_names_the_workspace(cli):
    args = ["estimate", "llama3-70b", "--gpu", "h100-sxm", "--strategy", "full", "--json"]
    sets = [
        "framework=torchtitan",
        "kernels=compiled",
        "precision=float8",
        "tp=8",
        "sp=true",
        "dp=32",
        "zero=3",
        "micro_batch=16",
        "tp_comm_overlap=true",
    ]
    for item in sets:
        args += ["--set", item]
    code, out, err = cli(*args)
    assert code == 0, err
    memory = json.loads(out)["memory"]
    terms = memory["device"]
    assert terms["symmetric_memory_bytes"] == 257 * 2 * MIB
    assert memory["device_bytes"] == sum(terms.values())
