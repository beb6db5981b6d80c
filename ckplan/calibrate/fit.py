"""Fitting a profile's coefficients to measured layers, exactly (pure Python, no torch).

A measurement is, per op and per dtype class (the activation dtype "B", or a fixed item size:
4 for fp32, 1 for a bool mask), the number of elements the op's saved storages hold. Over the
fitting shapes each of these is a linear function of the terms of ckplan.model.profiles,
evaluated at one rank (t = 1): s·b·h, s·b·g·d, s·b·F, a·s²·b, a·s·b, s·b, g·s·b, s². The
coefficients are found by least squares in exact rational arithmetic (Fractions), so an exact
function of the terms comes out with its exact coefficients and a zero residual, and anything
else shows as a residual; a shape left out of the fit checks them.

At t = 1 the residual-stream tensors (sbh) and the tensors at the attention heads (sbad) have the
same size; an op's s·b·h coefficient is written on sbad inside the attention (attn_scores,
softmax, attn_dropout, attn_values, attention_core, out_proj and qk_norm, as ckplan's table
splits them) and on sbh elsewhere. When g = a in every shape (MHA), s·b·g·d is s·b·h too and is
folded into it, and g·s·b into a·s·b.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ckplan.calibrate.attribute import CORE_OPS
from ckplan.model.profiles import Form, format_form

COLUMNS = ("sbh", "sbF", "as2b", "asb", "sb", "sbgd", "gsb", "s2")  # preference when collinear
HEAD_OPS = (*CORE_OPS, "out_proj", "qk_norm")  # the ops at the attention heads


@dataclass(frozen=True)
class Shape:
    seq: int  # s
    batch: int  # b
    hidden: int  # h
    heads: int  # a
    kv_heads: int  # g
    ffn: int  # F

    def columns(self) -> dict[str, int]:
        """The terms at one rank, t = 1 (ckplan.model.profiles.term_values)."""
        s, b, h, a, g, F = self.seq, self.batch, self.hidden, self.heads, self.kv_heads, self.ffn
        return {
            "sbh": s * b * h,
            "sbF": s * b * F,
            "as2b": a * s * s * b,
            "asb": a * s * b,
            "sb": s * b,
            "sbgd": s * b * g * (h // a),
            "gsb": g * s * b,
            "s2": s * s,
        }

    def text(self) -> str:
        return (
            f"s={self.seq} b={self.batch} h={self.hidden} a={self.heads} g={self.kv_heads} "
            f"F={self.ffn}"
        )


# Small layers whose terms are linearly independent: s, b, h, a, g and F all vary, d = h/a
# from 12 to 32, a/g from 1 to 4. With g = a (MHA) the kv heads follow a. b >= 2: at b = 1 a
# head view of the QKV output is a valid 3-D operand, so matmul saves views of that one storage
# instead of copies of Q, K and V; the total is the same, but it all counts under attn_scores.
_FIT = [
    (16, 2, 64, 4, 2, 96),
    (32, 2, 64, 4, 2, 160),
    (16, 3, 96, 4, 1, 128),
    (24, 2, 128, 8, 2, 192),
    (16, 3, 64, 4, 4, 128),
    (40, 2, 128, 4, 2, 224),
    (8, 2, 160, 8, 4, 288),
    (32, 2, 96, 6, 3, 160),
    (12, 3, 192, 8, 2, 256),
]
_CHECK = (48, 2, 192, 6, 3, 320)


def fit_shapes(gqa: bool) -> list[Shape]:
    return [Shape(s, b, h, a, g if gqa else a, F) for s, b, h, a, g, F in _FIT]


def check_shape(gqa: bool) -> Shape:
    s, b, h, a, g, F = _CHECK
    return Shape(s, b, h, a, g if gqa else a, F)


def solve_exact(rows: list[dict[str, int]], ys: list[int]) -> dict[str, Fraction]:
    """Least squares over the rows in exact arithmetic: the normal equations AᵀA c = Aᵀy over the
    columns that are linearly independent (taken in COLUMNS order; a dependent column gets 0)."""
    columns = _independent([[Fraction(row[c]) for c in COLUMNS] for row in rows])
    names = [COLUMNS[j] for j in columns]
    a = [[Fraction(row[c]) for c in names] for row in rows]
    n = len(names)
    normal = [
        [sum(r[i] * r[j] for r in a) for j in range(n)]
        + [sum(r[i] * y for r, y in zip(a, ys, strict=True))]
        for i in range(n)
    ]
    solution = _gauss_jordan(normal)
    return {name: solution[i] for i, name in enumerate(names) if solution[i]}


def _independent(matrix: list[list[Fraction]]) -> list[int]:
    """Indexes of the columns that raise the rank, left to right (exact elimination)."""
    basis: list[tuple[int, list[Fraction]]] = []  # (pivot row, reduced column)
    chosen = []
    for j in range(len(matrix[0]) if matrix else 0):
        column = [row[j] for row in matrix]
        for pivot, vector in basis:
            if column[pivot]:
                factor = column[pivot] / vector[pivot]
                column = [c - factor * v for c, v in zip(column, vector, strict=True)]
        pivot = next((i for i, c in enumerate(column) if c), None)
        if pivot is not None:
            basis.append((pivot, column))
            chosen.append(j)
    return chosen


def _gauss_jordan(augmented: list[list[Fraction]]) -> list[Fraction]:
    n = len(augmented)
    m = [row[:] for row in augmented]
    for col in range(n):
        pivot = next(r for r in range(col, n) if m[r][col])
        m[col], m[pivot] = m[pivot], m[col]
        m[col] = [v / m[col][col] for v in m[col]]
        for r in range(n):
            if r != col and m[r][col]:
                factor = m[r][col]
                m[r] = [v - factor * p for v, p in zip(m[r], m[col], strict=True)]
    return [m[i][n] for i in range(n)]


@dataclass(frozen=True)
class OpFit:
    """One op's fitted saved bytes: per term, bytes per element (constant, multiple of B)."""

    op: str
    terms: dict[str, Form]
    max_residual: Fraction  # over the fitting shapes, in bytes at B = the measured dtype's

    def mapping(self) -> dict[str, str | int]:
        return {term: _yaml_form(form) for term, form in sorted(self.terms.items())}


def _yaml_form(form: Form) -> str | int:
    text = format_form(form)
    return int(text) if text.lstrip("-").isdigit() else text


def fit_op(op: str, samples: list[tuple[Shape, dict[str, int]]], dtype_bytes: int) -> OpFit:
    """Fit one op from (shape, {dtype class: elements}) samples; dtype class "B" is the
    activation dtype, an int class a fixed item size in bytes."""
    classes = sorted({c for _, by_class in samples for c in by_class}, key=str)
    terms: dict[str, list[Fraction]] = {}
    worst = Fraction(0)
    for dtype_class in classes:
        rows = [shape.columns() for shape, _ in samples]
        ys = [by_class.get(dtype_class, 0) for _, by_class in samples]
        coefficients = solve_exact(rows, ys)
        for row, y in zip(rows, ys, strict=True):
            predicted = sum(coefficients.get(c, 0) * row[c] for c in COLUMNS)
            item = dtype_bytes if dtype_class == "B" else dtype_class
            worst = max(worst, abs(predicted - y) * item)
        for column, value in coefficients.items():
            term = "sbad" if column == "sbh" and op in HEAD_OPS else column
            form = terms.setdefault(term, [Fraction(0), Fraction(0)])
            if dtype_class == "B":
                form[1] += value
            else:
                form[0] += value * dtype_class
    fitted = {t: (f[0], f[1]) for t, f in terms.items() if f[0] or f[1]}
    return OpFit(op, fitted, worst)


def predicted_bytes(fit: OpFit, shape: Shape, dtype_bytes: int) -> Fraction:
    columns = shape.columns()
    columns["sbad"] = columns["sbh"]
    return sum((columns[t] * (c + b * dtype_bytes) for t, (c, b) in fit.terms.items()), Fraction(0))
