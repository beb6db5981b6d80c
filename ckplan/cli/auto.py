"""`--seq auto` and `--micro-batch auto`: the options of the commands that plan, and how they
read them. The search itself is `plan.search.largest_fitting`."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from ckplan.cli.errors import UserError
from ckplan.quoting import quote

SeqAutoOpt = Annotated[
    str | None,
    typer.Option("--seq", help="Shortcut for --set seq=N; 'auto': the longest sequence that fits."),
]
MicroBatchAutoOpt = Annotated[
    str | None,
    typer.Option(
        "--micro-batch", help="'auto': the largest micro-batch that fits (--batch N sets one)."
    ),
]
OPTIONS = {"seq": "--seq", "micro_batch": "--micro-batch"}  # the option that searches each key


def read_auto(
    seq: str | None, micro_batch: str | None, batch: int | None = None
) -> tuple[int | None, str | None]:
    """(--seq as tokens or None, the key to search: "seq", "micro_batch" or None). One search
    at a time: the other key stays at the model's value."""
    if micro_batch not in (None, "auto"):
        raise UserError(
            f"--micro-batch {quote(micro_batch)}: only 'auto' is accepted (use --batch N to set "
            "one)"
        )
    seq_auto = seq == "auto"
    tokens = None if seq_auto else seq_tokens(seq)
    if seq_auto and micro_batch == "auto":
        raise UserError(
            "--seq auto and --micro-batch auto: give one of them (the other stays at the "
            "model's value)"
        )
    if micro_batch == "auto" and batch is not None:
        raise UserError(f"--batch {batch} and --micro-batch auto disagree: give one of them")
    return tokens, "seq" if seq_auto else "micro_batch" if micro_batch == "auto" else None


def need_budget(key: str | None, usable_bytes: int | None) -> None:
    """A search needs the memory it must fit."""
    if key is not None and usable_bytes is None:
        raise UserError(
            f"{OPTIONS[key]} auto needs --budget SIZE or --gpu NAME (the memory to fit)"
        )


def seq_tokens(text: str | None) -> int | None:
    """--seq as a number of tokens (what Typer reads as an integer: digits, a sign, spaces or
    underscores between digits), or None."""
    if text is None:
        return None
    if not re.fullmatch(r"\s*[+-]?[0-9]+(_[0-9]+)*\s*", text):
        raise UserError(
            f"Invalid value for '--seq': expected a whole number of tokens or auto, got "
            f"{quote(text)}"
        )
    try:
        return int(text)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise UserError(
            f"Invalid value for '--seq': {quote(text)} has more digits than any model takes"
        ) from None
