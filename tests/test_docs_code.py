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
import oncely.testing

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


@pytest.mark.parametrize(
    "page",
    [
        "docs/tutorial.md",
        "docs/fanout.md",
        "docs/agents.md",
        "docs/lanes.md",
        "docs/testing.md",
        "docs/at-most-once.md",
        "docs/mcp.md",
    ],
)
def test_every_function_a_page_calls_exists(page: str) -> None:
    # A page's later blocks go on from its first: oncely.testing's names are known.
    known = set(dir(builtins)) | set(dir(oncely)) | set(dir(oncely.testing))
    for name in EXAMPLES:
        known |= set(dir(importlib.import_module(name)))
    missing = {}
    for number, block in enumerate(BLOCK.findall((ROOT / page).read_text())):
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue  # a fragment (an elided body): nothing to check
        known |= _names_defined(tree)  # a page's later blocks go on from its earlier ones
        unknown = _called(tree) - known
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


# docs/architecture.md's module map: an entry is a root module or a package
# at two spaces (`  jobs/  ...`), its description the lines indented under it.
ENTRY = re.compile(r"  ([\w]+(?:\.py|/))(?: +(.*)|$)")
MODULE = re.compile(r"(?<![\w/.<-])(\w+(?:/\w+)*\.py)\b")


def _module_map() -> dict[str, str]:
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page.split("## Library and application", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    entry = None
    for line in block.splitlines():
        if (found := ENTRY.fullmatch(line)) is not None:
            entry = found[1]
            entries[entry] = found[2] or ""
        elif entry is not None and line.startswith("   "):
            entries[entry] += " " + line.strip()
        else:
            entry = None  # `src/oncely/`, `examples/`: not a module of the package
    return entries


def test_the_module_map_names_every_package_and_root_module() -> None:
    """Every package of src/oncely/ and every module at its root has an
    entry in docs/architecture.md's module map."""
    package = ROOT / "src" / "oncely"
    tree = {f"{p.parent.name}/" for p in package.glob("*/__init__.py")}
    tree |= {p.name for p in package.glob("*.py")} - {"__init__.py", "__main__.py"}
    entries = _module_map()
    assert len(entries) > 30, "the pattern finds the map's entries"
    assert sorted(tree - entries.keys()) == [], "missing from the module map"


def test_every_module_the_module_map_names_exists() -> None:
    """Each entry, and each module its description names (from its package,
    `cli/ops.py`, or from the package root, `api/streaming.py`), exists."""
    package = ROOT / "src" / "oncely"
    stale = []
    for entry, description in _module_map().items():
        if not (package / entry).exists():
            stale.append(entry)
        home = package / entry if entry.endswith("/") else package
        stale += [
            f"{entry}: {module}"
            for module in MODULE.findall(description)
            if not (home / module).exists() and not (package / module).exists()
        ]
    assert stale == []


def test_every_setting_is_in_the_settings_page() -> None:
    """Each field of ``Settings`` as the variable a user sets, in
    docs/settings.md (the two gathered from numbered or named variables as
    those)."""
    from oncely.settings import Settings

    page = (ROOT / "docs" / "settings.md").read_text()
    spelled = {"llm_api_keys": "ONCELY_LLM_API_KEY_<N>", "workflow_webhook_urls": "_WEBHOOK_URL"}
    missing = [
        name
        for name in Settings.model_fields
        if spelled.get(name, f"ONCELY_{name.upper()}") not in page
    ]
    assert missing == []
