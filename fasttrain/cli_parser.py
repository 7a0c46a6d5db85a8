"""The argument parser of fasttrain's other commands (evaluate, plot, tf.convert, the data tools,
selfcheck): argparse's, with its errors in one line, as the trainer's (fasttrain/flags.py).

argparse answers a mistake with its whole usage block and then the error; for a typed flag it does not
know it suggests nothing (`--max_eval_batch=1`), where the trainer says "did you mean --max_eval_batches?".
Here: `prog: error: <argparse's message>[; did you mean --x?] (--help lists the arguments)`, exit 2.
"""

from __future__ import annotations

import argparse
import difflib


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's contract: print and exit 2, never return
        self.exit(
            2, f"{self.prog}: error: {message}{self._suggestion(message)} (--help lists the arguments)\n"
        )

    def _suggestion(self, message: str) -> str:
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        known = _options(self)
        for word in message[len(prefix) :].split():
            name = word.split("=", 1)[0]
            if name.startswith("--") and (close := closest(name, known)):
                return f"; did you mean {close}?"
        return ""


def closest(name: str, known: list[str]) -> str | None:
    """The known name a typed one most likely meant: the same but for its letters' case (`--MAX_STEPS`,
    whose difflib ratio is 0), else difflib's closest at a ratio of at least 0.75 (close enough for a
    dropped or swapped letter, far enough not to guess at unrelated words); None when none is. The
    trainer's flags (fasttrain/flags.py) and the other commands' options go by it."""
    by_case = {k.lower(): k for k in known}
    if name.lower() in by_case:
        return by_case[name.lower()]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return close[0] if close else None


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """Every --option of the parser and its subcommands' parsers."""
    found = []
    for action in parser._actions:  # argparse keeps them there; there is no public list
        found += [o for o in action.option_strings if o.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _options(sub)
    return sorted(set(found))
