"""A chain's stage times as NumPy arrays: `micro_batch_time` for long chains (a sweep or a
layout search times thousands of plans on chains of thousands of stages), with the same runs,
products and additions in the same order, so that the result is bit-identical. Imported only
for chains of `step_time.TABLE_MIN_STAGES` stages or more, so the CLI starts without NumPy."""

from __future__ import annotations

import numpy as np

from ckplan.hardware.roofline import OpTime
from ckplan.hardware.times import MicroBatchTime, StageTime


class StageTable:
    """A chain's stage times as arrays for `table_micro_batch_time`: `ids[i]` numbers stage
    i's StageTime (equal StageTimes share a number, so runs are what `groupby` finds), the
    other arrays hold each distinct StageTime's figures."""

    __slots__ = (
        "bc",
        "bm",
        "bmem",
        "cc",
        "cec",
        "cm",
        "cmem",
        "ebc",
        "efc",
        "fc",
        "fm",
        "fmem",
        "ids",
    )

    def __init__(self, stages: tuple[StageTime, ...]) -> None:
        by_object: dict[int, int] = {}
        distinct: dict[StageTime, int] = {}
        ids = []
        for stage in stages:
            index = by_object.get(id(stage))
            if index is None:
                index = by_object[id(stage)] = distinct.setdefault(stage, len(distinct))
            ids.append(index)
        self.ids = np.array(ids, dtype=np.int64)
        unique = list(distinct)

        def column(get) -> np.ndarray:
            return np.array([get(u) for u in unique], dtype=np.float64)

        self.fm, self.fmem = column(lambda u: u.forward.matmul), column(lambda u: u.forward.memory)
        self.bm = column(lambda u: u.backward.matmul)
        self.bmem = column(lambda u: u.backward.memory)
        self.cm = column(lambda u: u.core_forward.matmul)
        self.cmem = column(lambda u: u.core_forward.memory)
        self.fc, self.bc = column(lambda u: u.forward_comm), column(lambda u: u.backward_comm)
        self.cc = column(lambda u: u.core_comm)
        self.efc = column(lambda u: u.expert_forward_comm)
        self.ebc = column(lambda u: u.expert_backward_comm)
        self.cec = column(lambda u: u.core_expert_comm)


def _sequential_sum(*columns: np.ndarray) -> float:
    """0.0 + the columns' elements row by row (a0, b0, a1, b1, ...), added one after the other
    left to right as `micro_batch_time`'s loop adds them (`np.add.accumulate` is sequential,
    unlike `np.sum`'s pairwise sum), so the float result is the loop's to the last bit."""
    terms = np.empty(len(columns[0]) * len(columns) + 1)
    terms[0] = 0.0
    for k, c in enumerate(columns):
        terms[1 + k :: len(columns)] = c
    return float(np.add.accumulate(terms)[-1])


def table_micro_batch_time(
    table: StageTable, forwards: tuple[int, ...], selective: bool
) -> MicroBatchTime:
    """`micro_batch_time` on a chain's `StageTable`: the same runs, the same products and the
    same additions in the same order, evaluated on arrays (bit-identical;
    tests/test_hardware.py compares them)."""
    ids = table.ids
    if len(forwards) != len(ids):
        raise ValueError(f"{len(forwards)} forward counts for a chain of {len(ids)} stages")
    counts = np.array(forwards, dtype=np.int64)
    change = np.empty(len(ids), dtype=bool)
    change[0] = True
    np.not_equal(ids[1:], ids[:-1], out=change[1:])
    change[1:] |= counts[1:] != counts[:-1]
    starts = np.flatnonzero(change)
    n = np.diff(np.append(starts, len(ids)))
    run, c = ids[starts], counts[starts]
    again = n * (c - 1)
    fm, fmem, fc = table.fm[run], table.fmem[run], table.fc[run]
    expert = n * (c * table.efc[run] + table.ebc[run])
    if selective:
        recompute = OpTime(
            _sequential_sum(fm * again, table.cm[run] * n),
            _sequential_sum(fmem * again, table.cmem[run] * n),
        )
        recompute_comm = _sequential_sum(again * fc, n * table.cc[run])
        expert_comm = _sequential_sum(expert, n * table.cec[run])
    else:
        recompute = OpTime(_sequential_sum(fm * again), _sequential_sum(fmem * again))
        recompute_comm = _sequential_sum(again * fc)
        expert_comm = _sequential_sum(expert)
    return MicroBatchTime(
        OpTime(_sequential_sum(fm * n), _sequential_sum(fmem * n)),
        OpTime(_sequential_sum(table.bm[run] * n), _sequential_sum(table.bmem[run] * n)),
        recompute,
        _sequential_sum(n * fc),
        _sequential_sum(n * table.bc[run]),
        recompute_comm,
        expert_comm,
        _sequential_sum(n * table.efc[run]),
    )
