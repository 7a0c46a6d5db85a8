"""The package layout: no import circles in fasttrain (tests/layout_graph.py reads the imports with
`ast`), internal code on the new module paths only, and every package installed by setup.py."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest
from launch_helpers import ENV
from layout_graph import ROOT, circles, import_graph, module_files

# Old module paths kept as command-line spellings only (each forwards `python -m OLD ...` to its new
# home and says so in its docstring); nothing in the repository imports them.
COMMAND_SHIMS = {"fasttrain.convert", "fasttrain.data.jpeg_rows"}


def test_no_import_circles():
    found = circles()
    assert not found, "import circles (python tests/layout_graph.py shows them):\n" + "\n".join(
        " -> ".join(circle) for circle in found
    )


def _package(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return ((tmp_path / "pkg", "pkg"),)


def test_the_graph_counts_every_kind_of_import(tmp_path):
    packages = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": """
                def later():
                    from pkg.sub import b  # a submodule, imported inside a function
            """,
            "sub/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n",
            "sub/b.py": "from .. import a\nfrom . import Name\n",  # relative: pkg.a, and pkg.sub's name
            "c.py": "import pkg.sub\n",
            "d.py": "import os\nfrom pkg.c import something\n",
        },
    )
    graph = import_graph(packages)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": {"pkg.c"},
        "pkg.sub.b": {"pkg.a", "pkg.sub"},
        "pkg.c": {"pkg.sub"},
        "pkg.d": {"pkg.c"},
    }
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.c", "pkg.sub", "pkg.c"]]


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_nothing_imports_the_old_command_paths():
    modules = module_files()
    shims = {modules[m] for m in COMMAND_SHIMS if m in modules}
    files = [*modules.values(), *ROOT.glob("bench/*.py"), *ROOT.glob("tests/**/*.py")]
    users = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & COMMAND_SHIMS)
        for path in files
        if path not in shims and _imports(path) & COMMAND_SHIMS
    }
    assert not users, f"these import an old command path instead of its new module: {users}"


def test_the_command_shims_only_forward():
    for module in COMMAND_SHIMS:
        path = module_files()[module]
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree) and "forward" in ast.get_docstring(tree).lower(), module
        assert len(path.read_text().splitlines()) < 30, f"{module} is a shim: a docstring and a call"


@pytest.mark.parametrize(
    "module, usage",
    [
        ("fasttrain.convert", "usage: python -m fasttrain.tf.convert"),
        ("fasttrain.tf.convert", "usage: python -m fasttrain.tf.convert"),
        ("fasttrain.data.jpeg_rows", "usage: python -m fasttrain.data.jpeg_rows"),
        ("fasttrain.data", "row-checkpoints"),
        ("fasttrain.evaluate", "usage: python -m fasttrain.evaluate"),
    ],
)
def test_the_command_spellings_users_type_still_run(module, usage):
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and usage in done.stdout, done.stderr


def test_setup_installs_every_package():
    setup = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call) and ast.unparse(n.func) == "setup")
    listed = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "packages"))
    packages = {m for m, path in module_files().items() if path.name == "__init__.py"}
    assert set(listed) == packages
