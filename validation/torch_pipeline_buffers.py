"""What torch.distributed.pipelining's PipelineStage holds on each rank of a 1F1B pipeline at the
rank's first backward, counted on the CPU (gloo, one process per stage): the check behind
`frameworks.torch_pipeline_buffer_bytes` (torchtitan's pipeline parallelism).

Each rank runs one `PipelineStage` (two linear layers, the activation between stages a (tokens,
h) fp32 tensor X) under `Schedule1F1B` with M micro-batches. Just before its first
`backward_one_chunk` it counts, in units of X: the forward receive buffers
(`args_recv_info`), the gradient receive buffers (`grad_recv_info`), and the stage outputs
`fwd_cache` keeps, with the number of micro-batches in flight (`len(fwd_cache)`). ckplan's term
is, per stage, (M - in flight) receive buffers on a non-first stage (the in-flight ones are the
layers' inputs, counted with their tapes), M gradient buffers on a non-last stage, and one kept
output per micro-batch in flight: `--check` compares the two.

PyTorch 2.13, three ranks, six micro-batches:
    rank 0: in flight 3, receive 0, gradient 6, outputs 3
    rank 1: in flight 2, receive 6, gradient 6, outputs 2
    rank 2: in flight 1, receive 6, gradient 0, outputs 1

At the backward of micro-batch M - in flight (the latest with as many in flight) it also counts
what the finished micro-batches left: the last stage's `output_chunks` beyond `fwd_cache` (the
schedule is stepped as torchtitan 9dec370 steps it, without return_outputs=False) and the
receive buffers' `.grad`. PyTorch 2.13: rank 2 keeps 5 finished outputs (M - 1), ranks 0 and 1
none, and no rank an input gradient (2.13 keeps `output_chunks` on the last stage only and
clears the inputs' `.grad` in `stage_backward`; the late-2024 release kept both on every stage,
`frameworks.torch_pipeline_finished_bytes`).

With --interleaved it runs ScheduleInterleaved1F1B instead, two ranks of two local stages each
(torchtitan's 'loop' placement: rank r holds stages r and r + 2), for 3, 4 and 6 micro-batches,
and records before each backward, per local stage, the micro-batches in flight (`fwd_cache`) and
those whose backward has run, keeping the latest point where the rank holds the most forwards:
the counts `frameworks.torch_interleaved_chunk_counts` walks, and each local stage's receive and
gradient buffers (one per micro-batch, as one stage per rank keeps them). PyTorch 2.13, (in
flight, finished) per local stage:
    3 micro-batches: rank 0 ((3, 0), (3, 0)), rank 1 ((3, 0), (1, 2))
    4 micro-batches: rank 0 ((3, 1), (2, 2)), rank 1 ((2, 2), (1, 3))
    6 micro-batches: rank 0 ((3, 3), (2, 4)), rank 1 ((2, 4), (1, 5))

Usage: python validation/torch_pipeline_buffers.py [--interleaved] [--check | --json] (--json:
the counts as JSON, by rank)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

STAGES, MICROBATCHES, TOKENS, HIDDEN = 3, 6, 32, 64


def buffer_units(infos: dict, unit: int) -> float:
    held = [
        info.buffer
        for recv in infos.values()
        for info in recv
        if getattr(info, "buffer", None) is not None
    ]
    return sum(t.numel() * t.element_size() for t in held) / unit


def step(schedule, rank: int, world: int, microbatches: int) -> None:
    """One training step of `schedule` on pipeline rank `rank`: the first rank feeds the batch,
    the last computes the loss, the others relay."""
    batch = torch.randn(microbatches * TOKENS, HIDDEN)
    if rank == 0:
        schedule.step(batch)
    elif rank == world - 1:
        # torchtitan 9dec370's call: no return_outputs=False, so the last stage keeps its outputs
        schedule.step(target=torch.zeros_like(batch), losses=[])
    else:
        schedule.step()


def count(rank: int, world: int, microbatches: int, port: str, results) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN))
    stage = PipelineStage(layers, rank, world, torch.device("cpu"))
    X = TOKENS * HIDDEN * 4
    seen: dict[str, float] = {}
    backward_one_chunk = stage.backward_one_chunk

    def first_backward(*args, **kwargs):
        if not seen:
            outputs = sum(
                o.numel() * o.element_size() for out, _ in stage.fwd_cache.values() for o in out
            )
            seen.update(
                in_flight=len(stage.fwd_cache),
                receive=buffer_units(stage.args_recv_info, X),
                gradient=buffer_units(stage.grad_recv_info, X),
                outputs=outputs / X,
            )
        return backward_one_chunk(*args, **kwargs)

    backwards = [0]

    def counted_backward(*args, **kwargs):
        # at the last backward with the first one's micro-batches in flight (that of
        # micro-batch M - in flight): what the finished micro-batches left behind (the last
        # stage's `output_chunks` beyond `fwd_cache`, the receive buffers' `.grad`)
        backwards[0] += 1
        if seen and backwards[0] == microbatches - seen["in_flight"] + 1:
            cached = {id(o) for out, _ in stage.fwd_cache.values() for o in out}
            kept = [
                o
                for out in stage.output_chunks
                for o in (out if isinstance(out, tuple) else (out,))
                if id(o) not in cached
            ]
            grads = [
                info.buffer.grad
                for recv in stage.args_recv_info.values()
                for info in recv
                if getattr(info, "buffer", None) is not None and info.buffer.grad is not None
            ]
            seen.update(
                latest_in_flight=len(stage.fwd_cache),
                finished_outputs=sum(o.numel() * o.element_size() for o in kept) / X,
                input_gradients=sum(g.numel() * g.element_size() for g in grads) / X,
            )
        return first_backward(*args, **kwargs)

    stage.backward_one_chunk = counted_backward
    schedule = Schedule1F1B(
        stage, n_microbatches=microbatches, loss_fn=lambda out, target: out.pow(2).mean()
    )
    step(schedule, rank, world, microbatches)
    results[rank] = dict(seen)
    dist.destroy_process_group()


def count_interleaved(rank: int, world: int, microbatches: int, port: str, results) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    local = 2
    stages = []
    for chunk in range(local):
        layers = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN))
        stages.append(
            PipelineStage(layers, chunk * world + rank, world * local, torch.device("cpu"))
        )
    finished = [0] * local
    best: dict[str, object] = {"held": -1, "counts": None}

    def counted(chunk: int, backward_one_chunk):
        def wrapped(*args, **kwargs):
            in_flight = [len(stage.fwd_cache) for stage in stages]
            if sum(in_flight) >= best["held"]:
                best["held"] = sum(in_flight)
                best["counts"] = [[in_flight[c], finished[c]] for c in range(local)]
            finished[chunk] += 1
            return backward_one_chunk(*args, **kwargs)

        return wrapped

    for chunk, stage in enumerate(stages):
        stage.backward_one_chunk = counted(chunk, stage.backward_one_chunk)
    schedule = ScheduleInterleaved1F1B(
        stages, n_microbatches=microbatches, loss_fn=lambda out, target: out.pow(2).mean()
    )
    step(schedule, rank, world, microbatches)
    X = TOKENS * HIDDEN * 4
    buffers = [
        [buffer_units(stage.args_recv_info, X), buffer_units(stage.grad_recv_info, X)]
        for stage in stages
    ]
    results[rank] = {"counts": best["counts"], "buffers": buffers}
    dist.destroy_process_group()


def measure_interleaved(ranks: int = 2) -> dict[int, dict[int, dict]]:
    import torch.multiprocessing as mp

    measured: dict[int, dict[int, dict]] = {}
    for microbatches in (3, 4, 6):
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(count_interleaved, args=(ranks, microbatches, "29619", results), nprocs=ranks)
            measured[microbatches] = {r: dict(results[r]) for r in range(ranks)}
    return measured


def main_interleaved(check: bool) -> int:
    from ckplan.model.frameworks import torch_interleaved_chunk_counts

    failures = 0
    for microbatches, by_rank in measure_interleaved().items():
        for rank, seen in sorted(by_rank.items()):
            counts = seen["counts"]
            walked = [list(c) for c in torch_interleaved_chunk_counts(2, 2, microbatches, rank)]
            # each local stage's own receive and gradient buffers, one per micro-batch
            expected = [
                [0 if stage == 0 else microbatches, 0 if stage == 3 else microbatches]
                for stage in (rank, rank + 2)
            ]
            print(
                f"{microbatches} micro-batches, rank {rank}: (in flight, finished) {counts}, "
                f"ckplan {walked}; (receive, gradient) buffers {seen['buffers']}, ckplan "
                f"{expected}"
            )
            failures += counts != walked or seen["buffers"] != expected
    return 1 if check and failures else 0


def measure(stages: int = STAGES, microbatches: int = MICROBATCHES) -> dict[int, dict[str, float]]:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(count, args=(stages, microbatches, "29617", results), nprocs=stages)
        return {rank: dict(results[rank]) for rank in range(stages)}


def ckplan_units(rank: int, stages: int, microbatches: int, in_flight: int) -> int:
    from ckplan.model.frameworks import torch_pipeline_buffer_bytes

    return torch_pipeline_buffer_bytes(microbatches, in_flight, 1, 1, rank == 0, rank == stages - 1)


def main(check: bool) -> int:
    measured = measure()
    failures = 0
    for rank, seen in sorted(measured.items()):
        in_flight = int(seen["in_flight"])
        held = seen["gradient"] + seen["outputs"] + max(0.0, seen["receive"] - in_flight)
        predicted = ckplan_units(rank, STAGES, MICROBATCHES, in_flight)
        print(
            f"rank {rank}: in flight {in_flight}, receive {seen['receive']:g}, gradient "
            f"{seen['gradient']:g}, outputs {seen['outputs']:g}; beyond the in-flight inputs "
            f"{held:g} X, ckplan {predicted} X"
        )
        failures += held != predicted
        # PyTorch 2.13 keeps the last stage's finished outputs only (the output part of the
        # late-2024 term, frameworks.torch_pipeline_finished_bytes)
        from ckplan.model.frameworks import torch_pipeline_finished_bytes

        last = rank == STAGES - 1
        kept = torch_pipeline_finished_bytes(MICROBATCHES, in_flight, 0, 1, True) if last else 0
        print(
            f"  at the backward of micro-batch {MICROBATCHES - in_flight}: finished outputs "
            f"{seen['finished_outputs']:g} X (ckplan {kept} X), input gradients "
            f"{seen['input_gradients']:g} X"
        )
        failures += seen["finished_outputs"] != kept
    return 1 if check and failures else 0


if __name__ == "__main__":
    if "--interleaved" in sys.argv[1:]:
        if "--json" in sys.argv[1:]:
            import json

            print(json.dumps(measure_interleaved()))
            sys.exit(0)
        sys.exit(main_interleaved("--check" in sys.argv[1:]))
    if "--json" in sys.argv[1:]:
        import json

        print(json.dumps(measure()))
        sys.exit(0)
    sys.exit(main("--check" in sys.argv[1:]))
