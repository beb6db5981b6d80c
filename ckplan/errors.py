"""Bad input: the one base class of every error the CLI turns into one line and exit 2.

Each module raises its own subclass (SpecError, SizeError, StrategyError, GPUError, ...) with a
one-line message naming the key or option and what was expected; the CLI catches this base
class alone, so it imports none of the modules that define them before they are needed.
"""


class InputError(ValueError):
    """Bad input; the message is one line and names what is wrong."""
