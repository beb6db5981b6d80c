"""Where the step of Megatron-Core's 2024 H100 weak-scaling runs goes (docs/validation.md).

For each run of validation/runs/megatron-core-2024-h100.yaml: ckplan's step and the published
one, the forward and backward compute of the step's micro-batches, the exposed tensor-parallel
collectives, and the data-parallel ones of the distributed optimizer as Megatron-Core r0.8.0
runs them under --overlap-grad-reduce --overlap-param-gather (megatron/core/distributed/
param_and_grad_buffer.py `register_grad_ready`: the fp32 buckets are reduce-scattered only in
the last micro-batch's backward; optimizer/distrib_optimizer.py `zero_grad`,
`_finish_param_sync_helper`: the bf16 weights all-gathered bucket by bucket beside the next
step's first forward): each collective's time, the compute window it overlaps, and what it
adds. Then two checks that need no run fact changed:

- `line rate`: the run's error with the network and NVLink at their full rates
  (network_efficiency = link_efficiency = 1), a bound on what the bandwidth can explain;
- `mb 2`, `mb 4`: the error were the unpublished micro-batch 2 or 4 (the run keeps 1), each
  rank then running 2 or 1 micro-batches, the last backward and first forward 2 or 4 times
  longer.

    python validation/megatron_core_dp_overlap.py
"""

from __future__ import annotations

import dataclasses

from ckplan.hardware import step_time as st
from ckplan.inputs.gpus import load_gpu
from ckplan.published.predict import predict
from ckplan.published.suite import suite_runs

RUN_FILE_PREFIX = "mcore24-"


def micro_batch(spec, gpu):
    """One micro-batch on the busiest pipeline stage, no recomputation (as the runs)."""
    times = []
    for stage in range(spec.pp):
        chain = st.chain_stage_times(spec, gpu, stage)
        times.append(st.micro_batch_time(chain, (1,) * len(chain), False))
    return max(times, key=lambda t: t.total)


def row(run) -> str:
    gpu = load_gpu(run.gpu, run.gpu_settings)
    prediction = predict(run, gpu)
    spec, m = prediction.spec, prediction.spec.microbatches
    busiest = micro_batch(spec, gpu)
    parts = st.data_parallel_comm(spec, gpu)
    exposed = st.data_parallel_exposed(spec, gpu, busiest)
    full_rate = dataclasses.replace(gpu, network_efficiency=1.0, link_efficiency=1.0)
    other = [predict(dataclasses.replace(run, micro_batch=b), gpu).error for b in (2, 4)]
    cells = [
        run.name.removeprefix(RUN_FILE_PREFIX),
        f"{m}",
        f"{prediction.published_step:.3f}",
        f"{prediction.predicted_step:.3f}",
        f"{prediction.error:+.1%}",
        f"{m * busiest.forward.total:.3f} / {m * busiest.backward.total:.3f}",
        f"{m * (busiest.forward_comm + busiest.backward_comm):.3f}",
        f"{parts.reduce:.3f} / {busiest.backward.total:.3f}",
        f"{parts.gather:.3f} / {busiest.forward.total:.3f}",
        f"{exposed:.3f}",
        f"{predict(run, full_rate).error:+.1%}",
        *(f"{error:+.1%}" for error in other),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    print(
        "| run | micro-batches | published step, s | ckplan step, s | error | forward / "
        "backward, s | TP exposed, s | fp32 reduce-scatter / last backward, s | bf16 "
        "all-gather / first forward, s | DP exposed, s | line rate | mb 2 | mb 4 |"
    )
    print("|" + "---|" * 13)
    for run in suite_runs():
        if run.name.startswith(RUN_FILE_PREFIX):
            print(row(run))


if __name__ == "__main__":
    main()
