"""The tutorial's code cites only names that exist: every function a Python
block of docs/tutorial.md calls is defined in that block, imported there,
a builtin, oncely's own, or defined in one of the examples the tutorial
points at (which run as they are)."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from pathlib import Path

import pytest

import oncely

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
EXAMPLES = ("examples.refunds", "examples.support_agent", "examples.digest")


def _names_defined(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            found |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
    return found


def _called(tree: ast.AST) -> set[str]:
    return {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


@pytest.mark.parametrize("page", ["docs/tutorial.md", "docs/fanout.md", "docs/agents.md"])
def test_every_function_a_page_calls_exists(page: str) -> None:
    known = set(dir(builtins)) | set(dir(oncely))
    for name in EXAMPLES:
        known |= set(dir(importlib.import_module(name)))
    missing = {}
    for number, block in enumerate(BLOCK.findall((ROOT / page).read_text())):
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue  # a fragment (an elided body): nothing to check
        unknown = _called(tree) - _names_defined(tree) - known
        if unknown:
            missing[number] = sorted(unknown)
    assert missing == {}, f"{page}: blocks call names defined nowhere: {missing}"


# A file of the repository as the docs cite it, from the root
# (`tests/test_maps.py`, `bench/chaos/checks.py`), from the package
# (`jobs/store.py`, `sql/jobs.sql`) or from docs/ (`reference/python.md`).
CITED = re.compile(r"`([\w-]+(?:/[\w.-]+)+\.(?:py|sql|md|yaml|yml|toml|json|html|txt))\b")
WHERE = (ROOT, ROOT / "src" / "oncely", ROOT / "src", ROOT / "docs")


def test_every_file_the_docs_cite_exists() -> None:
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    cited = {
        (str(page.relative_to(ROOT)), path)
        for page in pages
        for path in CITED.findall(page.read_text())
    }
    assert len(cited) > 50, "the pattern finds the docs' citations"
    stale = sorted(f"{page}: {path}" for page, path in cited if not _exists(path))
    assert stale == []


def _exists(path: str) -> bool:
    return any((base / path).exists() for base in WHERE)
