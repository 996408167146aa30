"""What every part of the soak shares: its constants, the fleet's settings and ``say``."""

from __future__ import annotations

import base64
import re
import sys

from bench import chaos_app

TENANTS = ("acme", "globex")
ROUTES = {
    "summaries": "/v1/summaries",
    "triage": "/v1/triage",
    "reviews": chaos_app.ROUTE,
    "support": "/v1/support",
    "pai_support": "/v1/pai-support",
}
# The support agents: written with oncely.Agent (examples/support_agent.py)
# and in Pydantic AI (examples/pydantic_ai_support.py), asked and checked
# alike (an agent named ``support``: the same checkpoint keys and effects).
AGENT_WORKFLOWS = ("support", "pai_support")
# A support request's message scripts the agent's turns: the fake model
# calls ``lookup_order``, then ``refund`` (below the approval threshold),
# then answers; the refund is a call the relay sends and the fake answers.
AGENT_ORDER = "A-1001"
AGENT_REFUND_CENTS = 4_200
AGENT_TOOLS = (
    f'[[fake:tool=lookup_order {{"order_id": "{AGENT_ORDER}"}}]] '
    f'[[fake:tool=refund {{"order_id": "{AGENT_ORDER}", "cents": {AGENT_REFUND_CENTS},'
    ' "reason": "broken"}]]'
)
# The workflows the soak knows how to ask and check; it asks those ``--app`` serves.
KNOWN_WORKFLOWS = tuple(ROUTES)
DEFAULT_APP = "bench.chaos_app:app"
SCENARIOS = ("flushall", "redis-restart", "pg-restart", "redis-freeze")
DEFAULT_MODEL_FAULTS = "429=0.02,503=0.03,hang=0.005,drip=0.005,slow=0.1,badjson=0.03"
DEFAULT_MAIL_FAULTS = "503=0.03,timeout=0.01,drop=0.03"
# In the run directory: every side step's run, one JSON line each (bench.chaos_app).
SIDE_CALLS_FILE = "side-calls.jsonl"
# Set before Redis restarts; gone after, or the restart lost nothing.
SENTINEL = "chaos:sentinel"
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"chaos-soak-webhook-secret-0001").decode()
# Every request's text starts with this; the fake model's excerpts carry it.
MARKER = re.compile(r"\breq-(\d{6})\b")
# A review's prompts start with their step (bench.chaos_app.prompt).
STEP_TAG = re.compile(r"^\[step=(\w+)\] ")
# A review's model checkpoints, by the step tag of their prompts.
REVIEW_CALLS = {"model": "draft", "model#2": "final"}
# Shares of the requests that reuse their key with another body, and that
# are scripted to fail permanently.
REUSE_SHARE = 0.08
DOOMED_SHARE = 0.05
PATTERNS = ("sequential", "concurrent", "delayed")
PATTERN_WEIGHTS = (0.5, 0.3, 0.2)
# What a review's client does with the approval event: send it as soon as
# the job is accepted (mostly before it reaches its wait); once it is seen
# waiting; twice at once with one key; once, then another payload with
# another key (409); only after the job finished (409); never.
EVENT_PLANS = ("early", "late", "twice", "conflict", "after", "never")
EVENT_WEIGHTS = (0.25, 0.25, 0.15, 0.1, 0.1, 0.15)
# Reviews that get their event wait this long for it: it never times out
# in a sound run. The others time out after 1–3 s.
EVENT_WAIT_S = 60.0
SLEEP_SHARE = 0.3
# How often a client looks at its job while it waits for a status.
POLL_S = 0.3
# A side step's extra run must have started before the kept run's
# checkpoint was stored (it could not see it); this much later at most,
# for the commit's own latency and a busy event loop.
RACE_S = 1.0
# How long after a scenario (and around a kill) a job's extra model call is
# still blamed on it: the reconciler's delay plus a redelivery backoff.
SCENARIO_REACH_S = 10.0
KILL_REACH_S = 1.0

# Settings every process gets (docs/settings.md): short crash recovery,
# small backoffs and a quick reconciler, so the run converges in seconds.
FLEET_SETTINGS = {
    "ONCELY_LOG_FORMAT": "json",
    "ONCELY_LOG_LEVEL": "INFO",
    "ONCELY_BLOCK_MS": "200",
    "ONCELY_CLAIM_IDLE_MS": "3000",
    "ONCELY_REDELIVERY_BASE_S": "0.5",
    "ONCELY_REDELIVERY_MAX_S": "3",
    "ONCELY_RECONCILE_AFTER_S": "3",
    "ONCELY_LLM_TIMEOUT_S": "5",
    "ONCELY_LLM_BACKOFF_BASE_S": "0.1",
    "ONCELY_LLM_BACKOFF_MAX_S": "1",
    "ONCELY_LLM_RETRY_AFTER_MAX_S": "0.5",
    "ONCELY_JOB_BUDGET_S": "30",
    "ONCELY_JOB_GRACE_S": "3",
    "ONCELY_SENDER_TIMEOUT_S": "2",
    "ONCELY_RELAY_POLL_S": "0.5",
    "ONCELY_SHUTDOWN_GRACE_S": "3",
    "ONCELY_IDEMPOTENCY_LOCK_TTL_S": "6",
    "ONCELY_PG_POOL_MAX": "8",
    "ONCELY_WEBHOOK_SECRET": WEBHOOK_SECRET,
}

SUBJECTS = (
    ("Charged twice this month", "My billing page shows two charges for one order."),
    ("App crashes on login", "Every time I log in the app shows an error and closes."),
    ("Cannot change my email", "The account settings page refuses my new address."),
    ("Question about the roadmap", "Will there be a dark mode? It is not urgent."),
)
SENTENCES = (
    "Retries are safe.",
    "Effects happen once.",
    "The reconciler puts back what Redis forgot.",
    "Workers may die at any instant.",
    "Every send carries its dedupe key.",
    "PostgreSQL is the record of acceptance.",
)


def say(message: str) -> None:
    print(f"[chaos] {message}", file=sys.stderr, flush=True)
