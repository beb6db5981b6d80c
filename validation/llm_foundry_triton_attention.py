"""Whether the pre-MLIR Triton FlashAttention explains llm-foundry's residuals (docs/validation.md).

llm-foundry's October 2023 tables (commit b2a43a1477a45f40f4086a1c72f851b0ab42d0ac) ran
`attn_impl: triton`: flash-attention's flash_attn_triton.py, built by triton-pre-mlir
(vchiley/triton@triton_pre_mlir_sm90). That branch differs from triton_pre_mlir only in the
PTX target and ISA version (include/triton/external/CUDA/cuda.h, lib/driver/llvm.cc,
python/setup.py), so on an H100 its code generator emits the Ampere mma.sync m16n8k16 code
(lib/codegen/selection/generator.cc: `visit_mma16816` for sm >= 80), as FlashAttention-1's CUDA
kernels do. No benchmark of it on an H100 is published. Derived estimate: FlashAttention-1's
H100 figure times the Triton kernel's ratio to FlashAttention-1 on an A100, both from
flash-attention's FlashAttention-2 benchmarks (forward + backward, causal, head dim 128;
assets/flash2_a100_fwd_bwd_benchmark.png and assets/flash2_h100_fwd_bwd_benchmark.png at
4f285b35, 2023-07-17). A100 rows take the A100 Triton figure itself.

For each llm-foundry run without an attention kernel: ckplan's error as the suite scores it, with
the attention kernel at the estimate (fitted as e(s) = plateau · s / (s + attention_half_seq),
the GPU file's half length), and with no data-parallel overlap at all (`dp_comm_overlap` off,
an upper bound on what FSDP's prefetch order can add). Nothing here is fitted to a run.

    python validation/llm_foundry_triton_attention.py
"""

from __future__ import annotations

import dataclasses

from ckplan.inputs.gpus import load_gpu
from ckplan.published.predict import predict
from ckplan.published.suite import suite_runs

RUN_PREFIX = "llmfoundry-"
SEQ = (512, 1024, 2048, 4096, 8192, 16384)
# TFLOP/s, forward + backward, causal, head dim 128 (the benchmark images named above)
A100_TRITON = (50, 61, 68, 74, 78, 80)
A100_FLASH1 = (55, 62, 69, 76, 80, 83)
H100_FLASH1 = (98, 109, 108, 126, 135, 137)


def h100_triton_estimate() -> tuple[float, ...]:
    """derived: FlashAttention-1 on an H100 times Triton / FlashAttention-1 on an A100."""
    return tuple(h * t / f for h, t, f in zip(H100_FLASH1, A100_TRITON, A100_FLASH1, strict=True))


def plateau(tflops: tuple[float, ...], peak_tflops: float, half_seq: float) -> float:
    """Least-squares plateau p of e(s) = p · s / (s + half_seq) through the figures (of peak)."""
    shapes = [s / (s + half_seq) for s in SEQ]
    shares = [t / peak_tflops for t in tflops]
    return sum(x * y for x, y in zip(shapes, shares, strict=True)) / sum(x * x for x in shapes)


def triton_plateau(gpu) -> float:
    figures = A100_TRITON if gpu.name.startswith("a100") else h100_triton_estimate()
    return plateau(figures, gpu.bf16_flops / 1e12, gpu.attention_half_seq)


def main() -> None:
    print("H100 Triton estimate (TFLOP/s):", [round(x, 1) for x in h100_triton_estimate()])
    print(f"{'run':46s} {'split':11s} {'error':>7s} {'triton':>7s} {'no-overlap':>10s}")
    for run in suite_runs():
        if not run.name.startswith(RUN_PREFIX) or run.attention_kernel:
            continue
        gpu = load_gpu(run.gpu, run.gpu_settings)
        scored = predict(run, gpu)
        slow = predict(run, gpu.replace(flash_attention_efficiency=triton_plateau(gpu)))
        exposed = dataclasses.replace(run, settings={**run.settings, "dp_comm_overlap": False})
        bound = predict(exposed, gpu)
        print(
            f"{run.name:46s} {run.split:11s} {scored.error:+7.1%} {slow.error:+7.1%} "
            f"{bound.error:+10.1%}"
        )


if __name__ == "__main__":
    main()
