"""Typer's parameter coercion, skipped where it has nothing to do (start-up time).

Typer (0.2x) coerces every parameter of a command through a pydantic TypeAdapter that it
builds on first use: every run imports pydantic (about 40 ms) and builds one adapter per
parameter (about 1 ms each), a default left as it is included. What an adapter does with
ckplan's parameters (str, int, float, bool, list[str], none with a custom parser or bounds) is
known for the common values: a value that already has the parameter's type (a default, any
string for a str option, strings for --set) and a plain decimal integer for an int option come
out unchanged (the integer as int). Those skip the adapter. Any other value (an int option
given '1e3', ' 8' or '٣') goes through Typer's own adapter, built then: what is accepted and
every error message stay Typer's.

Installed once by app.py. With a Typer whose internals differ, nothing is changed.
"""

from __future__ import annotations

import re
from typing import Any, get_args, get_origin

# Up to 18 ASCII digits: what int() and pydantic read alike (no sign, spaces, underscores or
# other digits, which pydantic judges itself).
PLAIN_INT = re.compile(r"-?[0-9]{1,18}")
_SKIP = object()


def _known_value(annotation: Any, info: Any, value: Any) -> Any:
    """The value Typer's adapter would return for `value`, when it is known without it; else
    _SKIP."""
    if info.parser is not None or getattr(info, "click_type", None) is not None:
        return _SKIP
    if getattr(info, "min", None) is not None or getattr(info, "max", None) is not None:
        return _SKIP
    if annotation in (str, int, float) and type(value) is annotation:
        return value
    if annotation is int and type(value) is str and PLAIN_INT.fullmatch(value):
        return int(value)
    if (
        get_origin(annotation) is list
        and get_args(annotation) == (str,)
        and isinstance(value, list | tuple)
        and all(type(item) is str for item in value)
    ):
        return list(value)
    return _SKIP


def install() -> None:
    """Make Typer build a parameter's adapter only for a value that needs it."""
    try:
        from typer import core
        from typer._coercion import RuntimeParam
    except ImportError:  # another Typer: its own coercion, unchanged
        return
    build = getattr(core, "build_runtime_param", None)
    if build is None or getattr(build, "deferred", False):
        return

    class DeferredRuntimeParam(RuntimeParam):
        """A RuntimeParam whose adapter is built on the first value that needs it."""

        def __init__(self, descriptor: Any) -> None:
            super().__init__(
                parameter_info=descriptor.parameter_info, annotation=descriptor.annotation
            )
            object.__setattr__(self, "descriptor", descriptor)
            object.__setattr__(self, "built", None)

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            known = _known_value(self.annotation, self.parameter_info, value)
            if known is not _SKIP:
                return known
            if self.built is None:
                object.__setattr__(self, "built", build(self.descriptor))
            return self.built._coerce_value(value, param=param, ctx=ctx)

    def deferred_build(descriptor: Any) -> Any:
        return DeferredRuntimeParam(descriptor)

    deferred_build.deferred = True
    core.build_runtime_param = deferred_build
