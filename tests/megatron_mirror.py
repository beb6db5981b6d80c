"""Regenerate tests/megatron_flags.py, Megatron-LM's command-line flags as argparse code, from
Megatron-LM's own source at a named release.

Nothing of Megatron-LM is imported (it needs torch and CUDA): its source is read as syntax trees.

- Every `add_argument` call in megatron/training/arguments.py is written out with its flags,
  `dest`, `action`, `nargs`, `choices`, `const` and a literal `default`.
- Every `ArgumentGroupFactory(ConfigClass, exclude=[...])` call there (from core_v0.16.0) is
  expanded as megatron/training/argument_utils.py builds the group: each dataclass field of the
  class and its dataclass bases that is not excluded and not `init=False` becomes
  `--name-with-hyphens` with `dest` the field name and the field's default (or its
  `default_factory()`); the type comes from the annotation (`Optional[X]` and `X | None` are X,
  `list[X]` adds `nargs="+"`, `Literal[...]` gives `choices` and the type of its values, an
  `Enum` gives its member names as `choices`); a `bool` becomes `store_true` when the default
  is False, else `store_false` named `--no-name` and `--disable-name`; a field's
  `metadata={"argparse_meta": {...}}` overrides all of these (`arg_names` renames the flag).
  The class is found by following the imports of arguments.py and the modules they name.

A `type` that is not `int`, `float` or `str` (Megatron's own converters, an enum's lookup by
name) is kept as `str`, which parses any value those would. The export tests parse ckplan's
flags with the result, so a flag that this release does not know fails as it would in
`pretrain_gpt.py`.

    python tests/megatron_mirror.py PATH/TO/Megatron-LM \\
        --release core_v0.19.0 --commit 5be9626709af2722333bf54797c954c09edeada3
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent / "megatron_flags.py"
TYPES = {"int", "float", "str"}
KEYWORDS = ("dest", "action", "nargs", "choices", "const", "default", "required")


def _literal(node: ast.AST):
    """The value of a literal node, or a marker that it is not one."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


_NOT_LITERAL = object()


def flag_calls(source: str) -> list[tuple[list[str], dict[str, object]]]:
    """(flags, keywords) of every add_argument call with literal flags, in source order."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument":
            continue
        flags = [_literal(arg) for arg in node.args]
        if not flags or not all(isinstance(f, str) and f.startswith("-") for f in flags):
            continue
        keywords: dict[str, object] = {}
        for keyword in node.keywords:
            if keyword.arg == "type":
                name = keyword.value.id if isinstance(keyword.value, ast.Name) else None
                keywords["type"] = name if name in TYPES else "str"
            elif keyword.arg in KEYWORDS:
                value = _literal(keyword.value)
                if value is not _NOT_LITERAL:
                    keywords[keyword.arg] = value
                elif keyword.arg == "default":
                    keywords["default"] = None
        calls.append((flags, keywords))
    calls.sort(key=lambda call: call[0][0])
    return calls


class FactoryError(ValueError):
    """A dataclass field ArgumentGroupFactory could not turn into a flag (Megatron fails too)."""


_BUILTIN_TYPES = {"int", "float", "str", "bool"}
_ENUM_BASES = {"Enum", "IntEnum", "StrEnum", "Flag", "IntFlag"}
# typing names that are no type argparse can call (typing.get_origin gives a generic, or Any)
_TYPING_SPECIALS = {"Any", "Callable", "ContextManager", "Dict", "List", "Sequence", "Tuple"}


class Sources:
    """Megatron-LM's modules as syntax trees, found under a checkout's root by dotted name."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, tuple[ast.Module, bool]] = {}

    def tree(self, module: str) -> tuple[ast.Module, bool]:
        """(syntax tree, whether the module is a package's __init__)."""
        if module not in self._trees:
            base = self.root.joinpath(*module.split("."))
            for path, package in ((base.with_suffix(".py"), False), (base / "__init__.py", True)):
                if path.is_file():
                    self._trees[module] = (ast.parse(path.read_text(encoding="utf-8")), package)
                    break
            else:
                raise FactoryError(f"no module {module} under {self.root}")
        return self._trees[module]

    def source_module(self, module: str, node: ast.ImportFrom) -> str:
        """The absolute module an import in `module` reads from."""
        if not node.level:
            return node.module or ""
        _, package = self.tree(module)
        parts = module.split(".") if package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def find_class(self, module: str, name: str, anywhere: bool = False):
        """(module, ClassDef) of `name` as seen from `module`, following `from ... import`s
        (`anywhere`: imports inside functions count too)."""
        tree, _ = self.tree(module)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        nodes = ast.walk(tree) if anywhere else tree.body
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.find_class(self.source_module(module, node), alias.name)
        return None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for decorator in cls.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name == "dataclass":
            return True
    return False


def _is_enum(sources: Sources, module: str, cls: ast.ClassDef) -> bool:
    for base in cls.bases:
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if name in _ENUM_BASES:
            return True
        found = sources.find_class(module, name) if isinstance(base, ast.Name) else None
        if found and _is_enum(sources, *found):
            return True
    return False


def _enum_members(cls: ast.ClassDef) -> list[str]:
    members = []
    for node in cls.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        members += [t.id for t in targets if isinstance(t, ast.Name) and not t.id.startswith("_")]
    return members


def dataclass_fields(sources: Sources, module: str, cls: ast.ClassDef) -> dict[str, tuple]:
    """name -> (module, annotation, value) of every dataclass field, the bases' first (as
    dataclasses.fields orders them); ClassVar and InitVar annotations are not fields."""
    fields: dict[str, tuple] = {}
    for base in reversed(cls.bases):
        found = sources.find_class(module, base.id) if isinstance(base, ast.Name) else None
        if found and _is_dataclass(found[1]):
            fields.update(dataclass_fields(sources, *found))
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        head = (
            node.annotation.value if isinstance(node.annotation, ast.Subscript) else node.annotation
        )
        if getattr(head, "id", getattr(head, "attr", None)) in ("ClassVar", "InitVar"):
            continue
        fields[node.target.id] = (module, node.annotation, node.value)
    return fields


def _union_members(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_members(node.left) + _union_members(node.right)
    return [node]


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def extract_type(sources: Sources, module: str, node: ast.AST) -> dict[str, object]:
    """ArgumentGroupFactory._extract_type on an annotation's syntax tree."""
    if isinstance(node, ast.BinOp):
        members = _union_members(node)
        if _is_none(members[1]):
            return extract_type(sources, module, members[0])
        raise FactoryError(f"Unions not supported by argparse: {ast.unparse(node)}")
    if isinstance(node, ast.Subscript):
        head = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Optional":
            return extract_type(sources, module, args[0])
        if head == "Union":
            if _is_none(args[1]):
                return extract_type(sources, module, args[0])
            raise FactoryError(f"Unions not supported by argparse: {ast.unparse(node)}")
        if head in ("list", "List"):
            if len(args) != 1:
                raise FactoryError(f"Multi-type lists not supported: {ast.unparse(node)}")
            return {**extract_type(sources, module, args[0]), "nargs": "+"}
        if head == "Literal":
            values = tuple(ast.literal_eval(arg) for arg in args)
            kind = type(values[0]).__name__
            return {"type": kind if kind in _BUILTIN_TYPES else "str", "choices": values}
        raise FactoryError(f"Unsupported type: {ast.unparse(node)}")
    if isinstance(node, ast.Name):
        if node.id in _BUILTIN_TYPES:
            return {"type": node.id}
        if node.id in _TYPING_SPECIALS:
            raise FactoryError(f"Unsupported type: {node.id}")
        found = sources.find_class(module, node.id)
        if found and _is_enum(sources, *found):
            return {"type": "str", "choices": _enum_members(found[1])}
        return {"type": "str"}  # a class called on the value: kept as str
    if isinstance(node, ast.Attribute):
        return {"type": "str"}
    raise FactoryError(f"Unsupported type: {ast.unparse(node)}")


def _value(sources: Sources, module: str, node: ast.AST):
    """A default's value: a literal, an enum member's name, or None for anything else."""
    value = _literal(node)
    if value is not _NOT_LITERAL:
        return value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _value(sources, module, node.left), _value(sources, module, node.right)
        if isinstance(left, (int, float)) and isinstance(right, (int, float)):
            return _ARITHMETIC[type(node.op)](left, right)
        return None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        found = sources.find_class(module, node.value.id)
        if found and _is_enum(sources, *found):
            return node.attr
    return None


_ARITHMETIC = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Pow: lambda a, b: a**b,
}


def _factory_default(sources: Sources, module: str, node: ast.AST):
    """`default_factory()` for a builtin container or a lambda returning a literal."""
    if isinstance(node, ast.Name) and node.id in ("list", "dict", "tuple", "set"):
        return {"list": [], "dict": {}, "tuple": (), "set": set()}[node.id]
    if isinstance(node, ast.Lambda):
        return _value(sources, module, node.body)
    return None


def _meta(sources: Sources, module: str, node: ast.AST) -> dict[str, object] | None:
    """The `argparse_meta` dict of a field's metadata, values as the generator keeps them."""
    if not isinstance(node, ast.Dict):
        return None
    for key, value in zip(node.keys, node.values, strict=True):
        if _literal(key) == "argparse_meta" and isinstance(value, ast.Dict):
            meta: dict[str, object] = {}
            for k, v in zip(value.keys, value.values, strict=True):
                name = _literal(k)
                if name == "type":
                    meta["type"] = v.id if isinstance(v, ast.Name) and v.id in TYPES else "str"
                elif name == "arg_names" or name in KEYWORDS:
                    meta[name] = _value(sources, module, v)
            return meta
    return None


def factory_calls(sources: Sources, module: str, class_name: str, exclude: set[str]):
    """(flags, keywords) of ArgumentGroupFactory(class, exclude).build_group, field by field
    (megatron/training/argument_utils.py: _build_argparse_kwargs_from_field)."""
    found = sources.find_class(module, class_name, anywhere=True)
    if found is None:
        raise FactoryError(f"class {class_name} not found from {module}")
    calls = []
    for name, (where, annotation, value) in dataclass_fields(sources, *found).items():
        if name in exclude:
            continue
        keywords: dict[str, object] = {"dest": name}
        default, meta = None, None
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
            options = {k.arg: k.value for k in value.keywords}
            if "init" in options and _literal(options["init"]) is False:
                continue
            if "default" in options:
                default = _value(sources, where, options["default"])
            elif "default_factory" in options:
                default = _factory_default(sources, where, options["default_factory"])
            else:
                raise FactoryError(f"{class_name}.{name} has no default")
            meta = _meta(sources, where, options.get("metadata"))
        elif value is None:
            raise FactoryError(f"{class_name}.{name} has no default")
        else:
            default = _value(sources, where, value)
        keywords["default"] = default
        flags = ["--" + name.replace("_", "-")]
        try:
            keywords.update(extract_type(sources, where, annotation))
            if keywords["type"] == "bool":
                keywords["action"] = "store_true" if default == False else "store_false"  # noqa: E712
                del keywords["type"]
                if keywords["action"] == "store_false":
                    flags = [
                        "--no-" + name.replace("_", "-"),
                        "--disable-" + name.replace("_", "-"),
                    ]
        except FactoryError:
            if meta is None:
                raise FactoryError(f"{class_name}.{name}: {ast.unparse(annotation)}") from None
        if meta is not None:
            flags = list(meta.pop("arg_names", flags))
            keywords.update(meta)
        calls.append((flags, keywords))
    return calls


def _exclude(function: ast.AST | None, node: ast.AST) -> set[str]:
    """The literal names of an `exclude=` argument, or of the list a variable holds in the
    function that makes the call."""
    value = _literal(node)
    if value is not _NOT_LITERAL:
        return set(value or ())
    if isinstance(node, ast.Name) and function is not None:
        for statement in ast.walk(function):
            if isinstance(statement, ast.Assign) and any(
                getattr(t, "id", None) == node.id for t in statement.targets
            ):
                value = _literal(statement.value)
                if value is not _NOT_LITERAL:
                    return set(value)
    raise FactoryError(f"exclude is not a literal list: {ast.unparse(node)}")


def all_factory_calls(sources: Sources, module: str = "megatron.training.arguments"):
    """The flags of every ArgumentGroupFactory(...) call in the functions of
    megatron/training/arguments.py."""
    tree, _ = sources.tree(module)
    calls = []
    for function in tree.body:
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id != "ArgumentGroupFactory" or not node.args:
                continue
            options = {k.arg: k.value for k in node.keywords}
            if len(node.args) > 1:
                options["exclude"] = node.args[1]
            exclude = _exclude(function, options["exclude"]) if "exclude" in options else set()
            calls += factory_calls(sources, module, node.args[0].id, exclude)
    return calls


def render(calls, release: str, commit: str) -> str:
    lines = [
        f'"""Megatron-LM {release}: the flags of megatron/training/arguments.py, its add_argument',
        "calls and the config dataclass fields its ArgumentGroupFactory turns into flags",
        f"(commit {commit}).",
        "",
        "Generated by tests/megatron_mirror.py; do not edit: run it again on another release.",
        '"""',
        "",
        "import argparse",
        "",
        f"RELEASE = {release!r}",
        f"COMMIT = {commit!r}",
        "",
        "",
        "def parser() -> argparse.ArgumentParser:",
        "    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)",
    ]
    seen: set[str] = set()
    for flags, keywords in calls:
        if seen & set(flags):
            continue  # a flag defined twice (alternatives by version): the first wins
        seen |= set(flags)
        parts = [repr(flag) for flag in flags]
        for key in ("dest", "action", "nargs", "choices", "const", "default", "required"):
            if key in keywords:
                parts.append(f"{key}={keywords[key]!r}")
        if "type" in keywords and keywords.get("action") not in ("store_true", "store_false"):
            parts.append(f"type={keywords['type']}")
        lines.append(f"    p.add_argument({', '.join(parts)})")
    lines += ["    return p", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("megatron_lm", type=Path, help="a Megatron-LM checkout's root")
    parser.add_argument("--release", required=True)
    parser.add_argument("--commit", required=True)
    args = parser.parse_args()
    arguments_py = args.megatron_lm / "megatron" / "training" / "arguments.py"
    calls = flag_calls(arguments_py.read_text(encoding="utf-8"))
    calls += all_factory_calls(Sources(args.megatron_lm))
    calls.sort(key=lambda call: call[0][0])
    OUTPUT.write_text(render(calls, args.release, args.commit), encoding="utf-8")
    print(f"wrote {len(calls)} flags to {OUTPUT.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
