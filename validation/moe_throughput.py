"""ckplan's MoE time model against published training throughput (docs/validation.md).

- DeepSeek-V3 (DeepSeek-V3 technical report, arXiv 2412.19437): 2048 H800 GPUs (8 per node,
  NVLink within nodes, InfiniBand across), 16-way pipeline, 64-way expert parallelism over 8
  nodes, ZeRO-1 data parallelism, no tensor parallelism (§3.2); sequences of 4096 and a batch
  of 15360 sequences (§4.2); "training DeepSeek-V3 on each trillion tokens requires only 180K
  H800 GPU hours" (§1, Table 1): 1e12 / (180e3 x 3600) = 1543 tokens per second per GPU.
- Mixtral 8x7B on Megatron-Core (megatron/core/transformer/moe/README.md): "468 TFLOPS for
  Mixtral 8X7B bf16 training" (MCore v0.9), with the reference mapping the same README gives
  (64 H100 GPUs, seq 4096, TP 1, EP 8, PP 4, VP 8, micro-batch 1, global batch 256, BF16,
  dropless, all-to-all dispatcher); 468 / 989 = 47.3 % MFU.

    python validation/moe_throughput.py            # the tables of docs/validation.md
    python validation/moe_throughput.py --layers   # plus one MoE layer op by op

Nothing here is fitted: the GPU files are the shipped h800 and h100-sxm; every what-if row says
what it changes and why.
"""

from __future__ import annotations

import argparse

from ckplan.hardware.expert_parallel import expert_parallel_comm
from ckplan.hardware.roofline import op_backward_time, op_forward_time
from ckplan.hardware.step_time import layer_time, step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.model.layers import LayerKind
from ckplan.model.ops import layer_ops
from ckplan.plan import evaluate, parse_strategy

DEEPSEEK_TOKENS_PER_GPU = 1e12 / (180e3 * 3600)  # 1543.2
# 61 layers on 16 stages: the first holds the embedding and 4 layers (3 dense), the last the
# 61st layer and the output head (where DeepSeek also puts the MTP module); the report does not
# give the split, this is an assumption.
DEEPSEEK = {
    "pp": 16,
    "ep": 64,
    "dp": 128,
    "zero": 1,
    "microbatches": 120,  # 15360 sequences / 128 data-parallel replicas, micro-batch 1
    "first_stage_layers": 4,
    "last_stage_layers": 1,
}
FP8_GEMMS = {"bf16_flops": 1979e12, "flash_attention_efficiency": 0.25}
MIXTRAL_MFU = 468 / 989
MIXTRAL = {"pp": 4, "ep": 8, "dp": 16, "zero": 1, "microbatches": 16}
# IB bytes per token per MoE layer, forward: Megatron's all-to-all sends every one of the k = 8
# copies not bound for the own node, (56/64)·8 rows of h + 1 BF16 values each way; DeepSeek's
# kernels send a token once to each of at most 4 nodes, FP8 (1 byte + a fp32 scale per 128
# values) to dispatch, BF16 to combine (report §3.2.2, §3.3).
MEGATRON_IB = 2 * 56 / 64 * 8 * 7169 * 2
DEEPSEEK_IB = 4 * 7168 * (1 + 4 / 128) + 4 * 7168 * 2


def _row(name: str, spec, gpu, strategy: str = "none") -> tuple:
    plan = evaluate(spec, parse_strategy(strategy, spec))
    return name, plan, step_time(plan, gpu)


def deepseek_rows() -> list[tuple]:
    spec = load_spec("deepseek-v3", DEEPSEEK)
    overlap = {"ep_overlap": 1.0}
    ib = {"network_bytes_per_s": 50e9 * MEGATRON_IB / DEEPSEEK_IB}
    return [
        _row("Megatron defaults: BF16, all-to-all exposed", spec, load_gpu("h800")),
        _row("DualPipe: ep_overlap 1 (BF16)", spec, load_gpu("h800", overlap)),
        _row("ep_overlap 1, FP8 GEMMs", spec, load_gpu("h800", {**overlap, **FP8_GEMMS})),
        _row(
            "ep_overlap 1, FP8 GEMMs, DeepSeek's IB traffic",
            spec,
            load_gpu("h800", {**overlap, **FP8_GEMMS, **ib}),
        ),
        _row(
            "DualPipe, BF16, block:2 (fits 80 GB)",
            spec,
            load_gpu("h800", overlap),
            "block:2",
        ),
    ]


def mixtral_rows() -> list[tuple]:
    spec = load_spec("mixtral-8x7b", MIXTRAL)
    gpu = load_gpu("h100-sxm")
    v8 = spec.replace(virtual_stages=8)
    return [
        _row("v 1", spec, gpu),
        _row("v 8 (VP 8 as virtual stages)", v8, gpu),
        _row(
            "v 8, dp_overlap 1 (--overlap-grad-reduce)",
            v8,
            load_gpu("h100-sxm", {"dp_overlap": 1.0}),
        ),
    ]


def print_deepseek() -> None:
    print(f"DeepSeek-V3 on 2048 H800: published {DEEPSEEK_TOKENS_PER_GPU:.0f} tokens/s per GPU")
    print(
        "| setting | step s | tokens/s/GPU pred / pub | compute s | exposed EP s | bubble s "
        "| memory GiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, plan, time in deepseek_rows():
        compute = time.forward_seconds + time.backward_seconds + time.recompute_seconds
        tokens = time.tokens_per_second_per_gpu
        print(
            f"| {name} | {time.step_seconds:.2f} | {tokens:.0f} / {DEEPSEEK_TOKENS_PER_GPU:.0f} "
            f"({tokens / DEEPSEEK_TOKENS_PER_GPU - 1:+.1%}) | {compute:.2f} "
            f"| {time.expert_parallel_seconds:.2f} | {time.bubble_seconds:.2f} "
            f"| {plan.total_bytes / 2**30:.1f} |"
        )
    print(f"IB bytes per token and MoE layer, forward: Megatron {MEGATRON_IB:.0f}, DeepSeek <= "
          f"{DEEPSEEK_IB:.0f} ({MEGATRON_IB / DEEPSEEK_IB:.2f}x)")  # fmt: skip


def print_mixtral() -> None:
    print(f"Mixtral 8x7B on 64 H100: published 468 TFLOPS/GPU, MFU {MIXTRAL_MFU:.1%}")
    print("| setting | step s | MFU pred / pub | TFLOPS/GPU | exposed EP s | bubble s |")
    print("|---|---|---|---|---|---|")
    for name, _plan, time in mixtral_rows():
        print(
            f"| {name} | {time.step_seconds:.3f} | {time.mfu:.1%} / {MIXTRAL_MFU:.1%} "
            f"| {time.mfu * 989:.0f} | {time.expert_parallel_seconds:.3f} "
            f"| {time.bubble_seconds:.3f} |"
        )


def print_layer(name: str, overrides: dict, gpu_name: str) -> None:
    spec = load_spec(name, overrides)
    gpu = load_gpu(gpu_name)
    kind = LayerKind(moe=True)
    print(f"One {name} MoE layer on {gpu_name}, one micro-batch (ms, forward / backward)")
    print("| op | GEMM shape (m x n x k, groups) | forward matmul + memory | backward |")
    print("|---|---|---|---|")
    for op in layer_ops(spec, kind):
        forward, backward = op_forward_time(op, gpu), op_backward_time(op, gpu)
        mm = op.matmul
        shape = f"{mm.m} x {mm.n} x {mm.k}, {mm.batch}" if mm else ""
        print(
            f"| {op.name} | {shape} | {forward.matmul * 1e3:.3f} + {forward.memory * 1e3:.3f} "
            f"| {backward.matmul * 1e3:.3f} + {backward.memory * 1e3:.3f} |"
        )
    ep = expert_parallel_comm(spec, gpu)
    layer = layer_time(spec, gpu, kind)
    print(
        f"| expert-parallel (dispatch, combine, etp) | | {ep.dispatch * 1e3:.3f}, "
        f"{ep.combine * 1e3:.3f}, {(ep.gather + ep.scatter) * 1e3:.3f} | same |"
    )
    print(
        f"| layer | | {layer.forward.total * 1e3:.2f} compute + {layer.forward_comm * 1e3:.2f} "
        f"communication | {layer.backward.total * 1e3:.2f} + {layer.backward_comm * 1e3:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", action="store_true", help="one MoE layer op by op")
    args = parser.parse_args()
    print_deepseek()
    print()
    print_mixtral()
    if args.layers:
        print()
        print_layer("deepseek-v3", DEEPSEEK, "h800")
        print()
        print_layer("mixtral-8x7b", MIXTRAL, "h100-sxm")


if __name__ == "__main__":
    main()
