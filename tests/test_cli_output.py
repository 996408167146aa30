"""The operator CLI prints stored text literally: rich markup in a tenant's
text is not read as markup (no crash, no live hyperlink, nothing hidden),
control characters and bidi overrides are shown as escapes, and lists stay
readable at 80 columns (a pipe, or a default terminal): no value is left
out. Real `oncely` commands on real Redis and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg.types.json import Jsonb
from pydantic import SecretStr

from oncely.api.auth import create_api_key
from oncely.cli.terminal import literal
from oncely.jobs.records import JobSpec
from oncely.usage.calls import Call, CallSite
from oncely.usage.ledger import Ledger
from oncely.usage.prices import Prices
from tests.helpers import record_cached_calls
from tests.processes import oncely, servers_env

ESC = "\x1b"
MARKUP = "hello [/bold] world. [link=https://evil.example/reset]reset here[/link] [conceal]hidden"
HOSTILE = f"{ESC}[31mred{ESC}[0m \u202eevil\u202c \x9b2J bell\x07"


@pytest.fixture
def env(redis_url: str, database_url: str) -> dict[str, str]:
    # A pipe: rich prints 80 columns wide, as on a default terminal.
    return servers_env(redis_url, database_url, COLUMNS="80")


def run(*args: str, env: dict[str, str]) -> str:
    done = oncely(*args, env=env)
    assert done.returncode == 0, done.stderr
    assert ESC not in done.stdout and "\u202e" not in done.stdout and "\x9b" not in done.stdout
    assert ESC not in done.stderr
    return done.stdout


def test_literal_escapes_every_hidden_character_and_nothing_else() -> None:
    assert literal("plain [bold] text, ünïcödé ✓") == "plain [bold] text, ünïcödé ✓"
    assert literal(HOSTILE) == "\\x1b[31mred\\x1b[0m \\u202eevil\\u202c \\x9b2J bell\\x07"
    assert literal("a\nb\tc\u200bd\u2066e\ufeff") == "a\\x0ab\\x09c\\u200bd\\u2066e\\ufeff"


def test_literal_escapes_tags_selectors_and_blank_fillers() -> None:
    # Tag characters spell hidden ASCII; variation selectors and fillers
    # render as nothing; all are shown, as is any format character.
    hidden = "ok\U000e0041\U000e0042 x\ufe0f y\U000e0100 \u3164z \u2800 \u180e"
    assert literal(hidden) == (
        "ok\\U000e0041\\U000e0042 x\\ufe0f y\\U000e0100 \\u3164z \\u2800 \\u180e"
    )
    assert literal("a\nb", keep="\n") == "a\nb"
    assert literal("日本語 é ✓ 🙂") == "日本語 é ✓ 🙂"


@pytest.mark.slow
async def test_jobs_show_prints_markup_and_escapes_literally(jobs, env) -> None:
    job_id = str(uuid.uuid4())
    payload = {"subject": MARKUP[:300], "body": HOSTILE}
    await jobs.accept(JobSpec(job_id, "acme [b]", "triage", payload))
    await jobs.mark_dead(job_id, f"permanent: {MARKUP}")
    out = await asyncio.to_thread(run, "jobs", "show", job_id, env=env)
    assert "hello [/bold] world." in out
    assert "[link=https://evil.example/reset]reset here[/link]" in out
    assert "[conceal]hidden" in out
    # The request is JSON (C0 escaped its way); the rest escaped by the CLI.
    assert "\\u001b[31mred" in out and "\\u202eevil" in out and "\\x9b2J" in out
    assert "tenant acme [b]" in out


@pytest.mark.slow
async def test_outbox_list_shows_a_providers_error_bytes_visibly(pool, env) -> None:
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO outbox (topic, dedupe_key, payload, attempts, last_error, failed_at)"
            " VALUES ('ticket.triaged', 'ticket_triaged:x', %s, 10, %s, now())",
            (Jsonb({}), f"500 from the provider: {HOSTILE} {MARKUP}"),
        )
    out = await asyncio.to_thread(run, "outbox", "list", "--failed", env=env)
    flat = "".join(out.split())  # a long value may fold over lines
    assert "".join(["\\x1b[31mred\\x1b[0m"]) in flat
    assert "[/bold]" in out
    assert "ticket_triaged:x" in out


@pytest.mark.slow
async def test_dlq_list_at_80_columns_leaves_no_value_out(jobs, stream, env) -> None:
    await stream.ensure_group()
    job_id = str(uuid.uuid4())
    await jobs.accept(JobSpec(job_id, "acme", "summaries", {"text": "t", "notify": "a@b.io"}))
    [(entry_id, fields)] = await stream.read_new("c1", 1, 10)
    error = f"the provider said: {MARKUP} and a long tail of words to wrap " * 2
    await jobs.mark_dead(job_id, f"permanent: {error}")
    dead = {**fields, "reason": "permanent", "deliveries": "3", "last_error": error, "dead_at": "1"}
    assert await stream.dead_letter("c1", entry_id, job_id, dead)
    out = await asyncio.to_thread(run, "dlq", "list", env=env)
    flat = "".join(out.split())
    listed = json.loads(await asyncio.to_thread(run, "dlq", "list", "--json", env=env))
    [letter] = listed
    assert letter["job_id"] == letter["dead_id"] == job_id
    for value in (job_id, "summaries", "permanent", letter["dead_at"][:19]):
        assert value in flat, (value, out)
    assert "".join(f"the provider said: {MARKUP}".split()) in flat


@pytest.mark.slow
async def test_keys_list_prints_a_tenant_name_as_it_is(pool, env) -> None:
    await create_api_key(pool, "[red]acme[/red]\u202e")
    out = await asyncio.to_thread(run, "keys", "list", env=env)
    assert "[red]acme[/red]\\u202e" in "".join(out.split())


@pytest.mark.slow
async def test_usage_report_and_tenant_usage_print_names_literally(pool, env) -> None:
    tenant, model = "[red]acme[/red]\u202e", f"[link=https://evil.example]m[/link]{ESC}[2J"
    ledger = Ledger(pool, prices=Prices.parse("plain=1/1"))
    site = CallSite("triage", str(uuid.uuid4()), tenant)
    ledger.record(Call(site, "model", model, 1, "retryable", 0, 0, 30, None))
    ledger.record(Call(site, "model", "plain", 2, "ok", 700, 300, 40, 0.001))
    assert await ledger.flush() == 2

    out = await asyncio.to_thread(run, "usage", "report", "--by", "model", env=env)
    flat = "".join(out.split())
    assert "[link=https://evil.example]m[/link]\\x1b[2J" in flat
    by_tenant = json.loads(
        await asyncio.to_thread(run, "usage", "report", "--json", "--by", "tenant", env=env)
    )
    assert by_tenant == [
        {
            "tenant": tenant,
            "calls": 2,
            "prompt_tokens": 700,
            "completion_tokens": 300,
            "cost_usd": 0.001,
            "wasted_calls": 2,  # no checkpoint kept either answer
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "cache_saved_usd": None,  # neither row knows it
            "lane_saved_usd": None,
        }
    ]
    out = await asyncio.to_thread(run, "tenants", "usage", tenant, env=env)
    assert "[red]acme[/red]\\u202e" in "".join(out.split())


@pytest.mark.slow
async def test_usage_report_by_dialect_shows_the_caches_tokens_and_savings(pool, env) -> None:
    prices = Prices.parse("claude-x=3/15/0.30/3.75,gpt-x=2/8")
    ledger = Ledger(pool, prices=prices)
    site = CallSite("triage", str(uuid.uuid4()), "acme")
    calls = [
        ("claude-x", "anthropic", 0, 2000),
        ("claude-x", "anthropic", 2000, 0),
        ("gpt-x", "chat", 500, 0),
    ]
    assert await record_cached_calls(ledger, site, 3000, calls) == 3

    rows = json.loads(
        await asyncio.to_thread(run, "usage", "report", "--json", "--by", "dialect", env=env)
    )
    by_dialect = {row.pop("dialect"): row for row in rows}
    saved = (2000 * 2.70 - 2000 * 0.75) / 1_000_000
    anthropic = by_dialect["anthropic"]
    assert (anthropic["calls"], anthropic["cached_tokens"], anthropic["cache_write_tokens"]) == (
        2,
        2000,
        2000,
    )
    assert anthropic["cache_saved_usd"] == pytest.approx(saved)
    # gpt-x has no cache prices: its cached reads cost as any input, saving nothing.
    chat = by_dialect["chat"]
    assert (chat["cached_tokens"], chat["cache_saved_usd"]) == (500, 0)
    assert chat["cost_usd"] == pytest.approx((3000 * 2 + 100 * 8) / 1_000_000)

    out = await asyncio.to_thread(run, "usage", "report", "--by", "dialect", env=env)
    flat = "".join(out.split())
    for value in ("anthropic", "chat", "cachereads", "cachewrites", "cachesaved(USD)"):
        assert value in flat, (value, out)
    assert f"{saved:.6f}" in flat, out


@pytest.mark.slow
def test_usage_commands_refuse_a_bad_group_or_period_with_exit_2(env) -> None:
    for args in (("--by", "colour"), ("--since", "yesterday")):
        done = oncely("usage", "report", *args, env=env)
        assert done.returncode == 2, done.stderr
        assert args[0] in done.stderr and "Traceback" not in done.stderr
    done = oncely("tenants", "usage", " ", env=env)
    assert done.returncode == 2 and "empty" in done.stderr


@pytest.mark.parametrize("command", [["dev"], ["api"], ["worker"], ["relay"]])
def test_app_may_follow_the_command_too(command: list[str], tmp_path, monkeypatch) -> None:
    """``oncely dev --app m:a`` (what a newcomer types) means what ``oncely
    --app m:a dev`` does: here a wrong app, refused in one line before
    anything starts."""
    from typer.testing import CliRunner

    from oncely.cli.commands import app as cli

    # The command would point the process's logging at the runner's stream,
    # closed once it returns: the tests after it would log into nothing.
    monkeypatch.setattr("oncely.logs.configure_logging", lambda *_, **__: None)

    extra = ["--data-dir", str(tmp_path)] if command == ["dev"] else []
    result = CliRunner().invoke(cli, [*command, *extra, "--app", "examples.nope:app"])
    assert result.exit_code == 2, result.output
    assert "cannot import 'examples.nope'" in result.output


def test_an_app_that_fails_as_it_is_imported_is_one_line_and_fakes_never_import_it(
    tmp_path, monkeypatch
) -> None:
    """An app reading a setting that is not set, say: the command says where
    and what in one line (exit 2); a fake serves no app and never imports it."""
    from typer.testing import CliRunner

    from oncely.cli.commands import app as cli
    from oncely.cli.invocation import load_settings

    monkeypatch.setattr("oncely.logs.configure_logging", lambda *_, **__: None)
    (tmp_path / "needs_a_token.py").write_text("import os\nTOKEN = os.environ['NO_SUCH_TOKEN']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ONCELY_APP", "needs_a_token:app")
    result = CliRunner().invoke(cli, ["status"])
    assert result.exit_code == 2, result.output
    assert "importing 'needs_a_token' raised KeyError: 'NO_SUCH_TOKEN'" in result.output
    assert "needs_a_token.py:2" in result.output and "Traceback" not in result.output
    assert load_settings(find_dev=False, app=False).app == "needs_a_token:app"


def test_help_shows_no_type_placeholder_on_a_flag() -> None:
    from typer.testing import CliRunner

    from oncely.cli.commands import app

    runner = CliRunner()
    for args in (["--help"], ["dev", "--help"], ["jobs", "list", "--help"]):
        shown = runner.invoke(app, args)
        assert shown.exit_code == 0, shown.output
        assert "<bool>" not in shown.output and "\x1b[" not in shown.output, shown.output
    assert "--version  " in runner.invoke(app, ["--help"]).output


def test_the_dev_banner_names_the_console_and_writes_no_colour_to_a_file(
    settings, monkeypatch
) -> None:
    import io

    from rich.console import Console

    from oncely.builtin import app
    from oncely.cli import dev

    def banner(**changes: object) -> str:
        out = io.StringIO()
        monkeypatch.setattr(dev, "console", Console(file=out, width=200))
        dev._banner(settings.model_copy(update=changes), 8000, "dev-key", app)
        return out.getvalue()

    on = banner(console_key=SecretStr("k" * 32))
    assert "Console      http://127.0.0.1:8000/console" in on
    assert "\x1b[" not in on and "[bold" not in on
    assert "Console      off   (set ONCELY_CONSOLE_KEY" in banner(console_key=None)
    # Which commands find the stack: from here, or with its data dir named.
    assert "oncely commands run from this directory use" in banner(data_dir=Path(".oncely"))
    elsewhere = banner(data_dir=Path("/tmp/stack"))
    assert "oncely commands run with ONCELY_DATA_DIR=/tmp/stack use" in elsewhere


async def test_batches_list_with_none_says_so(settings, monkeypatch) -> None:
    import io

    from rich.console import Console

    from oncely.cli import ops

    printed = io.StringIO()
    monkeypatch.setattr(ops, "out", Console(file=printed, width=200))
    assert await ops.show_batches(settings) == []
    assert printed.getvalue().startswith("no batches yet")


def test_console_logs_are_coloured_only_on_a_terminal(monkeypatch) -> None:
    import io

    import structlog

    from oncely.logs import colours, configure_logging

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert colours(Terminal()) and not colours(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not colours(Terminal())
    monkeypatch.delenv("NO_COLOR")
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("console")
        structlog.get_logger("t").info("worker.started", consumer="w1")
    finally:
        structlog.reset_defaults()
        root.handlers, root.level = handlers, level
    assert "worker.started" in out.getvalue() and "\x1b[" not in out.getvalue()


async def test_schedules_list_says_none_yet_for_a_schedule_that_never_ran(
    settings, monkeypatch
) -> None:
    import io

    from rich.console import Console

    from oncely.cli import ops

    printed = io.StringIO()
    monkeypatch.setattr(ops, "out", Console(file=printed, width=250))
    await ops.show_schedules(settings.model_copy(update={"app": "tests.schedule_app:app"}))
    assert "none yet" in printed.getvalue(), printed.getvalue()


@pytest.mark.parametrize("command", ["api", "fake-llm", "fake-mail", "fake-mcp"])
def test_a_server_on_a_taken_port_says_so_in_one_line(command: str, monkeypatch) -> None:
    """Rather than log the bind error and hang (the API) or print a traceback
    (the fakes): exit 69, naming the port."""
    import socket

    from typer.testing import CliRunner

    from oncely.cli.commands import app as cli

    monkeypatch.setattr("oncely.logs.configure_logging", lambda *_, **__: None)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = CliRunner().invoke(cli, [command, "--port", str(port)])
    assert result.exit_code == 69, result.output
    assert f"port {port} on 127.0.0.1 is taken" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("change", "said", "code"),
    [
        ("no_tables", "run `oncely migrate` first", 1),
        ("redis_db", "Redis refused the database number in ONCELY_REDIS_URL", 2),
    ],
)
def test_a_store_set_up_wrong_is_one_line(
    change: str, said: str, code: int, redis_url: str, database_url: str, monkeypatch
) -> None:
    """An unmigrated database, a Redis database number the server does not
    have: what to fix, in one line, never a traceback."""
    from typer.testing import CliRunner

    from oncely.cli.commands import app as cli

    monkeypatch.setattr("oncely.logs.configure_logging", lambda *_, **__: None)
    if change == "no_tables":
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute("DROP TABLE jobs CASCADE")
    else:
        redis_url = urlsplit(redis_url)._replace(path="/999").geturl()
    monkeypatch.setenv("ONCELY_REDIS_URL", redis_url)
    monkeypatch.setenv("ONCELY_DATABASE_URL", database_url)
    result = CliRunner().invoke(cli, ["status"])
    assert result.exit_code == code, result.output
    assert said in result.output and "Traceback" not in result.output


def test_a_free_port_on_any_address_family_is_free() -> None:
    """`--host ::` (IPv6, all addresses) is probed as IPv6; only an address
    in use counts as taken (a host the machine cannot bind is the server's
    to report)."""
    import socket

    from oncely.cli.invocation import port_taken

    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]
    assert not port_taken("::", port)
    assert not port_taken("0.0.0.0", port)
    assert not port_taken("no-such-host.invalid", port)


@pytest.mark.slow  # the pool waits its 10 s for first connections before asking why
def test_a_database_that_refuses_is_one_line_and_exit_69(redis_url: str, database_url: str) -> None:
    """What the server said (no such database), and 69 as for any server
    that does not serve: a script tells it from a failed gate or check."""
    missing = psycopg.conninfo.make_conninfo(database_url, dbname="no_such_database_here")
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": missing}
    done = oncely("status", env=env)
    assert done.returncode == 69, done.stderr
    last = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert 'database "no_such_database_here" does not exist' in last


def test_a_rule_across_settings_is_said_without_any_setting_s_value(monkeypatch) -> None:
    """Its input is every setting given: a key, a URL's password. The
    message names the settings; no value is echoed."""
    from typer.testing import CliRunner

    from oncely.cli.commands import app as cli

    secret = "sk-never-echoed-4242"
    monkeypatch.setenv("ONCELY_LLM_API_KEY", secret)
    monkeypatch.setenv("ONCELY_LLM_PROVIDER", "anthropic")
    monkeypatch.setenv("ONCELY_LLM_MODEL", "chat:gpt-fake")
    monkeypatch.setenv("ONCELY_DATABASE_URL", f"postgresql://u:{secret}@db/x")
    result = CliRunner().invoke(cli, ["status"])
    assert result.exit_code == 2, result.output
    assert "ONCELY_LLM_MODEL names the chat dialect" in result.output
    assert secret not in result.output and "got {" not in result.output


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("ONCELY_DATABASE_URL", "mysql://u:pw-4242@db/x", "the scheme must be postgresql"),
        ("ONCELY_DATABASE_URL", "u:pw-4242@db/x", "neither a postgresql:// URL"),
        ("ONCELY_REDIS_URL", "redis://:pw-4242@127.0.0.1:99999/3", "the port is not a number"),
        ("ONCELY_REDIS_URL", "redis://:pw-4242@127.0.0.1:6379/3x", "the database after the last"),
        ("ONCELY_PG_STATEMENT_TIMEOUT_S", "inf", "finite number"),
    ],
)
def test_a_server_url_or_bound_set_wrong_is_one_line_without_its_password(
    name: str, value: str, said: str, monkeypatch
) -> None:
    from typer.testing import CliRunner

    from oncely.cli.commands import app as cli

    monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli, ["status"])
    assert result.exit_code == 2, result.output
    assert f"{name}: " in result.output and said in result.output
    assert "pw-4242" not in result.output and "Traceback" not in result.output


def test_a_since_further_back_than_the_calendar_means_everything() -> None:
    from datetime import UTC, datetime

    from oncely.cli.invocation import parse_since

    for value in ("99999999999h", "999999d", "99999999999999999999s"):
        assert parse_since(value) == datetime(1970, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    "tenant", ["acme ", " acme", "a\nb", "a\x1b[31mb", "acme\u202e", "x" * 201]
)
def test_a_tenant_name_that_would_pass_for_another_is_refused(tenant: str) -> None:
    """`acme ` is a tenant apart that looks like `acme`; control and
    formatting characters hide what a name is: a key for one is refused
    (looking an existing tenant up takes its name as it is: it may be
    anything a caller's scheme made)."""
    from typer.testing import CliRunner

    from oncely.cli.commands import app as cli

    result = CliRunner().invoke(cli, ["keys", "create", "--tenant", tenant])
    assert result.exit_code == 2, result.output
    assert "a tenant is 1-200 characters" in result.output


def test_approve_refuses_arguments_with_a_rejection_and_a_port_out_of_range() -> None:
    import uuid

    from typer.testing import CliRunner

    from oncely.cli.commands import app as cli

    job = str(uuid.uuid4())
    rejected = ["jobs", "approve", job, "c" * 20, "--reject", "--arguments", "{}"]
    result = CliRunner().invoke(cli, rejected)
    assert result.exit_code == 2 and "a rejection runs nothing" in result.output
    for port in ("0", "99999", "-1"):
        assert CliRunner().invoke(cli, ["api", "--port", port]).exit_code == 2
