"""`make bench`: wall time of the planner's hot paths (never asserted in tests).

Prints one line per case: median of several runs, in seconds.
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ckplan.io.presets import load_spec
from ckplan.plan import evaluate, layer_chain, parse_strategy
from ckplan.plan.search import sweep
from ckplan.schedules import optimal_schedule

GB = 10**9


def timed(label: str, function, repeats: int = 3) -> None:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    print(f"{label:<60} {statistics.median(samples):8.3f} s")


def main() -> None:
    llama = load_spec("llama3-8b")
    timed("estimate llama3-8b (none)", lambda: evaluate(llama, parse_strategy("none", llama)))
    timed(
        "estimate llama3-8b (uniform:4)",
        lambda: evaluate(llama, parse_strategy("uniform:4", llama)),
    )
    tp8 = load_spec("llama3-70b", {"tp": 8, "pp": 4, "sp": True, "microbatches": 16})
    timed("sweep llama3-70b tp8 pp4, 80GB", lambda: sweep(tp8, 80 * GB), repeats=1)
    deep = load_spec("llama3-405b", {"layers": 128, "tp": 8, "sp": True})
    chain = layer_chain(deep, selective=False)
    budget = sum(chain.tape_bytes) // 4
    timed(
        f"optimal DP, {chain.length} stages x 500 slots",
        lambda: optimal_schedule(chain, budget, 500),
        repeats=1,
    )
    timed(
        f"optimal DP, {chain.length} stages x 1000 slots",
        lambda: optimal_schedule(chain, budget, 1000),
        repeats=1,
    )
    eager = load_spec("llama3-70b", {"tp": 8, "pp": 4, "sp": True, "profile": "torch-sdpa"})
    timed(
        "sweep llama3-70b tp8 pp4, 80GB, --profile torch-sdpa",
        lambda: sweep(eager, 80 * GB),
        repeats=1,
    )
    if importlib.util.find_spec("torch") is not None:
        calibrate = [sys.executable, "-m", "ckplan", "calibrate", "llama3-8b", "--json"]
        timed(
            "ckplan calibrate llama3-8b (torch, CPU)",
            lambda: subprocess.run(calibrate, capture_output=True, check=True),
            repeats=1,
        )
    cli = [sys.executable, "-m", "ckplan", "presets", "gpt2", "--json"]
    timed(
        "CLI start-up: ckplan presets gpt2 --json",
        lambda: subprocess.run(cli, capture_output=True, check=True),
    )
    extra = Path(__file__).with_name("bench_schedules.py")
    if extra.exists():
        subprocess.run([sys.executable, str(extra)], check=True)


if __name__ == "__main__":
    main()
