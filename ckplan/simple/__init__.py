"""The simple model beside the real one: the NumPy MLP that `ckplan verify` runs, and the simple
formula set (`--formula simple`).

    formulas  12·s·b·h·B per layer and the other back-of-the-envelope estimates
    mlp       the NumPy MLP's op table, exact workspaces and parameters (`kind: mlp`)
    verify    the NumPy MLP run for real under a plan, measured against its prediction

`formulas` and `mlp` are pure and sit with the model; `verify` runs plans and sits above them.
"""

__all__ = ["formulas", "mlp", "verify"]
