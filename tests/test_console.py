"""The web console: signed in by the operator key only, every page escaped,
replay and retry only with the CSRF token; and, in a real headless Chromium,
a dead job replayed from the page ends done."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from structlog.testing import capture_logs

from oncely.api.auth import create_api_key
from oncely.bootstrap import connect_llm, step_config
from oncely.builtin.summaries import summaries
from oncely.jobs import dead_letters
from oncely.jobs.handler import WorkflowHandler
from oncely.llm.model import ModelRoute
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.usage.calls import Call, CallSite
from oncely.usage.ledger import Ledger
from oncely.usage.prices import Prices
from tests.helpers import (
    asgi_app,
    count,
    drain,
    failed_outbox_row,
    job_status,
    make_worker,
    record_cached_calls,
    submit,
)
from tests.processes import api_client, free_port, post, running, start, wait_for
from tests.steps_app import SIDE_CALLS, side_calls
from tests.test_deliveries import flaky_job_done

KEY = "operator-key-for-tests-only-7f3a"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
async def console(settings, redis, pool) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the real app with the console on; not signed in."""
    app = asgi_app(settings.model_copy(update={"console_key": SecretStr(KEY)}), redis, pool)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://oncely.test") as c:
        yield c


@pytest.fixture
async def operator(console) -> httpx.AsyncClient:
    """The console client, signed in."""
    r = await console.post("/console/login", data={"key": KEY})
    assert r.status_code == 303
    return console


async def dead_summary(pool, jobs, summary_job, text: str) -> str:
    """A summaries job the real worker dead-lettered (the fake model refuses it once)."""
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    job_id = await submit(pool, stream, text)
    await drain(make_worker(stream, summary_job, pool))
    assert await job_status(pool, job_id) == "dead"
    return job_id


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([0-9a-f]{64})"', page)
    assert match, "no CSRF token on the page"
    return match.group(1)


async def test_without_a_key_there_is_no_console(client):
    assert (await client.get("/console")).status_code == 404
    assert (await client.get("/console/login", params={"key": "anything"})).status_code == 404


async def test_a_stranger_is_sent_to_the_login_form(console):
    pages = (
        "/console",
        "/console/outbox",
        "/console/usage",
        "/console/workflows/triage/dead-letters",
    )
    for path in pages:
        r = await console.get(path)
        assert (r.status_code, r.headers["location"]) == (303, "/console/login"), path
    form = await console.get("/console/login")
    assert form.status_code == 200 and 'name="key"' in form.text
    r = await console.post("/console/outbox/1/retry", data={"csrf": "0" * 64})
    assert r.status_code == 303 and r.headers["location"] == "/console/login"


async def test_a_wrong_key_is_refused(console):
    r = await console.post("/console/login", data={"key": KEY + "x"})
    assert r.status_code == 401
    assert "set-cookie" not in r.headers
    r = await console.post("/console/login", data={"key": ""})
    assert r.status_code == 401
    assert (await console.get("/console")).status_code == 303


async def test_the_right_key_sets_a_strict_httponly_cookie_without_the_key(console):
    r = await console.post("/console/login", data={"key": KEY})
    assert (r.status_code, r.headers["location"]) == (303, "/console")
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/console" in cookie
    assert KEY.lower() not in cookie
    overview = await console.get("/console")
    assert overview.status_code == 200
    assert 'id="workflow-summaries"' in overview.text and 'id="workflow-triage"' in overview.text
    assert KEY not in overview.text
    assert overview.headers["cache-control"] == "no-store"


async def test_jobs_list_filters_by_status_and_detail_escapes_the_request(
    operator, pool, jobs, summary_job
):
    job_id = await dead_summary(
        pool, jobs, summary_job, "<script>alert(1)</script> refused. [[fake:400*1]]"
    )
    dead = await operator.get("/console/workflows/summaries/jobs", params={"status": "dead"})
    assert job_id in dead.text
    done = await operator.get("/console/workflows/summaries/jobs", params={"status": "done"})
    assert job_id not in done.text
    detail = await operator.get(f"/console/workflows/summaries/jobs/{job_id}")
    assert detail.status_code == 200
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in detail.text
    assert "<script>" not in detail.text
    assert 'id="job-status" class="status-dead">dead<' in detail.text
    assert "400" in detail.text  # the error the model answered
    other = await operator.get(f"/console/workflows/triage/jobs/{job_id}")
    assert other.status_code == 404
    assert (
        await operator.get(f"/console/workflows/summaries/jobs/{uuid.uuid4()}")
    ).status_code == 404
    assert (await operator.get("/console/workflows/nope/jobs")).status_code == 404


def delivery_rows(page: str) -> list[tuple[str, str, str]]:
    """(number, outcome, error) of each row of the page's deliveries table."""
    table = page.split('<table id="deliveries">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r'<tr class="delivery outcome-[a-z]+">(.*?)</tr>', table, re.S)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for row in rows]
    return [(c[0], c[1], c[6]) for c in cells]


async def test_the_job_page_lists_every_delivery_with_its_error(
    operator, pool, jobs, worker_settings, fake_llm, summary_job
):
    job_id, _ = await flaky_job_done(pool, jobs, worker_settings)
    page = await operator.get(f"/console/workflows/summaries/jobs/{job_id}")
    assert page.status_code == 200
    rows = delivery_rows(page.text)
    assert [(n, outcome) for n, outcome, _ in rows] == [
        ("1", "retry"),
        ("2", "retry"),
        ("3", "done"),
    ]
    assert "503" in rows[0][2] and "503" in rows[1][2] and rows[2][2] == ""
    assert "Now: no message in Redis." in page.text
    assert "never reports" in page.text  # deliveries killed mid-job are not listed

    dead = await dead_summary(pool, jobs, summary_job, "Refused for good. [[fake:400*1]]")
    page = await operator.get(f"/console/workflows/summaries/jobs/{dead}")
    [(number, outcome, error)] = delivery_rows(page.text)
    assert (number, outcome) == ("1", "dead") and "400" in error


async def test_the_job_page_says_where_a_waiting_message_is(operator, pool, jobs):
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    job_id = await submit(pool, stream, "Not read yet.")
    page = await operator.get(f"/console/workflows/summaries/jobs/{job_id}")
    assert 'id="no-deliveries"' in page.text
    assert "Now: waiting in the stream for delivery #1." in page.text
    await stream.read_new("worker-a", 10, 10)
    page = await operator.get(f"/console/workflows/summaries/jobs/{job_id}")
    assert "Now: delivery #1 in flight on" in page.text and "worker-a" in page.text


async def test_replay_needs_the_csrf_token_and_happens_once(operator, pool, jobs, summary_job):
    job_id = await dead_summary(pool, jobs, summary_job, "Refused once. [[fake:400*1]]")
    page = await operator.get("/console/workflows/summaries/dead-letters")
    assert job_id in page.text
    [letter] = await dead_letters.list_dead(jobs, "summaries")
    action = f"/console/workflows/summaries/dead-letters/{letter.dead_id}/replay"
    assert action in page.text

    assert (await operator.post(action)).status_code == 403
    assert (await operator.post(action, data={"csrf": "f" * 64})).status_code == 403
    assert await job_status(pool, job_id) == "dead"

    r = await operator.post(action, data={"csrf": csrf_of(page.text)})
    assert r.status_code == 303
    assert await job_status(pool, job_id) == "queued"
    assert await dead_letters.list_dead(jobs, "summaries") == []
    after = await operator.get(r.headers["location"])
    assert "Replayed job" in after.text and job_id in after.text

    again = await operator.post(action, data={"csrf": csrf_of(page.text)}, follow_redirects=True)
    assert "not there any more" in again.text
    stream = jobs.streams["summaries"]
    assert await stream.redis.xlen(stream.stream) == 2  # the first message and one replay


async def test_retry_of_a_failed_outbox_row(operator, pool):
    row_id = await failed_outbox_row(pool, "email", "email:console-test", 8, "HTTP 500 <b>down</b>")
    page = await operator.get("/console/outbox")
    assert "email:console-test" in page.text
    assert "HTTP 500 &lt;b&gt;down&lt;/b&gt;" in page.text
    action = f"/console/outbox/{row_id}/retry"
    assert (await operator.post(action, data={})).status_code == 403
    r = await operator.post(action, data={"csrf": csrf_of(page.text)}, follow_redirects=True)
    assert r.status_code == 200 and f"Outbox row {row_id} will be sent again" in r.text
    assert await count(pool, "SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL") == 0
    assert await count(pool, "SELECT attempts FROM outbox WHERE id = %s", row_id) == 0
    again = await operator.post(action, data={"csrf": csrf_of(page.text)}, follow_redirects=True)
    assert "is not failed" in again.text


async def test_the_usage_page_shows_cost_and_wasted_calls_per_workflow_and_model(
    operator, pool, jobs, worker_settings
):
    ledger = Ledger(pool, prices=Prices.parse("oncely-fake=1000/1000"))
    async with connect_llm(worker_settings) as llm:
        handler = WorkflowHandler(
            summaries,
            jobs,
            llm,
            step_config(worker_settings),
            OutboxWakeUp(pool),
            route=ModelRoute(ledger=ledger),
        )
        stream = jobs.streams["summaries"]
        await stream.ensure_group()
        await submit(pool, stream, "Counted once. Nothing wasted.")
        await submit(pool, stream, "Asked twice. [[fake:503*1]] The first call is wasted.")
        await drain(make_worker(stream, handler, pool))
    assert await ledger.flush() == 3
    cost = await count(pool, "SELECT round(sum(cost_usd) * 1000000) FROM model_calls")

    page = await operator.get("/console/usage")
    assert page.status_code == 200
    row = re.search(
        r"<tr><td>summaries</td><td>chat</td><td class=\"id\">oncely-fake</td>(.*?)</tr>",
        page.text,
        re.S,
    )
    assert row, page.text
    cells = re.findall(r"<td>([^<]*)</td>", row.group(1))
    calls, _, _, reads, writes, shown_cost, saved, wasted = cells
    assert (calls, reads, writes, saved, wasted) == ("3", "0", "0", "0.000000", "1")
    assert float(shown_cost) == pytest.approx(cost / 1_000_000)
    # The last hour holds them too; an unknown period is the default one.
    assert row.group(0) in (await operator.get("/console/usage?since=1h")).text
    assert row.group(0) in (await operator.get("/console/usage?since=forever")).text


async def test_the_usage_page_shows_each_dialect_and_what_the_cache_saved(operator, pool):
    prices = Prices.parse("claude-x=3/15/0.30/3.75,meta-llama/llama-3=1/1")
    ledger = Ledger(pool, prices=prices)
    site = CallSite("triage", None, "acme")
    calls = [
        ("claude-x", "anthropic", 0, 4000),
        ("claude-x", "anthropic", 4000, 0),
        ("claude-x", "anthropic", 4000, 0),
        ("meta-llama/llama-3", "chat", 0, 0),
    ]
    assert await record_cached_calls(ledger, site, 5000, calls) == 4

    page = (await operator.get("/console/usage")).text
    rows = dict(
        (m[0], re.findall(r"<td>([^<]*)</td>", m[1]))
        for m in re.findall(
            r"<tr><td>triage</td><td>([a-z]+)</td><td class=\"id\">[^<]*</td>(.*?)</tr>",
            page,
            re.S,
        )
    )
    assert set(rows) == {"anthropic", "chat"}, page
    calls, _, _, reads, writes, _, saved, _ = rows["anthropic"]
    # Two reads saved 2.70 a million tokens each; the write cost 0.75 more.
    expected = (8000 * 2.70 - 4000 * 0.75) / 1_000_000
    assert (calls, reads, writes) == ("3", "8000", "4000")
    assert float(saved) == pytest.approx(expected)
    assert rows["chat"][3:5] == ["0", "0"] and rows["chat"][6] == "0.000000"
    assert '<td class="id">meta-llama/llama-3</td>' in page
    summary = re.search(r'<p id="cache-savings">(.*?)</p>', page, re.S)
    assert summary, page
    text = " ".join(summary.group(1).split())
    assert "8000 prompt tokens read, 4000 written" in text
    assert f"saved {expected:.6f} USD" in text


# -- a real browser --------------------------------------------------------------


def _chrome(profile: Path) -> Any:
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip(
            "the browser test needs Chromium and its driver at /usr/bin/chromium and "
            "/usr/bin/chromedriver: apt-get install -y chromium chromium-driver"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install 'oncely[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1280,900",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    return webdriver.Chrome(options=options, service=service)


def _shot(driver: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"console-{name}.png"))


def _sign_in_and_replay(driver: Any, base: str, job_id: str) -> None:
    """Sync selenium steps; run in a thread so the in-process fake model keeps serving."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base}/console")
    assert driver.current_url == f"{base}/console/login"
    _shot(driver, "login")
    driver.find_element(By.ID, "key").send_keys(KEY)
    driver.find_element(By.ID, "sign-in").click()
    WebDriverWait(driver, 60).until(ec.presence_of_element_located((By.ID, "workflow-triage")))
    _shot(driver, "overview")
    driver.get(f"{base}/console/workflows/triage/dead-letters")
    table = driver.find_element(By.ID, "dead-letters")
    assert job_id in table.text
    _shot(driver, "dead-letters")
    driver.find_element(By.CSS_SELECTOR, f'button.replay[data-job="{job_id}"]').click()
    alert = WebDriverWait(driver, 5).until(ec.alert_is_present())
    assert "Replay" in alert.text
    alert.accept()
    notice = WebDriverWait(driver, 60).until(ec.presence_of_element_located((By.ID, "notice")))
    assert "Replayed job" in notice.text and job_id in notice.text
    _shot(driver, "replayed")


def _job_page_says_done(driver: Any, base: str, job_id: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/console/workflows/triage/jobs/{job_id}")
    driver.refresh()
    assert driver.find_element(By.ID, "job-status").text == "done"
    assert driver.find_element(By.ID, "result").text
    outcomes = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#deliveries td.outcome")]
    assert outcomes == ["dead", "done"]  # refused once, then replayed
    _shot(driver, "job")
    driver.get(f"{base}/console/workflows/triage/jobs?status=done")
    assert job_id in driver.find_element(By.ID, "jobs").text
    _shot(driver, "jobs")
    driver.get(f"{base}/console/outbox")
    _shot(driver, "outbox")
    driver.get(f"{base}/console/usage")
    assert driver.find_element(By.TAG_NAME, "h1").text == "Model usage"
    _shot(driver, "usage")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_dead_job_replayed_in_the_browser_ends_done(
    redis_url, database_url, pool, fake_llm, tmp_path
):
    env = {
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_LLM_BASE_URL": fake_llm.url,
    }
    ticket = {"subject": "Broken", "body": "Refused once, then fine. [[fake:400*1]]"}
    await _decided_in_the_browser(
        pool,
        tmp_path,
        env,
        "/v1/triage",
        ticket,
        _sign_in_and_replay,
        stops="dead",
        then=_job_page_says_done,
    )
    assert KEY not in (tmp_path / "api.log").read_text()
    assert fake_llm.stats(contains="Refused once").prompts[0].count == 2


def _open_job_page(driver: Any, base: str, workflow: str, job_id: str) -> None:
    """Sign in, then open the job's page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base}/console/login")
    driver.find_element(By.ID, "key").send_keys(KEY)
    driver.find_element(By.ID, "sign-in").click()
    # Generous waits: the machine runs the whole suite beside the browser.
    WebDriverWait(driver, 60).until(ec.presence_of_element_located((By.ID, f"workflow-{workflow}")))
    driver.get(f"{base}/console/workflows/{workflow}/jobs/{job_id}")


def _reject_in_the_browser(driver: Any, base: str, job_id: str) -> None:
    """Sign in, find the pending approval on the job's page, reject it."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _open_job_page(driver, base, "support", job_id)
    approval = driver.find_element(By.ID, "approval")
    # The call is named by oncely's own id, never the provider's call_1.
    assert "refund" in approval.text and re.search(r"\b[0-9a-f]{20}\b", approval.text)
    assert "call_1" not in approval.text
    _shot(driver, "approval")
    driver.find_element(By.ID, "approval-reason").send_keys("too much")
    driver.find_element(By.ID, "reject").click()

    def rejected(d: Any) -> bool:
        """The decision's notice, or, once the job ended and the page
        followed it there (the notice gone with the reload), the decision
        among its checkpoints."""
        try:
            notice = d.find_elements(By.ID, "decided")
            if notice and "rejected" in notice[0].text:
                return True
            ended = d.find_element(By.ID, "job-status").text == "done"
            return ended and "too much" in d.page_source
        except StaleElementReferenceException:  # the page reloaded under us
            return False

    WebDriverWait(driver, 60).until(rejected)
    _shot(driver, "rejected")
    # No reload of our own: the page follows the job's live stream, and at
    # its end shows the job as it ended.
    WebDriverWait(driver, 60, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: d.find_element(By.ID, "job-status").text == "done"
    )
    assert not driver.find_elements(By.ID, "live"), "a finished job's page is not live"
    _shot(driver, "followed-live")


async def _decided_in_the_browser(
    pool: Any,
    tmp_path: Path,
    env: dict[str, str],
    route: str,
    body: dict[str, Any],
    decide: Callable[[Any, str, str], None],
    stops: str = "waiting",
    then: Callable[[Any, str, str], None] | None = None,
) -> dict[str, Any]:
    """An api and a worker of ``env``'s app; ``body`` posted to ``route``;
    once the job is ``stops`` (waiting for a person, or dead),
    ``decide(driver, base, job_id)`` in the browser; the job done, then
    ``then(driver, base, job_id)``, and the browser logged no error. The
    job as GET shows it."""
    driver = _chrome(tmp_path / "chromium-profile")
    key = await create_api_key(pool, "acme")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**env, "ONCELY_CONSOLE_KEY": KEY, "ONCELY_LOG_FORMAT": "json", "ONCELY_BLOCK_MS": "50"}
    api = start(["api", "--port", str(port)], env, tmp_path / "api.log")
    worker = start(["worker"], env, tmp_path / "worker.log")
    try:
        with running(api, worker):
            async with api_client(base, api, tmp_path / "api.log", key) as c:
                job_id = await post(c, route, body, f"console-{route}-1")

                async def status_is(expected: str) -> bool:
                    return await job_status(pool, job_id) == expected

                await wait_for(lambda: status_is(stops), what=f"the job {stops}")
                await asyncio.to_thread(decide, driver, base, job_id)
                await wait_for(lambda: status_is("done"), what="the job done after the decision")
                job: dict[str, Any] = (await c.get(f"{route}/{job_id}")).json()
            if then is not None:
                await asyncio.to_thread(then, driver, base, job_id)
            severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert severe == [], severe
    finally:
        driver.quit()
    return job


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_pending_approval_is_rejected_in_the_browser(
    redis_url, database_url, pool, fake_llm, tmp_path
):
    refund = '{"order_id": "A-1002", "cents": 38900, "reason": "wrong item"}'
    env = {
        "ONCELY_APP": "examples.support_agent:app",
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_LLM_BASE_URL": fake_llm.url,
    }
    body = {
        "customer": "ada@example.com",
        "message": f"Wrong armchair. [[fake:tool=refund {refund}]]",
    }
    await _decided_in_the_browser(pool, tmp_path, env, "/v1/support", body, _reject_in_the_browser)
    refunds = await count(pool, "SELECT count(*) FROM outbox WHERE topic = 'refund.issue'")
    assert refunds == 0, "a rejected refund is never sent"


def _say_it_happened_in_the_browser(driver: Any, base: str, job_id: str) -> None:
    """Open the job's page, find the uncertain call, say it happened."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _open_job_page(driver, base, "transfers", job_id)
    uncertain = driver.find_element(By.ID, "uncertain")
    assert "pay" in uncertain.text and re.search(r"\b[0-9a-f]{20}\b", uncertain.text)
    assert {"resend", "happened", "failed"} <= {
        b.get_attribute("id") for b in driver.find_elements(By.CSS_SELECTOR, "button")
    }
    _shot(driver, "uncertain")
    driver.find_element(By.ID, "uncertain-result").send_keys('{"transfer": "TR-991"}')
    driver.find_element(By.ID, "happened").click()
    # The page follows the job's live stream and reloads itself as it ends:
    # an element read across a reload is stale, and read again.
    WebDriverWait(driver, 60, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: d.find_element(By.ID, "job-status").text == "done"
    )
    _shot(driver, "uncertain-decided")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_an_uncertain_call_is_decided_in_the_browser(
    redis, redis_url, database_url, pool, tmp_path
):
    """A transfer that timed out after it may have happened waits for a
    person; the console shows it with its three choices, and the job ends
    with the result the person gave, the transfer never sent again."""
    side = tmp_path / "side-calls.jsonl"
    env = {
        "ONCELY_APP": "tests.steps_app:app",
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        SIDE_CALLS: str(side),
    }
    body = {"order": "T-browser", "fail": True}
    job = await _decided_in_the_browser(
        pool, tmp_path, env, "/v1/transfers", body, _say_it_happened_in_the_browser
    )
    assert job["result"] == {"outcome": "paid", "result": {"transfer": "TR-991"}}
    assert len(side_calls(side, "transfer")) == 1, "sent once, never again"


# -- sessions, sign-in, and what every page says -------------------------------------------


def cookie_of(response: httpx.Response) -> str:
    match = re.search(r"oncely_console=([^;]+)", response.headers["set-cookie"])
    assert match, response.headers.get("set-cookie")
    return match.group(1)


def with_cookie(console: httpx.AsyncClient, value: str) -> httpx.AsyncClient:
    """Another browser, holding ``value`` as its session cookie."""
    return httpx.AsyncClient(
        transport=console._transport,
        base_url=str(console.base_url),
        cookies={"oncely_console": value},
    )


async def test_each_login_is_its_own_session_and_signing_out_ends_that_one_alone(console, redis):
    first = cookie_of(await console.post("/console/login", data={"key": KEY}))
    second = cookie_of(await console.post("/console/login", data={"key": KEY}))
    assert first != second
    async with with_cookie(console, first) as a, with_cookie(console, second) as b:
        page = await a.get("/console")
        assert page.status_code == 200
        # Signing out needs the session's CSRF token.
        assert (await a.post("/console/logout")).status_code == 403
        assert (
            await a.post("/console/logout", data={"csrf": csrf_of((await b.get("/console")).text)})
        ).status_code == 403
        out = await a.post("/console/logout", data={"csrf": csrf_of(page.text)})
        assert (out.status_code, out.headers["location"]) == (303, "/console/login?signed_out=1")
        assert (
            'oncely_console=""' in out.headers["set-cookie"]
            or "Max-Age=0" in out.headers["set-cookie"]
        )
        # A copy of the ended session's cookie is worth nothing; the other session goes on.
        assert (await a.get("/console")).status_code == 303
        assert (await b.get("/console")).status_code == 200
    # Nothing of the session id itself is kept: only its digest names the key.
    stored = [k async for k in redis.scan_iter("oncely:console:session:*")]
    assert len(stored) == 1 and second not in stored[0]


async def test_a_session_ends_when_its_time_is_up(console, redis):
    cookie = cookie_of(await console.post("/console/login", data={"key": KEY}))
    [stored] = [k async for k in redis.scan_iter("oncely:console:session:*")]
    ttl = await redis.ttl(stored)
    assert 8 * 3600 - 60 < ttl <= 8 * 3600  # the server keeps the lifetime, not the browser
    async with with_cookie(console, cookie) as browser:
        assert (await browser.get("/console")).status_code == 200
        await redis.pexpire(stored, 1)
        await asyncio.sleep(0.05)
        assert (await browser.get("/console")).status_code == 303


async def test_a_cookie_or_csrf_token_of_any_shape_is_refused_never_a_500(console):
    for value in ("ümlaut-session", "x" * 42 + "\u00e9", "'; DROP", "a" * 43):
        raw = b"oncely_console=" + value.encode()  # UTF-8 bytes, as a browser may send
        r = await console.get("/console", headers=[(b"cookie", raw)])
        assert (r.status_code, r.headers["location"]) == (303, "/console/login"), value
    cookie = cookie_of(await console.post("/console/login", data={"key": KEY}))
    async with with_cookie(console, cookie) as browser:
        for token in ("é" * 64, "\u00ff" * 10, "zz", ""):
            r = await browser.post("/console/outbox/1/retry", data={"csrf": token})
            assert r.status_code == 403, token
    latin = await console.get("/console", headers=[(b"cookie", b"oncely_console=\xe9t\xe9")])
    assert latin.status_code == 303


async def test_failed_sign_ins_are_throttled_per_address_and_logged_with_it(console):
    with capture_logs() as logs:
        for _ in range(10):
            assert (await console.post("/console/login", data={"key": "wrong"})).status_code == 401
        throttled = await console.post("/console/login", data={"key": KEY})
    assert throttled.status_code == 429
    assert 0 < int(throttled.headers["retry-after"]) <= 60
    assert "set-cookie" not in throttled.headers
    refusals = [e for e in logs if e["event"] == "console.login_refused"]
    assert len(refusals) == 10 and refusals[0]["client"] == "127.0.0.1"
    assert [e["client"] for e in logs if e["event"] == "console.login_throttled"] == ["127.0.0.1"]
    assert KEY not in repr(logs) and "wrong" not in repr(logs)


async def test_the_key_is_never_taken_from_a_url(console):
    r = await console.get("/console/login", params={"key": KEY})
    assert r.status_code == 200 and "set-cookie" not in r.headers
    assert (await console.get("/console")).status_code == 303


async def test_pages_run_no_inline_script_and_say_nosniff(operator):
    page = await operator.get("/console")
    csp = page.headers["content-security-policy"]
    assert "unsafe-inline" not in csp and "script-src 'self'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert not re.search(r"<script>|<script [^>]*>[^<]|onclick=|<style", page.text)
    script = await operator.get("/console/assets/console.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith(
        "text/javascript"
    )
    assert script.headers["x-content-type-options"] == "nosniff"
    assert (await operator.get("/console/assets/evil.js")).status_code == 404


async def test_every_api_answer_says_nosniff_and_a_job_is_never_cached(client, auth):
    r = await client.post(
        "/v1/triage",
        json={"subject": "s", "body": "b"},
        headers={**auth, "Idempotency-Key": "nosniff-and-no-store-01"},
    )
    assert r.headers["x-content-type-options"] == "nosniff"
    job = await client.get(r.headers["location"], headers=auth)
    assert job.headers["cache-control"] == "no-store"
    assert job.headers["x-content-type-options"] == "nosniff"
    for path in ("/healthz", "/openapi.json", "/v1/nowhere"):
        assert (await client.get(path)).headers["x-content-type-options"] == "nosniff", path


@pytest.mark.slow
def test_a_short_console_key_is_refused_at_start_without_showing_it(redis_url, database_url):
    from tests.processes import oncely

    short = "hunter2-but-longer"
    env = {
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_CONSOLE_KEY": short,
    }
    refused = oncely("api", "--port", str(free_port()), env=env)
    assert refused.returncode == 2
    assert "ONCELY_CONSOLE_KEY" in refused.stderr and "at least 32 characters" in refused.stderr
    assert short not in refused.stderr + refused.stdout


async def test_stored_text_cannot_disguise_itself_on_a_page(operator, pool, jobs):
    """A bidi override, a tag character or a zero-width space in a request
    is shown as an escape, never rendered: `evil` cannot read `live`."""
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    job_id = await submit(pool, stream, "pay \u202elive\u202c now\U000e0041\u200b")
    page = (await operator.get(f"/console/workflows/summaries/jobs/{job_id}")).text
    assert "\u202e" not in page and "\U000e0041" not in page and "\u200b" not in page
    assert "\\u202elive\\u202c" in page and "\\U000e0041" in page


def test_the_overview_lists_live_consumers_and_counts_the_ones_gone_quiet() -> None:
    """A consumer idle over a minute with nothing pending (a worker that was
    killed) is counted, not listed; one with pending entries always shows."""
    from oncely.console.routes import _templates
    from oncely.queue.stream import Consumer, StreamStats

    stats = StreamStats(
        length=3,
        pending=1,
        oldest_pending_age_s=1.0,
        delayed=0,
        dead_letters=0,
        consumers=[
            Consumer("worker-live", 0, 500),
            Consumer("worker-stuck", 1, 600_000),
            Consumer("worker-gone-1", 0, 120_000),
            Consumer("worker-gone-2", 0, 3_000_000),
        ],
    )
    outbox = {"unsent": 0, "in_flight": 0, "failed": 0, "oldest_unsent_age_s": None}
    page = (
        _templates()
        .get_template("overview.html")
        .render(rows=[("summaries", {}, stats)], outbox=outbox, statuses=[], refresh=5, session="")
    )
    assert "worker-live" in page and "worker-stuck" in page
    assert "worker-gone" not in page
    assert "2 idle consumer(s) with nothing pending" in page


async def test_the_usage_page_shows_spend_and_savings_by_lane(operator, pool):
    prices = Prices.parse("gpt-x=2/8")
    ledger = Ledger(pool, prices=prices)
    site = CallSite("digest", None, "acme")
    for lane in ("batch", "batch", "flex", "standard"):
        ledger.record(
            Call(
                site,
                "model",
                "gpt-x",
                1,
                "ok",
                1000,
                100,
                10,
                prices.cost("gpt-x", 1000, 100, lane=lane),
                lane=lane,
                lane_saved_usd=prices.lane_saved("gpt-x", lane, 1000, 100),
            )
        )
    assert await ledger.flush() == 4

    page = (await operator.get("/console/usage")).text
    table = re.search(r'<table id="lanes">(.*?)</table>', page, re.S)
    assert table, page
    rows = {
        m[0]: m[1:]
        for m in re.findall(
            r"<tr><td>([a-z]+)</td><td>(\d+)</td>\s*<td>([^<]*)</td>\s*<td>([^<]*)</td>",
            table.group(1),
        )
    }
    half = (1000 * 1 + 100 * 4) / 1_000_000
    assert set(rows) == {"batch", "flex", "standard"}
    assert rows["batch"][0] == "2" and float(rows["batch"][1]) == pytest.approx(2 * half)
    assert float(rows["batch"][2]) == pytest.approx(2 * half)  # saved the other half
    assert float(rows["flex"][2]) == pytest.approx(half)
    assert (
        float(rows["standard"][1]) == pytest.approx(2 * half) and rows["standard"][2] == "0.000000"
    )
