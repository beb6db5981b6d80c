"""A `cpu` device profile measured on the spot, for `ckplan verify`'s NumPy executor.

The same time model as the GPUs' (roofline.py over the op table, step_time.py over the schedule
replay), on a profile probed with NumPy on this machine instead of a datasheet:

- matmul FLOP/s: the rate of the layer's own forward GEMM, (b x d) @ (d x f) float64,
  run once per layer over the network's own weights, so the weights come from wherever a step
  finds them (caches for a small network, memory for a large one);
- memory bytes/s: the rate of an element-wise add over a (b, f) array, the size the
  layer's element-wise kernels touch (so caches count as they do for the run);
- seconds per value of the 0/1 mask (`np.heaviside`, in the layer's backward): NumPy runs this
  ufunc element by element, far below the bandwidth of add or multiply (docs/validation.md: 4 ms
  of a 0.3 s step at b = 256, f = 2048), so it is timed on its own at the (b, f) size;
- seconds per NumPy call: the executor is Python, and each NumPy call costs a fixed overhead on
  top of its work; measured as the executor's row-by-row bias add on a (b, 1) array, divided by
  b (`verify._add_bias`, the loop that dominates its call count).

On a machine shared with other work the rates change from one second to the next, so `ckplan
verify` probes once per timing round, between the runs, and takes the median of each rate over
the rounds (`median_profile`): the probe sees the load the runs see, and its median is compared
with the runs' median. `probe_spread` says how much the GEMM rate moved.

The profile is a `GPU` with efficiencies 1 (the rates are measured, not datasheet) and a
1 x 1 tile on one "SM" (no wave quantisation on a CPU), plus the call overhead, which the GPU
model has no term for (a CUDA launch is asynchronous). Reading the clock is the only impure part.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ckplan.hardware.gpus import GPU

PROBE_SECONDS = 0.03  # per probe and rate; verify probes once per timing round


@dataclass(frozen=True)
class CPUProfile:
    flops_per_s: float
    bytes_per_s: float
    call_seconds: float
    mask_seconds_per_value: float = 0.0
    probe_spread: float = 0.0  # (max - min) / median of the GEMM rate: how much it moved

    def as_gpu(self) -> GPU:
        """The profile as the time model's device: measured rates at efficiency 1."""
        return GPU(
            name="cpu",
            source="measured on the spot (ckplan.hardware.cpu)",
            memory_bytes=1,
            bf16_flops=self.flops_per_s,
            fp32_flops=self.flops_per_s,
            hbm_bytes_per_s=self.bytes_per_s,
            link_bytes_per_s=1.0,
            gpus_per_node=1,
            network_bytes_per_s=1.0,
            matmul_efficiency=1.0,
            memory_efficiency=1.0,
            link_efficiency=1.0,
            network_efficiency=1.0,
            flash_attention_efficiency=1.0,
            sm_count=1,
            tile_m=1,
            tile_n=1,
        )


def _rates(work: float, run: Callable[[], object], seconds: float) -> list[float]:
    """work / elapsed for repeated runs of `run` over about `seconds`."""
    run()  # warm up (page faults, BLAS thread start)
    samples = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        start = time.perf_counter()
        run()
        samples.append(work / (time.perf_counter() - start))
    return samples


def _mask_rates(source: np.ndarray, seconds: float) -> list[float]:
    """Values per second of np.heaviside over fresh copies of `source` (copies not timed)."""
    work = np.empty_like(source)
    samples = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        np.copyto(work, source)
        start = time.perf_counter()
        np.heaviside(work, 0.0, out=work)
        samples.append(source.size / (time.perf_counter() - start))
    return samples


def measure_cpu_profile(
    inputs: np.ndarray, weights: Sequence[np.ndarray], seconds: float = PROBE_SECONDS
) -> CPUProfile:
    """Probe this machine with the NumPy MLP's input (b, d) and its layers' (d, f) weights."""
    rows = inputs.shape[0]
    hidden = weights[0].shape[1]
    out = np.empty((rows, hidden))

    def every_layer() -> None:
        for weight in weights:
            np.matmul(inputs, weight, out=out)

    work = sum(2 * rows * weight.shape[0] * weight.shape[1] for weight in weights)
    gemm = _rates(work, every_layer, seconds)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((rows, hidden)), rng.standard_normal((rows, hidden))
    memory = _rates(3 * a.nbytes, lambda: np.add(a, b, out=a), seconds)
    column, bias = np.zeros((rows, 1)), np.zeros(1)

    def row_adds() -> None:
        for row in column:
            np.add(row, bias, out=row)

    calls = _rates(rows, row_adds, seconds)  # calls per second
    # The mask of relu(random) values, as the backward builds it: half zeros, half positive, in
    # no order (on its own 0/1 output the ufunc's branches are predictable and it runs faster).
    source = np.maximum(rng.standard_normal((rows, hidden)), 0.0)
    mask = _mask_rates(source, seconds)  # values per second
    median = statistics.median(gemm)
    return CPUProfile(
        flops_per_s=median,
        bytes_per_s=statistics.median(memory),
        call_seconds=1 / statistics.median(calls),
        mask_seconds_per_value=1 / statistics.median(mask),
        probe_spread=(max(gemm) - min(gemm)) / median,
    )


def median_profile(profiles: Sequence[CPUProfile]) -> CPUProfile:
    """Each rate's median over several probes; the spread of their GEMM rates."""
    rates = [profile.flops_per_s for profile in profiles]
    median = statistics.median(rates)
    return CPUProfile(
        flops_per_s=median,
        bytes_per_s=statistics.median(profile.bytes_per_s for profile in profiles),
        call_seconds=statistics.median(profile.call_seconds for profile in profiles),
        mask_seconds_per_value=statistics.median(p.mask_seconds_per_value for p in profiles),
        probe_spread=(max(rates) - min(rates)) / median if len(rates) > 1 else 0.0,
    )
