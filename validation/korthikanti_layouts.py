"""The layout search against Korthikanti et al. (2022), Table 3 (docs/validation.md).

Given each configuration's GPU count and global batch (22B: 8 GPUs, batch 4; 175B: 64, 64;
530B: 280, 280; 1T: 512, 512; seq 2048, A100 80GB, the presets megatron-*), `ckplan plan`
must list the published layout (TP 8 and PP 1/8/35/64, no data parallelism, micro-batch 4
for 22B and 1 otherwise; the 530B and 175B interleaved over 3 virtual stages as the presets
say, §6) among the layouts that fit. For each: the published layout's best plan and
predicted step time (the search restricted to it with --set), its rank among all fitting
layouts (the search with a cutoff at its time lists every faster one), and the search's
fastest layout.

    python validation/korthikanti_layouts.py
"""

from __future__ import annotations

import time

from ckplan.inputs.gpus import load_gpu
from ckplan.inputs.presets import load_spec
from ckplan.plan.layout.search import search_layouts
from ckplan.plan.search import DEFAULT_RESERVE
from ckplan.render.layouts import layout_text

# (preset, GPUs, global batch, the published layout's keys)
CONFIGS = [
    ("megatron-22b", 8, 4, {"tp": 8, "pp": 1, "cp": 1, "micro_batch": 4, "sp": True}),
    ("megatron-175b", 64, 64, {"tp": 8, "pp": 8, "cp": 1, "micro_batch": 1, "sp": True}),
    ("megatron-530b", 280, 280, {"tp": 8, "pp": 35, "cp": 1, "micro_batch": 1, "sp": True}),
    ("megatron-1t", 512, 512, {"tp": 8, "pp": 64, "cp": 1, "micro_batch": 1, "sp": True}),
]


def main() -> None:
    gpu = load_gpu("a100-80gb")
    budget = gpu.memory_bytes
    print(
        "| model | GPUs, batch | published layout (its best plan) | step, s | rank | "
        "fitting faster | our fastest layout (plan) | step, s | search, s |"
    )
    print("|---|---|---|---:|---:|---:|---|---:|---:|")
    for preset, gpus, batch, keys in CONFIGS:
        spec = load_spec(preset)
        keys = {**keys, "virtual_stages": spec.virtual_stages}
        start = time.perf_counter()
        best = search_layouts(spec, gpus, gpu, batch, budget, DEFAULT_RESERVE, top=1)
        elapsed = time.perf_counter() - start
        published = search_layouts(
            spec, gpus, gpu, batch, budget, DEFAULT_RESERVE, top=1, constraints=keys
        )
        if not published.layouts:
            print(f"| {preset} | {gpus}, {batch} | does not fit | | | | | | |")
            continue
        ours = published.layouts[0]
        faster = search_layouts(
            spec, gpus, gpu, batch, budget, DEFAULT_RESERVE, top=10**9,
            cutoff=ours.seconds * (1 - 1e-12),
        )  # fmt: skip
        rank = len(faster.layouts) + 1
        top = best.layouts[0]
        print(
            f"| {preset} | {gpus}, {batch} | {layout_text(ours.layout, ours.spec)} "
            f"({ours.plan.strategy}) | {ours.seconds:.2f} | {rank} | {rank - 1} | "
            f"{layout_text(top.layout, top.spec)} ({top.plan.strategy}) | {top.seconds:.2f} | "
            f"{elapsed:.1f} |"
        )


if __name__ == "__main__":
    main()
