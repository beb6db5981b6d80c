"""Published training runs: the suite ckplan is validated on, and its error on each run.

runs     a published run as a record (model, layout, training, the published figure)
predict  ckplan's prediction of a run, its error, and the summary per GPU and framework
"""

__all__ = ["predict", "runs"]
