"""Turn results into Rich tables (for people) and JSON-ready dicts (for machines).

The only package that knows how things look. Byte and FLOP counts stay exact ints in JSON;
tables print binary units and say so, with decimal units beside totals.
"""

from ckplan.render.common import error_text, note_text
from ckplan.render.estimate import (
    estimate_dict,
    estimate_view,
    model_table,
    plan_dict,
    presets_table,
)
from ckplan.render.sweep import (
    check_dict,
    check_table,
    schedule_dict,
    schedule_view,
    sweep_dict,
    sweep_view,
)
from ckplan.render.verify import verify_dict, verify_view

__all__ = [
    "check_dict",
    "check_table",
    "error_text",
    "estimate_dict",
    "estimate_view",
    "model_table",
    "note_text",
    "plan_dict",
    "presets_table",
    "schedule_dict",
    "schedule_view",
    "sweep_dict",
    "sweep_view",
    "verify_dict",
    "verify_view",
]
