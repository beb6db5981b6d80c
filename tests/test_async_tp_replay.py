"""The 2-D torchtitan step with and without plain sequence-parallel TP's reordering copies
(validation/async_tp_allocator_replay.py): the copies counted on fake ranks at a small shape,
and the 70B replay's recorded peaks
(validation/results-async-tp-allocator-replay-torch-2.13.0.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from needs_frameworks import framework_or_skip
from needs_torch import torch_or_skip

ROOT = Path(__file__).resolve().parent.parent
RESULTS = json.loads(
    (ROOT / "validation" / "results-async-tp-allocator-replay-torch-2.13.0.json").read_text()
)
GIB = 2**30


def test_the_70b_replay_keeps_the_allocated_peak_and_lowers_the_reserved():
    plain, fused = RESULTS["plain"], RESULTS["fused"]
    assert RESULTS["layers"] == 80
    # the peak is the loss's backward, where no block runs: the same allocated bytes
    assert plain["allocated_peak"] == fused["allocated_peak"]
    # 69,212,307,456 - 68,415,389,696 = 796,917,760 bytes, 0.74 GiB of the table's 4.3 GiB
    assert plain["reserved_peak"] - fused["reserved_peak"] == 796917760
    assert 0.7 * GIB < plain["reserved_peak"] - fused["reserved_peak"] < 0.8 * GIB


def test_the_blocks_reorder_every_sequence_gather_and_scatter_once():
    """Two steps of two blocks at b = 2, s = 256, h = 512 (bf16): each reordering copy is
    b·s·h·2 = 524,288 bytes. Per block and step the blocks gather along the sequence six times
    (attention and feed-forward inputs in the forward and again in the recomputation, wo's and
    w2's output gradients in the backward) and scatter five times (wo and w2 in the forward, wo
    in the recomputation, which stops once the tensors the backward needs are rebuilt, and the
    two column-parallel input gradients in the backward): 2 x 2 x 11 = 44 copies the emulation
    replaces by views, 23,068,672 bytes."""
    torch_or_skip()
    framework_or_skip("torchtitan", "the replay was not rerun")
    framework_or_skip("transformers", "the replay was not rerun")
    code = (
        "import sys; sys.path.insert(0, 'validation');"
        "import fsdp2_tp_allocator_replay as r, async_tp_allocator_replay as a;"
        "small = dict(dim=512, heads=8, kv_heads=8, ffn=1024, vocab=8192);"
        "r_trace = r.trace_step;"
        "r.trace_step = lambda kind, layers: r_trace(kind, layers, 'full', 2, 256, small);"
        "a.trace_step = r.trace_step;"
        "total = lambda events: sum(e[2] for e in events if e[0] == 'alloc');"
        "a.trace(2, True);"  # the first trace of a process allocates once more (2 MiB)
        "print(total(a.trace(2, False)[0]) - total(a.trace(2, True)[0]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[-1]) == 44 * 2 * 256 * 512 * 2
