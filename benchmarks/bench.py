"""`make bench`: the planner's hot paths side by side with what they are measured against
(never asserted in tests; docs/performance.md records the figures and the machine).

1. CLI start-up: `ckplan estimate PRESET` against a Typer app with the same options.
2. The optimal DP at L = 32/64/128/256 layers x 500 slots against its first implementation
   (`schedules.rotor_reference`), same schedules checked step for step; the mixed DP
   (`sac+mixed`) beside it.
3. Revolve against the `checkpoint-schedules` package (installed in the bench venv only).
4. Sweeps, the pipelined DP and very deep stages.

Times are the best (least loaded) of several runs, in seconds, with the median beside it.
`python benchmarks/bench.py --quick` runs fewer repeats.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The reference DP is a test oracle (tests/oracles/), compared with here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_schedules import COPY_FLOPS_PER_BYTE, transformer_chain
from oracles.rotor_reference import optimal_schedule as reference_schedule

from ckplan.hardware.step_time import step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.plan import evaluate, in_flight_microbatches, layer_chain, parse_strategy
from ckplan.plan.search import DEFAULT_RESERVE, sweep
from ckplan.schedules import (
    Chain,
    pipeline_peak_bytes,
    revolve_min_forwards,
    revolve_schedule,
    simulate,
    store_all_schedule,
)
from ckplan.schedules.offload import optimal_offload_schedule
from ckplan.schedules.rotor import optimal_schedule

GB = 10**9
HERE = Path(__file__).resolve().parent
QUICK = "--quick" in sys.argv


def timed(function, *args, repeats: int = 3) -> tuple[float, float, object]:
    """(best, median, last result) of `repeats` runs of `function(*args)`."""
    samples, result = [], None
    for _ in range(1 if QUICK else repeats):
        start = time.perf_counter()
        result = function(*args)
        samples.append(time.perf_counter() - start)
    return min(samples), statistics.median(samples), result


def seconds(best: float, median: float) -> str:
    return f"{best:8.3f} ({median:.3f})"


def machine() -> None:
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",) * 3
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}; times: best (median), seconds"
    )


def startup() -> None:
    print("\n1. CLI start-up (a fresh process each run)")
    python = sys.executable
    ckplan = str(Path(python).with_name("ckplan"))
    cases = {
        "python -c pass": [python, "-c", "pass"],
        "floor: Typer app, estimate's options": [
            python,
            str(HERE / "typer_floor.py"),
            "estimate",
            "llama3-8b",
        ],
        "ckplan estimate llama3-8b": [ckplan, "estimate", "llama3-8b"],
        "ckplan estimate llama3-8b --json": [ckplan, "estimate", "llama3-8b", "--json"],
    }
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(3 if QUICK else 15):  # interleaved, so that load hits every case alike
        for name, command in cases.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run(command, capture_output=True, check=True)
            wall[name].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    floor = "floor: Typer app, estimate's options"
    print(f"  {'':<44} {'wall':>18} {'CPU':>8}  best against the floor (wall, CPU)")
    for name in cases:
        ratio = ""
        if "ckplan" in name:
            by_wall = min(wall[name]) / min(wall[floor])
            ratio = f"{by_wall:5.2f}x {min(cpu[name]) / min(cpu[floor]):5.2f}x"
        print(
            f"  {name:<44} {seconds(min(wall[name]), statistics.median(wall[name]))} "
            f"{min(cpu[name]):8.3f}  {ratio}"
        )


def dp() -> None:
    import numpy  # noqa: F401 (imported once, before the timings)

    print("\n2. Optimal DP, transformer chain (embedding, L layers, output), budget 25% of")
    print("   store-all, 500 slots: the fast DP against rotor_reference, schedules compared")
    print(f"  {'chain':<34} {'fast':>18} {'reference':>18} {'speed-up':>9}  same")
    for layers in (32, 64, 128, 256):
        chain = transformer_chain(layers)
        budget = simulate(chain, store_all_schedule(chain)).peak_bytes // 4
        label = f"L = {layers} ({chain.length} stages)"
        _dp_row(label, chain, budget, 500, 1, 1 if layers > 128 else 3)
    # The DP's worst case: no two sub-chains alike (no class sharing), as for custom chains.
    rng = random.Random(1)
    n = 130
    inputs = [rng.randint(1, 10**9) for _ in range(n + 1)]
    tapes = [inputs[i] + rng.randint(0, 10**10) for i in range(n)]
    forward = [rng.randint(1, 10**12) for _ in range(n)]
    chain = Chain(forward, [2 * x for x in forward], inputs, tapes)
    budget = simulate(chain, store_all_schedule(chain)).peak_bytes // 4
    _dp_row("130 stages, all unequal", chain, budget, 500, 1, 1)
    spec = load_spec("llama3-70b", {"tp": 8, "pp": 2, "sp": True, "microbatches": 16})
    chain = layer_chain(spec, False)
    in_flight = in_flight_microbatches(spec)
    top = pipeline_peak_bytes(chain, simulate(chain, store_all_schedule(chain)), in_flight)
    _dp_row("llama3-70b pp2 stage, 2 in flight", chain, int(top * 0.3), 1000, in_flight, 3)
    print("\n   The joint DP over {keep, offload, recompute} (schedules.offload) on the same")
    print("   transformer chains and budgets, a copy at bench_schedules' PCIe Gen4 rate, against")
    print("   the optimal DP above (the target: within 2x)")
    print(f"  {'chain':<34} {'joint':>18} {'optimal':>18} {'ratio':>9}")
    for layers in (32, 128):
        chain = transformer_chain(layers)
        budget = simulate(chain, store_all_schedule(chain)).peak_bytes // 4
        copy = [int(t * COPY_FLOPS_PER_BYTE) for t in chain.tape_bytes]
        joint_best, joint_median, _ = timed(
            optimal_offload_schedule, chain, budget, copy, None, 500, repeats=3
        )
        rotor_best, rotor_median, _ = timed(optimal_schedule, chain, budget, 500, 1, repeats=3)
        print(
            f"  {f'L = {layers} ({chain.length} stages)':<34} "
            f"{seconds(joint_best, joint_median)} {seconds(rotor_best, rotor_median)} "
            f"{joint_best / rotor_best:8.2f}x"
        )


def mixed_dp() -> None:
    """The mixed DP (`sac+mixed`: full tape, torchtitan's policy's tape or recompute, per layer)
    beside the rotor DP on the full chain, Llama-3-8B layers at 8k tokens, budget 25% of
    store-all, 500 slots; and `sweep --gpu` on the docs' layout, which runs it once."""
    from ckplan.inputs.gpus import load_gpu
    from ckplan.model.op_policy import TORCHTITAN_POLICY
    from ckplan.schedules.policy_mix import optimal_mixed_schedule

    print("\n2b. Mixed DP (sac+mixed) against the rotor DP on the full chain, 500 slots")
    print(f"  {'chain':<34} {'mixed':>18} {'rotor':>18} {'ratio':>9}")
    for layers in (32, 64, 126):
        spec = load_spec("llama3-8b", {"framework": "torchtitan", "seq": 8192, "layers": layers})
        full, policy = layer_chain(spec, ()), layer_chain(spec, (TORCHTITAN_POLICY,))
        budget = simulate(full, store_all_schedule(full)).peak_bytes // 4
        repeats = 1 if layers > 64 else 3
        mixed = timed(optimal_mixed_schedule, (full, policy), budget, 500, repeats=repeats)
        rotor = timed(optimal_schedule, full, budget, 500, repeats=repeats)
        print(
            f"  {f'L = {layers} ({full.length} stages)':<34} {seconds(*mixed[:2])} "
            f"{seconds(*rotor[:2])} {mixed[0] / rotor[0]:8.1f}x"
        )
    spec = load_spec(
        "llama3-8b",
        {"framework": "torchtitan", "seq": 16384, "micro_batch": 2, "dp": 8, "zero": 3},
    )
    gpu = load_gpu("h100-sxm")
    best, median, _ = timed(partial(sweep, gpu=gpu), spec, gpu.memory_bytes, DEFAULT_RESERVE)
    print(f"  {'sweep --gpu h100-sxm, llama3-8b 16k':<44} {seconds(best, median)}")


def _dp_row(label, chain, budget, slots, in_flight, repeats) -> None:
    args = (chain, budget, slots, in_flight)
    fast_best, fast_median, fast = timed(optimal_schedule, *args, repeats=repeats)
    ref_best, ref_median, ref = timed(reference_schedule, *args, repeats=repeats)
    same = (fast is None) == (ref is None) and (fast is None or fast.steps == ref.steps)
    print(
        f"  {label:<34} {seconds(fast_best, fast_median)} {seconds(ref_best, ref_median)} "
        f"{ref_best / fast_best:8.1f}x  {'yes' if same else 'NO'}"
    )


def revolve() -> None:
    print("\n3. Revolve (binomial) schedules: ckplan against checkpoint-schedules")
    try:
        import checkpoint_schedules as cs
    except ImportError:
        print("  checkpoint-schedules is not installed: `make bench` installs it in .venv-bench")
        return
    from importlib.metadata import version

    print(f"  checkpoint-schedules {version('checkpoint-schedules')}: ", end="")
    print("MultistageCheckpointSchedule(n, s, 0) (binomial) and")
    print("  Revolve(n, s) (H-Revolve's DP; 30 s limit), forwards counted over the whole run")
    print(
        f"  {'n, slots':<14} {'ckplan build':>18} {'+ replay':>18} {'cs multistage':>18} "
        f"{'cs Revolve':>12}  forwards equal"
    )
    for n, slots in ((1000, 10), (10000, 10), (10000, 100)):
        chain = Chain.uniform(n, forward_flops=1, backward_flops=2, input_bytes=1, tape_bytes=3)
        build = timed(revolve_schedule, chain, slots)
        replay = timed(_revolve_replay, chain, slots)
        ours = sum(1 for step in build[2] if step.kind != "backward")
        multi = timed(_cs_forwards, n, slots, cs)
        full = _cs_revolve_seconds(n, slots)
        equal = ours == multi[2] == n + revolve_min_forwards(n, slots)
        print(
            f"  {f'{n:,}, {slots}':<14} {seconds(build[0], build[1])} "
            f"{seconds(replay[0], replay[1])} {seconds(multi[0], multi[1])} {full:>12}  "
            f"{'yes' if equal else 'NO'} ({ours:,})"
        )


def _revolve_replay(chain: Chain, slots: int):
    return simulate(chain, revolve_schedule(chain, slots))


def _cs_forwards(n: int, slots: int, cs) -> int:
    forwards = 0
    for action in cs.MultistageCheckpointSchedule(n, slots, 0):
        if isinstance(action, cs.Forward):
            forwards += len(action)
        elif isinstance(action, cs.EndReverse):
            return forwards
    return forwards


def _cs_revolve_seconds(n: int, slots: int, limit: float = 30.0) -> str:
    code = (
        "import time, checkpoint_schedules as cs\n"
        "start = time.perf_counter()\n"
        f"for action in cs.Revolve({n}, {slots}):\n"
        "    if isinstance(action, cs.EndReverse): break\n"
        "print(time.perf_counter() - start)\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=limit
        )
    except subprocess.TimeoutExpired:
        return f"> {limit:.0f} s"
    return f"{float(done.stdout):8.3f}" if done.returncode == 0 else "error"


def sweeps() -> None:
    print("\n4. Sweeps (every candidate plan, the optimal DP twice) and very deep stages")
    pp4 = {"tp": 8, "pp": 4, "sp": True, "microbatches": 16}
    cases = [
        ("llama3-70b tp8 pp4, 80GB", "llama3-70b", pp4, 80),
        ("llama3-70b tp8 pp4, 50GB (optimal wins)", "llama3-70b", pp4, 50),
        ("llama3-70b tp8, 80GB", "llama3-70b", {"tp": 8, "sp": True}, 80),
        (
            "llama3-405b tp8, 128 layers, 80GB",
            "llama3-405b",
            {"tp": 8, "sp": True, "layers": 128},
            80,
        ),
    ]
    deepseek = {"ep": 64, "dp": 128, "pp": 16, "first_stage_layers": 1, "zero": 1}
    cases.append(("deepseek-v3 pp16 ep64 (mixed layers), 80GB", "deepseek-v3", deepseek, 80))
    # every plan's launcher ranges and offload replays over one deep stage (Megatron-LM's preset)
    cases.append(("megatron-22b x 4,096 layers, 80GB", "megatron-22b", {"layers": 4096}, 80))
    for label, preset, overrides, budget in cases:
        best, median, _ = timed(sweep, load_spec(preset, overrides), budget * GB)
        print(f"  {'sweep ' + label:<44} {seconds(best, median)}")
    for layers in (2000, 10000, 100000):
        spec = load_spec("gpt2", {"layers": layers})
        none = evaluate(spec, parse_strategy("none", spec))
        budget = none.model_states.total + none.activation_bytes // 4 + DEFAULT_RESERVE
        best, median, _ = timed(sweep, spec, budget, repeats=1)
        label = f"sweep gpt2 x {layers:,} layers, 25% activations"
        print(f"  {label:<44} {seconds(best, median)}")
        optimal = parse_strategy("optimal", spec)
        activations = none.activation_bytes // 4
        best, median, _ = timed(evaluate, spec, optimal, "derived", activations, repeats=1)
        label = f"estimate --strategy optimal, {layers:,} layers"
        print(f"  {label:<44} {seconds(best, median)}")


def time_model() -> None:
    print("\n5. Step-time model (roofline per op, ckplan.hardware)")
    tp8 = load_spec("llama3-70b", {"tp": 8, "pp": 4, "sp": True, "microbatches": 16})
    h100 = load_gpu("h100-sxm")
    best, median, _ = timed(sweep, tp8, 80 * GB, DEFAULT_RESERVE, "derived", 500, h100)
    print(f"  {'sweep llama3-70b tp8 pp4, --gpu h100-sxm':<44} {seconds(best, median)}")
    plan = evaluate(tp8, parse_strategy("selective", tp8))
    step_time(plan, h100)  # per-layer times cached per (spec, gpu)
    best, median, _ = timed(lambda: [step_time(plan, h100) for _ in range(1000)])
    print(f"  {'step_time x 1000 (cached layer times)':<44} {seconds(best, median)}")


def profiles() -> None:
    print("\n6. Kernel profiles and ckplan calibrate")
    eager = load_spec("llama3-70b", {"tp": 8, "pp": 4, "sp": True, "profile": "torch-sdpa"})
    best, median, _ = timed(sweep, eager, 80 * GB, repeats=1)
    print(f"  {'sweep llama3-70b tp8 pp4, --profile torch-sdpa':<44} {seconds(best, median)}")
    if importlib.util.find_spec("torch") is None:
        print("  ckplan calibrate: torch is not installed in this environment")
        return
    calibrate = [sys.executable, "-m", "ckplan", "calibrate", "llama3-8b", "--json"]
    best, median, _ = timed(
        lambda: subprocess.run(calibrate, capture_output=True, check=True), repeats=1
    )
    print(f"  {'ckplan calibrate llama3-8b (torch, CPU)':<44} {seconds(best, median)}")


def layout_search() -> None:
    print("\n7. Layout search (ckplan plan): layouts enumerated per second, whole searches")
    from ckplan.plan.layout.search import search_layouts

    h100, rtx = load_gpu("h100-sxm"), load_gpu("rtx-4090")
    cases = [
        ("llama3-70b", 64, 512),
        ("llama3-405b", 16384, 2048),
        ("megatron-1t", 3072, 3072),
    ]
    # where an offload plan is the fastest (ckplan.plan.offload): a second search without
    # offload plans names the fastest layout that does not offload
    offloading = [("llama3-70b", 32, 32, h100, 32768), ("llama3-8b", 16, 16, rtx, 16384)]
    runs = [(model, gpus, batch, h100, 8192) for model, gpus, batch in cases] + offloading
    for model, gpus, batch, gpu, seq in runs:
        spec = load_spec(model, {"seq": seq} if model.startswith("llama") else {})
        best, median, result = timed(
            search_layouts, spec, gpus, gpu, batch, gpu.memory_bytes, repeats=2
        )
        counts = result.counts
        label = f"plan {model} --gpus {gpus:,} --global-batch {batch:,}"
        if gpu is not h100:
            label += f" --gpu {gpu.name}"
        if model.startswith("llama") and seq != 8192:
            label += f" --seq {seq}"
        print(
            f"  {label:<52} {seconds(best, median)}  {counts['layouts']:>7,} layouts, "
            f"{counts['layouts'] / best:>9,.0f} layouts/s, {counts['evaluated']:,} evaluated, "
            f"{counts.get('optimal', 0):,} DPs"
        )


def auto() -> None:
    print("\n8. --seq auto / --micro-batch auto (a binary search of plans, sweeps or layouts)")
    from ckplan.plan.layout.search import longest_seq_layouts
    from ckplan.plan.search import largest_fitting, largest_fitting_any

    rtx = load_gpu("rtx-4090")
    qlora = load_spec("llama3-8b", {"training": "qlora"})
    usable = rtx.memory_bytes - DEFAULT_RESERVE
    for name in ("full", "optimal"):
        strategy = parse_strategy(name, qlora)
        best, median, _ = timed(largest_fitting, qlora, strategy, usable, "seq", rtx)
        print(f"  {'estimate llama3-8b qlora --seq auto -s ' + name:<52} {seconds(best, median)}")
    best, median, _ = timed(
        largest_fitting_any, qlora, rtx.memory_bytes, DEFAULT_RESERVE, "seq", rtx, repeats=1
    )
    print(f"  {'largest seq any plan fits, llama3-8b qlora rtx-4090':<52} {seconds(best, median)}")
    tp8 = load_spec("llama3-70b", {"tp": 8, "pp": 4, "sp": True, "microbatches": 16})
    best, median, _ = timed(
        largest_fitting_any, tp8, 80 * GB, DEFAULT_RESERVE, "micro_batch", repeats=1
    )
    print(
        f"  {'largest micro-batch any plan fits, llama3-70b tp8 pp4':<52} {seconds(best, median)}"
    )
    h100 = load_gpu("h100-sxm")
    for model, gpus in (("llama3-8b", 8), ("llama3-70b", 64)):
        spec = load_spec(model, {})
        best, median, _ = timed(
            longest_seq_layouts, spec, gpus, h100, gpus, h100.memory_bytes, repeats=1
        )
        print(f"  {f'plan {model} --gpus {gpus} --seq auto':<52} {seconds(best, median)}")


def policy_search() -> None:
    print("\n9. Best per-op policy: layer-level and scoped frontiers (ckplan.plan.policy_search)")
    from ckplan.model.layers import distinct_kinds
    from ckplan.plan.policy_search import policy_frontier, scoped_frontier

    h100 = load_gpu("h100-sxm")
    layout = {"framework": "torchtitan", "kernels": "eager", "tp": 2, "sp": True, "pp": 16,
              "first_stage_layers": 1, "microbatches": 32, "ep": 64, "dp": 64,
              "zero": 3}  # fmt: skip
    spec = load_spec("deepseek-v3", layout)
    kind = next(k for k in distinct_kinds(spec) if k.moe)
    for label, search in (("layer-level", policy_frontier), ("scoped", scoped_frontier)):
        best, median, points = timed(lambda s=search: s(spec, h100, kind), repeats=1)
        name = f"deepseek-v3 MoE layer, {label} ({len(points)} points)"
        print(f"  {name:<44} {seconds(best, median)}")


def main() -> None:
    machine()
    startup()
    dp()
    mixed_dp()
    revolve()
    sweeps()
    time_model()
    profiles()
    layout_search()
    auto()
    policy_search()


if __name__ == "__main__":
    main()
