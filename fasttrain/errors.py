"""The errors fasttrain raises for things a user can fix, and how the command line words them.

Library code (models, data, distributed, checkpoints) raises these with plain messages that name the
settings involved by their `Config` field names ("sync_bn needs CUDA devices"), and lists those names
in `settings`. The command line (fasttrain/__main__.py) prints one line on stderr with each of them
shown as the flag a user types (`flag_text`: "--sync_bn needs CUDA devices").
"""

from __future__ import annotations

import re


class FasttrainError(Exception):
    """A problem the user can act on; the command line prints it in one line, without a traceback.

    settings: the Config fields the message names (as plain words), for the command line to show as
    flags.
    """

    def __init__(self, message: str, *, settings: tuple[str, ...] = ()):
        super().__init__(message)
        self.settings = tuple(settings)


class SettingError(FasttrainError, ValueError):
    """A setting's value cannot work here (the command line exits 2 for it, as for a bad flag)."""


def flag_text(err: BaseException) -> str:
    """The message with each of err.settings written as a flag: `sync_bn` -> `--sync_bn`.

    Only whole words are replaced, and not inside a path or a longer name (`runs/sync_bn` and
    `--sync_bn` stay as they are).
    """
    text = str(err)
    for name in getattr(err, "settings", ()):
        text = re.sub(rf"(?<![\w/.-]){re.escape(name)}(?![\w/])", f"--{name}", text)
    return text
