"""Turn results into Rich tables (for people) and JSON-ready dicts (for machines).

The only package that knows how things look. Byte and FLOP counts stay exact ints in JSON;
tables print binary units and say so, with decimal units beside totals.
"""

from ckplan.lazy_names import lazy_getattr

# Every view is imported on first use (start-up time: a command imports only its own).
_LAZY = {
    "error_text": "common",
    "note_text": "common",
    "estimate_dict": "estimate",
    "estimate_view": "estimate",
    "model_table": "estimate",
    "plan_dict": "estimate",
    "presets_table": "estimate",
    "check_dict": "sweep",
    "check_table": "sweep",
    "largest_line": "sweep",
    "schedule_dict": "sweep",
    "schedule_view": "sweep",
    "sweep_dict": "sweep",
    "sweep_view": "sweep",
    "verify_dict": "verify",
    "verify_view": "verify",
    "estimate_no_fit_dict": "no_fit",
    "schedule_no_fit_dict": "no_fit",
    "gpu_table": "time",
    "gpus_table": "time",
    "step_time_table": "time",
    "calibrate_dict": "calibrate",
    "calibrate_view": "calibrate",
    "validate_dict": "validate",
    "validate_view": "validate",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "calibrate_dict",
    "calibrate_view",
    "check_dict",
    "check_table",
    "error_text",
    "estimate_dict",
    "estimate_no_fit_dict",
    "estimate_view",
    "gpu_table",
    "gpus_table",
    "model_table",
    "note_text",
    "plan_dict",
    "presets_table",
    "schedule_dict",
    "schedule_no_fit_dict",
    "schedule_view",
    "step_time_table",
    "sweep_dict",
    "sweep_view",
    "validate_dict",
    "validate_view",
    "verify_dict",
    "verify_view",
]
