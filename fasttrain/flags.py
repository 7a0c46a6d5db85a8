"""The command line's flags: one per Config field, and `--help` and README's flags table drawn from the
same fields, docstrings and recipes.

`--field=value` or `--field value`, `_` and `-` both accepted; booleans also `--field`, `--no-field`
and `--field=false`; a field typed `X | None` takes auto or none for None; a list field takes its items
comma-separated (`--lr_boundary_epochs=30,60,80,90`). The recipe (demo when none is named) sets the
defaults and the flags override it. `python -m fasttrain.flags` prints README's table.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from fasttrain.config import ALIASES, Config, ConfigError, make_config, number_list
from fasttrain.recipes import RECIPES

_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_HINTS = typing.get_type_hints(Config)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_args(argv: list[str]) -> Config:
    """Build the Config for a command line: the recipe's defaults, then the flags in order.

    A flag given twice keeps its last value (scripts append overrides), but a seed alias and its field
    (--train_batch_size and --batch_size) with different values are refused: which one was meant?
    `--help` prints the flags with the named recipe's defaults and exits.
    """
    values: dict[str, object] = {}
    spelled: dict[str, str] = {}  # field -> the flag that set it
    wants_help = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            wants_help, i = True, i + 1
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r} (flags look like --name=value)")
        flag, eq, text = arg.partition("=")
        name, negated = _canonical(flag)
        if name not in _FIELDS:
            raise ConfigError(f"unknown flag {flag} (python -m fasttrain --help lists the flags)")
        is_bool = bool in (_HINTS[name], *typing.get_args(_HINTS[name]))
        if negated:
            if eq or not is_bool:
                raise ConfigError(f"{flag} takes no value")
            value = False
        elif eq:
            value = _convert(name, text)
        elif is_bool and (i + 1 >= len(argv) or argv[i + 1].lower() not in _TRUE + _FALSE):
            value = True
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a value")
            i += 1
            value = _convert(name, argv[i])
        before = spelled.get(name)
        if before is not None and _is_alias(before) != _is_alias(flag) and values[name] != value:
            raise ConfigError(f"{before}={values[name]} and {flag}={value} conflict; give one of them")
        values[name], spelled[name] = value, flag
        i += 1
    if wants_help:
        print(_usage(make_config(recipe=values.get("recipe", "demo"))))
        raise SystemExit(0)
    return make_config(**values)


def _convert(name: str, text: str):
    """A flag's text as its field's type (Config's validation then checks the value)."""
    hint = _HINTS[name]
    optional = type(None) in typing.get_args(hint)
    kind = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if typing.get_origin(kind) is typing.Literal:
        return text  # Config checks it is one of the choices (--recipe none names no recipe)
    if optional and text.lower() in ("auto", "none"):
        return None
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"--{name} takes true or false, got {text!r}")
    if typing.get_origin(kind) is list:  # list[float], the one kind of list field
        try:
            return number_list(text)
        except ValueError:
            raise ConfigError(f"--{name}={text!r} is not a comma-separated list of numbers") from None
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"--{name} takes {kind.__name__}, got {text!r}") from None


def _canonical(flag: str) -> tuple[str, bool]:
    """Map '--some-flag' to ('some_flag', negated)."""
    name = flag[2:].replace("-", "_")
    name = ALIASES.get(name, name)
    if name not in _FIELDS and name.startswith("no_") and name[3:] in _FIELDS:
        return name[3:], True
    return name, False


def _is_alias(flag: str) -> bool:
    return flag[2:].replace("-", "_") in ALIASES


def _usage(recipe: Config) -> str:
    lines = [
        "usage: python -m fasttrain [--recipe NAME] [--flag=value ...]",
        "",
        f"recipes: {', '.join(RECIPES)}. Booleans: --flag, --no-flag, --flag=false. Lists: --flag=1,2,3.",
        f"Defaults shown are recipe {recipe.recipe}'s (the demo is trained when no --recipe is named; "
        "--recipe NAME --help shows another's).",
        "",
    ]
    for name, doc in _field_docs().items():
        lines.append(f"  --{name:<34} {doc} [default: {_flag_text(getattr(recipe, name))}]")
    return "\n".join(lines)


def flags_table() -> str:
    """README's flags table: each field's base default, the recipes' values where one differs from it,
    and its docstring (tests/test_config.py checks README.md holds exactly this)."""
    lines = [
        f"| flag | base | {' / '.join(RECIPES)} | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, doc in _field_docs().items():
        field = _FIELDS[name]
        base = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        values = [getattr(recipe, name) for recipe in RECIPES.values()]
        per_recipe = " / ".join(map(_cell, values)) if any(v != base for v in values) else ""
        meaning = doc.replace("|", "\\|")  # a bare | would end the cell
        lines.append(f"| `--{name}` | {_cell(base)} | {per_recipe} | {meaning} |")
    return "\n".join(lines)


def _flag_text(value) -> str:
    """A value as it is spelled on the command line."""
    if isinstance(value, list):
        return ",".join(f"{v:g}" for v in value)
    return "(empty)" if value == "" else str(value)


def _cell(value) -> str:
    return "(empty)" if value == "" else f"`{_flag_text(value)}`"


def _field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal under it in Config's source), on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(Config)))
    docs, last = {}, None
    for node in tree.body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            last = node.target.id
        elif last and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[last] = " ".join(str(node.value.value).split())
            last = None
    return {name: docs.get(name, "") for name in _FIELDS}


if __name__ == "__main__":  # README's flags table, to paste between its markers
    print(flags_table())
