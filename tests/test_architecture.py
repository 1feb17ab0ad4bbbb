"""The layout the docs describe is the layout of the code (docs/architecture.md).

Reads every module of the ``kvscope`` package with :mod:`ast` (nothing is imported) and
checks three rules: each package imports only the packages its row of the table in
docs/architecture.md allows; no module imports another package's private (``_name``)
module; and no two modules import each other at run time (imports under
``if TYPE_CHECKING:`` do not count).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """kvscope's subpackages: the folders ``kvscope/`` links to."""
    return {
        p.name: p.resolve()
        for p in sorted((root / "kvscope").iterdir())
        if p.is_dir() and (p / "__init__.py").is_file()
    }


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of every subpackage."""
    out: dict[str, Path] = {}
    for name, folder in package_dirs(root).items():
        for f in sorted(folder.rglob("*.py")):
            parts = [name, *f.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out["kvscope." + ".".join(parts)] = f
    return out


def imports(mods: dict[str, Path]) -> dict[tuple[str, str], bool]:
    """(importer, imported module) -> True when every such import is type-only."""
    edges: dict[tuple[str, str], bool] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        type_only = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                type_only.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for target in names:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    key = (mod, target)
                    edges[key] = edges.get(key, True) and id(node) in type_only
                    break
    return edges


def allowed_table(text: str) -> dict[str, set[str]]:
    """The "may import" table of docs/architecture.md: package -> packages it may import."""
    rows: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^\|\s*`(\w+)/`\s*\|\s*([^|]*)\|", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    return rows


def package_of(mod: str) -> str:
    return mod.split(".")[1]


def import_cycles(edges: dict[tuple[str, str], bool]) -> list[list[str]]:
    """Strongly connected groups of two or more modules over run-time imports."""
    graph: dict[str, set[str]] = {}
    for (a, b), type_only in edges.items():
        if not type_only:
            graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


@pytest.fixture(scope="module")
def edges() -> dict[tuple[str, str], bool]:
    return imports(modules())


def test_every_package_has_a_row_in_the_table() -> None:
    table = allowed_table(DOC.read_text())
    assert set(table) == set(package_dirs()), (
        f"docs/architecture.md's table lists {sorted(table)}, the package has "
        f"{sorted(package_dirs())}: add or remove the rows"
    )


def test_packages_import_only_what_the_table_allows(edges: dict[tuple[str, str], bool]) -> None:
    table = allowed_table(DOC.read_text())
    wrong = sorted(
        f"{a} imports {b}"
        for (a, b) in edges
        if package_of(a) != package_of(b) and package_of(b) not in table.get(package_of(a), set())
    )
    assert not wrong, (
        "imports against the direction in docs/architecture.md (move the code, "
        "or change the table and say why):\n  " + "\n  ".join(wrong)
    )


def test_no_module_imports_another_packages_private_module(
    edges: dict[tuple[str, str], bool],
) -> None:
    private = sorted(
        f"{a} imports {b}"
        for (a, b) in edges
        if package_of(a) != package_of(b) and any(p.startswith("_") for p in b.split(".")[2:])
    )
    assert not private, (
        "a private module is used outside its package (make the name public "
        "in a public module):\n  " + "\n  ".join(private)
    )


def test_the_root_modules_import_nothing_of_the_subpackages() -> None:
    """``kvscope/args.py`` and the like sit below every subpackage: they import none of them
    (``__main__.py``, the ``python -m kvscope`` entry point, runs the command line)."""
    files = [
        f
        for f in sorted((ROOT / "kvscope").glob("*.py"))
        if f.name != "__main__.py" and not f.is_symlink()
    ]
    assert files, "kvscope/ has no modules of its own"
    subpackages = set(package_dirs())
    wrong = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            wrong += [
                f"{f.name} imports {n}"
                for n in names
                if n.startswith("kvscope.") and n.split(".")[1] in subpackages
            ]
    assert not wrong, "root modules must stay below every subpackage:\n  " + "\n  ".join(wrong)


def test_no_import_loops(edges: dict[tuple[str, str], bool]) -> None:
    loops = import_cycles(edges)
    assert not loops, (
        "modules importing each other at run time (move the shared part into "
        "one of them, or import it under TYPE_CHECKING if only for types): "
        + "; ".join(" <-> ".join(g) for g in loops)
    )


def test_the_checks_see_a_loop_a_private_import_and_a_wrong_direction(tmp_path: Path) -> None:
    """The rules above on a small made-up package: each kind of fault is found."""
    for pkg, files in {
        "low": {
            "__init__.py": "",
            "a.py": "from kvscope.low import b\n",
            "b.py": "from kvscope.low import a\n",
            "_secret.py": "X = 1\n",
        },
        "high": {
            "__init__.py": "",
            "c.py": "from kvscope.low._secret import X\nfrom kvscope.low.a import *\n",
        },
    }.items():
        (tmp_path / pkg).mkdir()
        for name, text in files.items():
            (tmp_path / pkg / name).write_text(text)
    (tmp_path / "kvscope").mkdir()
    (tmp_path / "kvscope" / "__init__.py").write_text("")
    for pkg in ("low", "high"):
        (tmp_path / "kvscope" / pkg).symlink_to(tmp_path / pkg)
    found = imports(modules(tmp_path))
    assert import_cycles(found) == [["kvscope.low.a", "kvscope.low.b"]]
    assert ("kvscope.high.c", "kvscope.low._secret") in found
    table = allowed_table("| `low/` | |\n| `high/` | `low` |\n")
    assert table == {"low": set(), "high": {"low"}}
    assert allowed_table("| `low/` | `high` |\n")["low"] == {"high"}
