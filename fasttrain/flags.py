"""The command line's flags: one per Config field, and `--help` and README's flags table drawn from the
same fields, docstrings and recipes.

`--field=value` or `--field value` (not a next word that starts with --: `--train_dir --max_steps=3`
is "--train_dir needs a value"), `_` and `-` both accepted; booleans also `--field`, `--no-field`,
TF's `--nofield` and `--field=false`; a field typed `X | None` takes auto or none for None; a list field
takes its items comma-separated (`--lr_boundary_epochs=30,60,80,90`). The recipe sets the defaults and
the flags override it: --recipe's, else the seed's whose own flags the command line holds
(`seed_recipe`), else the demo's. `python -m fasttrain.flags` prints README's table.

The seeds' command lines are accepted as they are spelled: the ResNet seed's (imagenet_main.py) names
that are not field names are aliases (config.ALIASES, and seed_flags.SEED_CONVERSIONS for the two whose
value changes convention); the flags of either seed that fasttrain has no use for are taken with a
one-line note on stderr saying what it does instead (seed_flags.NOTED_FLAGS). An unknown flag names the
closest known one.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import textwrap
import typing

from fasttrain.cli_parser import closest
from fasttrain.config import ALIASES, RECIPES, Config, ConfigError, make_config, number_list
from fasttrain.config_checks import without_effect
from fasttrain.seed_flags import (  # noqa: F401 (BOTH_SEEDS_FLAGS ...: re-exported for the tests)
    BOTH_SEEDS_FLAGS,
    INCEPTION_SEED_FLAGS,
    NOTED_BOOLEANS,
    NOTED_FLAGS,
    REFUSED_FLAGS,
    RESNET_SEED_FLAGS,
    SEED_CONVERSIONS,
    machine_batch,
    seed_recipe,
)

_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_HINTS = typing.get_type_hints(Config)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# Shown by --help after the flags: the other commands a user reaches for.
ENTRY_POINTS = (
    ("python -m fasttrain selfcheck", "check this machine's GPU paths against their references"),
    (
        "python -m fasttrain.data",
        "check, list, build TFRecord shards and their JPEG row checkpoints (verify, ls, make-synthetic, "
        "build, row-checkpoints, warm-up)",
    ),
    ("python -m fasttrain.evaluate RUN_DIR", "evaluate a run's checkpoint on the validation split"),
    ("python -m fasttrain.plot RUN_DIR ...", "plot runs' loss, LR and accuracy curves"),
    (
        "python -m fasttrain.tf.convert",
        "convert the seeds' TensorFlow checkpoints and fasttrain's (or: python -m fasttrain.convert)",
    ),
)


def parse_args(argv: list[str]) -> Config:
    """Build the Config for a command line: the recipe's defaults, then the flags in order.

    A flag given twice keeps its last value (scripts append overrides), but a seed alias and its field
    (--train_batch_size and --batch_size) with different values are refused: which one was meant?
    Without --recipe, a seed's own flags select its recipe (`seed_recipe`), else the demo's.
    `--help` prints the flags with the named recipe's defaults and exits.
    """
    return parse_command_line(argv)[0]


def parse_command_line(argv: list[str]) -> tuple[Config, str]:
    """parse_args's Config, and the start-up line saying which recipe the seed's flags selected ('' when
    --recipe names it, or when it is the demo)."""
    values: dict[str, object] = {}
    spelled: dict[str, str] = {}  # field -> the flag that set it
    given: dict[str, object] = {}  # field -> the value as that flag gave it (before a seed conversion)
    notes: dict[str, str] = {}  # flag -> its note, each printed once
    seen: dict[str, str] = {}  # every flag's name as typed ('-' as '_', before aliases) -> the flag
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
        raw = flag[2:].replace("-", "_")
        if tf_false := _tf_negation(raw):  # --nofine_tune: TF's --fine_tune=false
            raw = tf_false
        seen.setdefault(raw, flag)
        if raw in REFUSED_FLAGS:
            raise ConfigError(REFUSED_FLAGS[raw])
        if raw in NOTED_FLAGS:
            if tf_false and eq:
                raise ConfigError(f"{flag} takes no value")
            # Its value, if any, is the next word unless that is a flag: --sync, --log_dir /data/logs.
            if not tf_false and not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
            notes.setdefault(raw, f"{flag} is accepted for the seeds' command lines: {NOTED_FLAGS[raw]}")
            i += 1
            continue
        name, negated = (ALIASES.get(raw, raw), True) if tf_false else _canonical(flag)
        if name not in _FIELDS:
            raise ConfigError(
                f"unknown flag {flag}{_suggestion(raw)} (python -m fasttrain --help lists the flags)"
            )
        is_bool = _is_bool(name)
        if negated:
            if not is_bool:
                raise ConfigError(
                    f"{flag}: --no- is for on/off flags, and --{name} takes a value (--{name}=VALUE)"
                )
            if eq:
                raise ConfigError(f"{flag} takes no value")
            value = False
        elif eq:
            value = _convert(name, text)
        elif is_bool and (i + 1 >= len(argv) or argv[i + 1].lower() not in _TRUE + _FALSE):
            value = True
        else:
            # The next word is a flag, not this one's value: taking it made `--train_dir --max_steps=3`
            # a run directory named --max_steps=3. A value that starts with -- is spelled --flag=VALUE.
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                after = f" ({argv[i + 1]} is the next flag; write {flag}=VALUE)" if i + 1 < len(argv) else ""
                raise ConfigError(f"{flag} needs a value{after}")
            i += 1
            value = _convert(name, argv[i])
        typed = value
        if raw in SEED_CONVERSIONS:
            _, convert, why = SEED_CONVERSIONS[raw]
            value = convert(value)
            if why and value != typed:
                notes[raw] = f"{flag}={_flag_text(typed)} sets --{name}={_flag_text(value)} ({why})"
        before = spelled.get(name)
        if before is not None and _is_alias(before) != _is_alias(flag) and values[name] != value:
            was, now = _flag_text(given[name]), _flag_text(typed)
            raise ConfigError(f"{before}={was} and {flag}={now} conflict; give one of them")
        values[name], spelled[name], given[name] = value, flag, typed
        i += 1
    chosen = ""
    if "recipe" not in values and (seed := seed_recipe(seen, values)):
        values["recipe"], chosen = seed
    machine_batch(values, spelled, notes)
    if wants_help:
        print(_usage(make_config(recipe=values.get("recipe", "demo"))))
        raise SystemExit(0)
    if values.get("node_batch_size") and "batch_size" in values:
        raise ConfigError(
            f"{spelled['node_batch_size']}={values['node_batch_size']} (one node's batch, divided over its "
            f"processes) and {spelled['batch_size']}={values['batch_size']} (one process's) conflict; "
            "give one of them"
        )
    if values.get("model") == "inception_v3" and "base_channels" not in values:
        # A ResNet recipe's width (the demo's 16) is no setting of Inception's: the model given instead
        # takes its own, where the error named a --base_channels the user never typed.
        values["base_channels"] = 64
    if values.get("train_epochs") and "max_steps" not in values:
        # The run's length in epochs, as asked: the recipe's max_steps (the demo's 300, the Inception
        # seed's 10,000,000) would otherwise end it, and --train_epochs did nothing without a word.
        values["max_steps"] = 0
    cfg = make_config(**values)
    for name, why in without_effect(cfg, spelled).items():
        notes[f"{name} (unused)"] = f"{spelled[name]} has no effect: {why}"
    _print_notes(notes.values())
    return cfg, chosen


def _print_notes(notes) -> None:
    """Each note once per command line, from one process: under torchrun every rank parses the flags."""
    if os.environ.get("RANK", "0") != "0":
        return
    for note in notes:
        sys.stderr.write(f"fasttrain: note: {note}\n")


def known_flags() -> list[str]:
    """Every flag name the parser takes (fields, the seeds' aliases, the noted flags), `_` spelled."""
    return sorted({*_FIELDS, *ALIASES, *SEED_CONVERSIONS, *NOTED_FLAGS})


def _suggestion(name: str) -> str:
    """'; did you mean --max_steps?' for the closest known flag (fasttrain.cli_parser.closest)."""
    close = closest(name, known_flags())
    return f"; did you mean --{close}?" if close else ""


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
    name = ALIASES.get(name, SEED_CONVERSIONS.get(name, (name,))[0])
    if name not in _FIELDS and name.startswith("no_") and name[3:] in _FIELDS:
        return name[3:], True
    return name, False


def _is_bool(name: str) -> bool:
    return bool in (_HINTS[name], *typing.get_args(_HINTS[name]))


def _tf_negation(raw: str) -> str:
    """'fine_tune' for 'nofine_tune': TF's flags (absl) spell a boolean's false --noNAME, as the Inception
    seed's --nofine_tune and --nolog_device_placement do; '' when raw is a flag of its own or NAME is no
    field (a field that takes a value is returned, for its error) nor a noted boolean."""
    base = raw[2:]
    if not raw.startswith("no") or raw in known_flags() or base.startswith("_"):
        return ""
    return base if base in NOTED_BOOLEANS or ALIASES.get(base, base) in _FIELDS else ""


def _is_alias(flag: str) -> bool:
    name = flag[2:].replace("-", "_")
    return name in ALIASES or name in SEED_CONVERSIONS


def _usage(recipe: Config) -> str:
    lines = [
        "usage: python -m fasttrain [--recipe NAME] [--flag=value ...]",
        "",
        f"recipes: {', '.join(RECIPES)}. Booleans: --flag, --no-flag (TF's --noflag), --flag=false. "
        "Lists: --flag=1,2,3.",
        f"Defaults shown are recipe {recipe.recipe}'s (without --recipe: the demo, or the seed's recipe "
        "its own flags select; --recipe NAME --help shows another's).",
        "",
    ]
    for name, doc in _field_docs().items():
        lines.append(f"  --{name:<34} {doc} [default: {_flag_text(getattr(recipe, name))}]")
    lines += ["", "The seeds' spellings: " + ", ".join(f"--{a} (--{f})" for a, f in _seed_aliases().items())]
    lines.append("Accepted with a note (no effect): " + ", ".join(f"--{n}" for n in NOTED_FLAGS))
    lines.append("Refused, saying what to give instead: " + ", ".join(f"--{n}" for n in REFUSED_FLAGS))
    lines += ["", "Other commands:"]
    lines += [f"  {command:<38} {what}" for command, what in ENTRY_POINTS]
    return "\n".join(lines)


def _seed_aliases() -> dict[str, str]:
    return {**ALIASES, **{name: spec[0] for name, spec in SEED_CONVERSIONS.items()}}


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
        shown = "(none)" if name == "recipe" and base is None else _cell(base)  # no recipe, not "auto"
        lines.append(f"| `--{name}` | {shown} | {per_recipe} | {meaning} |")
    return "\n".join(lines)


def _flag_text(value) -> str:
    """A value as it is spelled on the command line (None: `auto`, which the parser takes for it)."""
    if value is None:
        return "auto"
    if isinstance(value, list):
        return ",".join(f"{v:g}" for v in value)
    if isinstance(value, float):  # 12 digits: 1 - 0.997 shows as 0.003, 1.001e-05 as itself
        return f"{value:.12g}"
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
