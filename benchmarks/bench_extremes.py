"""Time commands at the ends of the documented ranges (README "Ranges"), in-process.

Not part of `make bench` (some rows take seconds by design); run it when limits or ranges change:
`.venv/bin/python benchmarks/bench_extremes.py [substring ...]` (substrings select rows).
"""

import contextlib
import io
import sys
import time

from ckplan.cli import main

DEEP = "gpt2 --layers 100000"
HUGE = (
    "gpt2 --set hidden=1048576 --set heads=65536 --set seq=16777216 --set vocab=16777216 "
    "--set micro_batch=1048576 --set ffn_hidden=4194304"
)
PARALLEL = (
    "gpt2 --set tp=4 --set sp=true --set pp=12 --set dp=16777216 --set zero=3 --set cp=1024 "
    "--set seq=1048576 --set microbatches=1048576"
)
# Layers that alternate kinds (schedules/periodic.py): every other layer MoE, every third.
ALTERNATING = "gpt2 --layers 100000 --set experts=8 --set moe_layers=0-:2"
CASES = {
    "L=100k none": f"estimate {DEEP}",
    "L=100k full": f"estimate {DEEP} --strategy full",
    "L=100k sqrt": f"estimate {DEEP} --strategy sqrt",
    "L=100k selective+uniform:7": f"estimate {DEEP} --strategy selective+uniform:7",
    "L=100k block:50000": f"estimate {DEEP} --strategy block:50000",
    "L=100k revolve:11": f"estimate {DEEP} --strategy revolve:11",
    "L=100k --json": f"estimate {DEEP} --json",
    "L=100k check full": f"check {DEEP} --budget 80GB --strategy full",
    "L=100k schedule full": f"schedule {DEEP} --strategy full",
    "L=100k schedule full --json": f"schedule {DEEP} --strategy full --json",
    "L=100k sweep --formula seed": f"sweep {DEEP} --budget 80GB --formula seed",
    "L=100k mlp sqrt": f"estimate {DEEP} --set kind=mlp --set micro_batch=1048576 -s sqrt",
    "largest shapes": f"estimate {HUGE}",
    "largest shapes selective --json": f"estimate {HUGE} -s selective --json --set dtype_bytes=8",
    "largest shapes optimal": f"estimate {HUGE} -s optimal --budget 1000000TB",
    "largest shapes sweep": f"sweep {HUGE} --budget 1000000TB",
    "largest shapes check": f"check {HUGE} --budget 80GB",
    "largest parallel": f"estimate {PARALLEL}",
    "largest parallel sweep": f"sweep {PARALLEL} --budget 80GB",
    "v=2^16": "estimate gpt2 --set layers=65536 --set virtual_stages=65536",
    "sweep L=512": "sweep gpt2 --budget 80GB --layers 512",
    "alternating L=100k sweep --json": f"sweep {ALTERNATING} --budget 40GB --json",
    "alternating L=100k optimal": f"estimate {ALTERNATING} --strategy optimal --budget 45TB",
    "alternating L=100k check": f"check {ALTERNATING} --budget 45TB",
    "alternating L=2000 optimal": (
        "estimate gpt2 --layers 2000 --set experts=8 --set moe_layers=0-:2 --strategy optimal "
        "--budget 900GB"
    ),
    "alternating every 3rd L=30000 sweep": (
        "sweep gpt2 --layers 30000 --set experts=8 --set moe_layers=0-:3 --budget 15TB --json"
    ),
    "alternating gemma2-9b sweep 200GB": "sweep gemma2-9b --budget 200GB --json",
    "alternating gemma2-9b L=20000 sweep 2TB": "sweep gemma2-9b --layers 20000 --budget 2TB",
    # the layout search on alternating layers (docs/performance.md, "Long alternating models")
    "alternating L=600 plan 64 GPUs batch 512": (
        "plan gpt2 --set layers=600 --set experts=8 --set moe_layers=0-:2 --gpus 64 "
        "--gpu h100-sxm --global-batch 512 --json"
    ),
    "alternating L=2000 plan 64 GPUs": (
        "plan gpt2 --set layers=2000 --set experts=8 --set moe_layers=0-:2 --gpus 64 "
        "--gpu h100-sxm --json"
    ),
}


def main_bench(selected: list[str]) -> None:
    for name, command in CASES.items():
        if selected and not any(text in name for text in selected):
            continue
        out, err = io.StringIO(), io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(command.split())
        seconds = time.perf_counter() - start
        print(f"{seconds:7.2f} s  exit {code}  {name}  {err.getvalue().strip()[:100]}", flush=True)


if __name__ == "__main__":
    main_bench(sys.argv[1:])
