"""The simple formula set (`--formula simple`; `seed`, its old name, is accepted): the
back-of-the-envelope estimates a planner starts from, kept so that their numbers can be set
beside ckplan's derived ones.

Each is a simplification, on purpose: a layer stores 12 bytes per hidden value per token whatever
its architecture (12·s·b·h·B: no attention matrix, no vocabulary, no MLP width); after
checkpointing every K layers, the stored inputs of the segments and one segment's activations,
(n_seg + K)·s·b·h·B (true only when a layer keeps nothing but its input); any checkpointing costs
one extra forward (overhead 4/3 - 1); recomputing the attention costs a fixed 15% of a layer's
forward (its share at s = h = 8192 with F = 4h); the segment size K = round(sqrt(L)) (Chen et
al. 2016); and a rule of thumb for what to recompute. The default `derived` formula set replaces
each with the architecture's own numbers, op by op.
"""

from __future__ import annotations

import math

ATTENTION_FRACTION = 0.15
MB = 10**6


def activation_memory_mb(n_layers, hidden=8192, seq=8192, batch=1, bytes_per_value=2):
    """L layers of 12·s·b·h·B bytes, in MB (10^6)."""
    per_layer = 12 * batch * seq * hidden * bytes_per_value
    return n_layers * per_layer / MB


def memory_after_checkpoint(
    n_layers, segment_size, hidden=8192, seq=8192, batch=1, bytes_per_value=2
):
    """(n_seg + K) layer inputs of s·b·h·B bytes, in MB, n_seg = max(1, L // K)."""
    n_seg = max(1, n_layers // segment_size)
    saved = (n_seg + segment_size) * 1 * batch * seq * hidden * bytes_per_value
    return saved / MB


def checkpoint_cost(n_layers, segment_size, flops_per_layer=1.0):
    """any segment size costs one extra forward of every layer; overhead 4/3 - 1."""
    return _cost(n_layers * flops_per_layer, n_layers * flops_per_layer)


def selective_checkpoint_cost(n_layers, attention_fraction=ATTENTION_FRACTION, flops_per_layer=1.0):
    """recompute the attention share of each layer; overhead (3 + 0.15)/3 - 1 = 5%."""
    return _cost(n_layers * flops_per_layer, n_layers * attention_fraction * flops_per_layer)


def _cost(forward, recompute):
    """The cost record: backward = 2x forward, overhead against no checkpointing."""
    backward = 2 * forward
    total = forward + recompute + backward
    return {
        "fwd": forward,
        "recompute": recompute,
        "bwd": backward,
        "total": total,
        "overhead_vs_no_ckpt": total / (forward + backward) - 1.0,
    }


def optimal_segment(n_layers):
    """K = round(sqrt(L)) (Chen et al. 2016, §4.1: sqrt(n) segments)."""
    return round(math.sqrt(n_layers))  # half to even, as Python's round(np.sqrt(L))


def should_recompute(layer_type, activation_bytes, recompute_flops_ratio):
    """A rule of thumb: recompute attention above 100 MB of activations; an FFN above 500 MB
    only when recomputing it costs under 10% extra."""
    if layer_type == "attention" and activation_bytes > 100 * MB:
        return True
    if layer_type == "ffn" and activation_bytes > 500 * MB:
        return recompute_flops_ratio < 0.1
    return False
