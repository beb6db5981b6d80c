"""The block-scaled FP8 GEMM's rate on Hopper against the per-tensor-scaled one's (the GPU key
`fp8_block_gemm_rate`, fp8_recipe blockwise), derived from Transformer Engine's own benchmark.

Source: NVIDIA/TransformerEngine v2.17 docs/examples/gemm_profiling/gemm_profiling.rst, "Worked
Example: 5B Model on H200" (NVIDIA H200 NVL; hidden 4096, intermediate 16384, 31 x 512 tokens;
benchmarks/gemm/benchmark_gemm.py at v2.17). Per-layer GEMM time over the twelve shapes (four
Fprop, four Dgrad, four Wgrad, each run as one `te.Linear` forward of an (M, K) input against an
(N, K) weight):

- autocast (quantization included): Float8CurrentScaling 20.285 ms, Float8BlockScaling 22.882;
- pre-quantized (the GEMM kernels alone): Float8CurrentScaling 16.785 ms (Float8BlockScaling is
  not run pre-quantized there: its pre-quantized path makes 2-D by 2-D inputs, which Hopper's
  cuBLAS refuses).

So the current-scaling casts take 20.285 - 16.785 = 3.500 ms. The block-scaled casts are not
measured alone; they are taken at the same bandwidth in proportion to the bytes each recipe's
casts move per call (ckplan.hardware.code_path's counts, benchmark_gemm.py's usages: the input
with its column-wise copy, `backward_needs_input`, the weight row-wise alone, its input not
requiring grad):

- current scaling: the input's amax read and cast, 2 + 2 + 1 + 1 = 6 bytes a value; the
  weight's (re-quantized every call: no `is_first_microbatch`), 2 + 2 + 1 = 5;
- block scaling: the input 2 + 1 + 1 and both copies' 1x128 fp32 scales; the weight 2 + 1 and
  its 128x128 scales (ckplan.model.fp8_blocks).

The block-scaled GEMMs then take 22.882 - 3.500 · (block bytes / current bytes) ms, and the rate
is 16.785 ms over that. This is a derivation, not a measurement of the GEMM kernel: it assumes
both recipes' casts run at one bandwidth and that the GEMM-kernel time of current scaling is
the per-tensor FP8 rate ckplan's GPU files hold (fp8_matmul_efficiency). Run it to print the
rate: `python validation/te_fp8_block_gemm_rate.py`.
"""

from __future__ import annotations

from ckplan.model.fp8_blocks import block_scale_bytes_1d, block_scale_bytes_2d

HIDDEN, INTERMEDIATE, TOKENS = 4096, 16384, 31 * 512
CURRENT_AUTOCAST_MS = 20.285
CURRENT_GEMM_MS = 16.785
BLOCK_AUTOCAST_MS = 22.882


def benchmark_shapes() -> list[tuple[int, int, int]]:
    """(M, K, N) of the twelve GEMMs, as benchmark_gemm.py `compute_gemm_shapes` (v2.17)
    derives them: Fprop (M, K, N), Dgrad (M, N, K), Wgrad (K, M, N)."""
    H, F, M = HIDDEN, INTERMEDIATE, TOKENS
    fprop = [(M, H, 3 * H), (M, H, H), (M, H, F), (M, F, H)]
    dgrad = [(M, 3 * H, H), (M, H, H), (M, F, H), (M, H, F)]
    wgrad = [(H, M, 3 * H), (H, M, H), (H, M, F), (F, M, H)]
    return fprop + dgrad + wgrad


def current_cast_bytes(m: int, k: int, n: int) -> int:
    """One current-scaling `te.Linear` forward's casts: the (m, k) input, amax pass, cast to
    both copies (6 bytes a value); the (n, k) weight, amax pass, row-wise cast (5)."""
    return 6 * m * k + 5 * n * k


def block_cast_bytes(m: int, k: int, n: int) -> int:
    """The same under block scaling: the input read and both copies with their 1x128 scales,
    the weight read and its row-wise copy with its 128x128 scales; no amax pass."""
    scales = block_scale_bytes_1d(m, k, "rowwise") + block_scale_bytes_1d(m, k, "columnwise")
    return 4 * m * k + scales + 3 * n * k + block_scale_bytes_2d(n, k, "rowwise")


def block_gemm_rate() -> float:
    """The block-scaled GEMMs' rate as a share of the per-tensor-scaled ones' (docstring)."""
    shapes = benchmark_shapes()
    share = sum(block_cast_bytes(*s) for s in shapes) / sum(current_cast_bytes(*s) for s in shapes)
    current_casts = CURRENT_AUTOCAST_MS - CURRENT_GEMM_MS
    block_gemm = BLOCK_AUTOCAST_MS - current_casts * share
    return CURRENT_GEMM_MS / block_gemm


if __name__ == "__main__":
    print(f"fp8_block_gemm_rate: {block_gemm_rate():.3f}")
