"""Bad input: the one base class of every error the CLI turns into one line and exit 2.

Each module raises its own subclass (SpecError, SizeError, StrategyError, GPUError, ...). Where a
key is at fault the error carries it: `key`, the `value` given, the `rule` it breaks and the
`origin` (the file or preset), and its one-line message is phrased from them (`phrase`), e.g.
"preset gpt2: key 'tp' must divide heads (12), got 5". Other errors carry a one-line message.
The CLI catches this base class alone, so it imports none of the modules that define the
subclasses before they are needed.
"""

from __future__ import annotations

from typing import Any

from ckplan.quoting import quote

_NO_VALUE = object()


def phrase(key: str, rule: str, value: Any = _NO_VALUE, origin: str | None = None) -> str:
    """One line: `origin: key 'KEY' RULE, got VALUE` (VALUE quoted and cut if long)."""
    text = f"key {key!r} {rule}"
    if value is not _NO_VALUE:
        text += f", got {quote(value)}"
    return f"{origin}: {text}" if origin else text


class InputError(ValueError):
    """Bad input; the message is one line and names what is wrong."""

    def __init__(
        self,
        message: str | None = None,
        *,
        key: str | None = None,
        rule: str | None = None,
        value: Any = _NO_VALUE,
        origin: str | None = None,
    ) -> None:
        self.key, self.rule, self.value, self.origin = key, rule, value, origin
        if message is None:
            if key is None or rule is None:
                raise TypeError("InputError needs a message, or a key and a rule")
            message = phrase(key, rule, value, origin)
        super().__init__(message)

    @property
    def has_value(self) -> bool:
        return self.value is not _NO_VALUE

    def within(self, origin: str) -> InputError:
        """The same error said of `origin` (a file or preset name), structure kept."""
        if self.key is not None and self.origin is None:
            return type(self)(
                key=self.key,
                rule=self.rule,
                value=self.value if self.has_value else _NO_VALUE,
                origin=origin,
            )
        return type(self)(f"{origin}: {self}")
