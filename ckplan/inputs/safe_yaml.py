"""YAML for untrusted model descriptions: PyYAML's safe loader with its remaining hazards closed.

`yaml.safe_load` builds no arbitrary objects, but a hostile or broken file still gets through it
to a traceback or a hang:
- aliases: nine levels of nine aliases (`&a [*b, *b, ...]`) load at once as shared references,
  then expand to 9^9 elements in whatever walks them (a repr in an error message never ends);
- nesting: `[[[[...]]]]` thousands deep overflows the recursive composer (RecursionError);
- tags: `!!int abc`, `!!timestamp bogus`, `!!binary ...` run constructors that raise ValueError
  or AttributeError instead of a YAML error; `!!python/object` is refused by the safe loader,
  but as an error about constructors;
- plain scalars: an integer of 5,000 digits exceeds Python's 4,300-digit limit on converting
  text to int (ValueError); `2024-13-45` resolves implicitly to a timestamp and fails the same way;
- duplicate keys: the last one silently wins.
A model description is one flat mapping of scalars, so this loader accepts exactly that much
YAML: no aliases, no explicit tags, no merge keys, no duplicate keys, at most MAX_DEPTH levels
and MAX_NODES nodes. Numbers too long to be sizes stay strings (the spec rejects them by key,
with its range), timestamps stay strings. Every refusal is a `yaml.MarkedYAMLError` with a
position, so the caller reports it like any syntax error.
"""

from __future__ import annotations

import collections.abc
from typing import Any

import yaml
from yaml.constructor import ConstructorError

from ckplan.quoting import quote

MAX_DEPTH = 16  # nesting levels; a model description needs 2
MAX_NODES = 10_000  # scalars and collections; a model description has under 100
MAX_NUMBER_CHARS = 100  # longer numbers are kept as text (no size has 100 digits)


class RefusedYAML(yaml.MarkedYAMLError):
    """Well-formed YAML that a model description does not accept (alias, tag, depth, ...)."""


class _Loader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            _refuse("YAML aliases (*name) are not accepted in ckplan's YAML files", event)
        tag = getattr(event, "tag", None)
        if tag not in (None, "!"):
            shown = tag.replace("tag:yaml.org,2002:", "!!")
            _refuse(f"YAML tags are not accepted in ckplan's YAML files ({quote(shown)})", event)
        self._nodes += 1
        if self._nodes > MAX_NODES:
            _refuse(f"more than {MAX_NODES:,} YAML nodes: too large for a ckplan YAML file", event)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            _refuse(f"YAML nested deeper than {MAX_DEPTH} levels: not a ckplan YAML file", event)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        """PyYAML's mapping, without merge keys and with duplicate keys refused."""
        if not isinstance(node, yaml.MappingNode):
            raise ConstructorError(
                None, None, f"expected a mapping, found {node.id}", node.start_mark
            )
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise RefusedYAML(
                    None, None, "YAML merge keys (<<) are not accepted", key_node.start_mark
                )
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, collections.abc.Hashable):
                raise ConstructorError(
                    None, None, "a mapping key must be a plain value", key_node.start_mark
                )
            if key in mapping:
                raise RefusedYAML(None, None, f"duplicate key {quote(key)}", key_node.start_mark)
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping

    def construct_yaml_int(self, node):
        if len(node.value) > MAX_NUMBER_CHARS:
            return node.value
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        if len(node.value) > MAX_NUMBER_CHARS:
            return node.value
        return super().construct_yaml_float(node)


def _refuse(problem: str, event) -> None:
    raise RefusedYAML(None, None, problem, event.start_mark)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _Loader.construct_yaml_str)
_Loader.add_constructor("tag:yaml.org,2002:value", _Loader.construct_yaml_str)  # a plain `=`


def load(text: str) -> Any:
    """Parse one YAML document under the rules above; raises `yaml.YAMLError` (with a
    `problem_mark` for everything but unreadable characters)."""
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def describe_error(error: yaml.YAMLError) -> str:
    """One line for a YAML error: `malformed YAML at line 3, column 7: <problem>`, or the
    refusal with its position."""
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    if isinstance(error, yaml.reader.ReaderError):
        return f"not YAML text: unacceptable character #x{error.character:04x}"
    problem = getattr(error, "problem", None) or "invalid YAML"
    context = getattr(error, "context", None)
    if context and not isinstance(error, RefusedYAML):
        problem = f"{context}, {problem}"
    if isinstance(error, RefusedYAML):
        return f"{problem} ({where})" if where else problem
    return f"malformed YAML at {where}: {problem}" if where else f"malformed YAML: {problem}"
