"""Time the optimal (rotor) DP and the joint offload DP of ckplan.schedules on a
transformer-sized chain.

Usage: python3 benchmarks/bench_schedules.py [--layers 128] [--slots 500] [--repeat 3]

The chain is embedding + L layers + output layer/loss (L + 2 stages), with sizes and FLOPs of a
Llama-like model (h = 4096, s = 4096, b = 1, bf16, V = 128256): layer input 2sbh bytes, layer tape
34sbh bytes (Korthikanti et al. 2022, Table 2, no dropout masks counted separately here), layer
forward 24sbh^2 + 4bs^2h FLOPs, backward twice that; the output stage keeps fp32 logits.
Each budget is a fraction of the store-everything peak. The joint DP (schedules.offload) prices
a tape's copy at COPY_FLOPS_PER_BYTE FLOPs of compute per byte: a GPU sustaining 132 TFLOP/s
(an RTX 4090 at 0.8 of its 165 TFLOP/s) on a 25.6 GB/s host link (PCIe Gen4 x16 at 0.8).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckplan.schedules import (
    Chain,
    optimal_schedule,
    revolve_schedule,
    simulate,
    store_all_schedule,
)
from ckplan.schedules.offload import optimal_offload_schedule

COPY_FLOPS_PER_BYTE = 132e12 / 25.6e9  # FLOP/s over bytes/s


def transformer_chain(layers: int, h: int = 4096, s: int = 4096, b: int = 1) -> Chain:
    vocab = 128256
    act = 2 * s * b * h  # bf16 (s, b, h)
    layer_fwd = 24 * s * b * h * h + 4 * b * s * s * h
    out_fwd = 2 * s * b * h * vocab
    emb_fwd = s * b * h  # a gather
    forward = [emb_fwd] + [layer_fwd] * layers + [out_fwd]
    backward = [2 * x for x in forward]
    inputs = [8 * s * b] + [act] * (layers + 1) + [0]  # token ids, activations, scalar loss
    tapes = [8 * s * b] + [17 * act] * layers + [act + 4 * s * b * vocab]
    workspace = [0] + [2 * act] * layers + [4 * s * b * vocab]
    return Chain(forward, backward, inputs, tapes, workspace, workspace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=128)
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    chain = transformer_chain(args.layers)
    base = sum(chain.forward_flops) + sum(chain.backward_flops)
    top = simulate(chain, store_all_schedule(chain)).peak_bytes
    print(
        f"chain: {chain.length} stages ({args.layers} layers + embedding + output), "
        f"{args.slots} slots; store-all peak {top / 2**30:.1f} GiB"
    )
    print(
        f"{'budget':>8} {'GiB':>8} {'best s':>8} {'median s':>9} {'peak GiB':>9} {'recompute':>10}"
    )
    for frac in (0.05, 0.1, 0.25, 0.5, 1.0):
        budget = int(top * frac)
        times = []
        result = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            result = optimal_schedule(chain, budget, slots=args.slots)
            times.append(time.perf_counter() - t0)
        times.sort()
        if result is None:
            peak, overhead = "-", "infeasible"
        else:
            peak = f"{result.peak_bytes / 2**30:.1f}"
            overhead = f"{result.recompute_flops / base:.1%}"
        print(
            f"{frac:>8.0%} {budget / 2**30:>8.1f} {times[0]:>8.2f} "
            f"{times[len(times) // 2]:>9.2f} {peak:>9} {overhead:>10}"
        )

    copy = [int(tape * COPY_FLOPS_PER_BYTE) for tape in chain.tape_bytes]
    print(f"joint DP (keep, offload, recompute), a copy costs {COPY_FLOPS_PER_BYTE:,.0f} FLOP/byte")
    print(
        f"{'budget':>8} {'GiB':>8} {'best s':>8} {'median s':>9} {'peak GiB':>9} {'recompute':>10}"
        f" {'offloaded':>10} {'exposed':>8}"
    )
    for frac in (0.05, 0.1, 0.25, 0.5, 1.0):
        budget = int(top * frac)
        times = []
        joint = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            joint = optimal_offload_schedule(chain, budget, copy, slots=args.slots)
            times.append(time.perf_counter() - t0)
        times.sort()
        if joint is None:
            cells = f"{'-':>9} {'infeasible':>10} {'':>10} {'':>8}"
        else:
            cells = (
                f"{joint.peak_bytes / 2**30:>9.1f} {joint.replay.recompute_flops / base:>10.1%} "
                f"{len(joint.offloaded):>10} {joint.exposed_cost / base:>8.1%}"
            )
        print(
            f"{frac:>8.0%} {budget / 2**30:>8.1f} {times[0]:>8.2f} "
            f"{times[len(times) // 2]:>9.2f} {cells}"
        )

    for slots_count in (4, 12):
        replay = simulate(chain, revolve_schedule(chain, slots_count))
        print(
            f"revolve:{slots_count}: peak {replay.peak_bytes / 2**30:.1f} GiB, "
            f"recompute {replay.recompute_flops / base:.1%}"
        )


if __name__ == "__main__":
    main()
