"""The API fuzzed against its own OpenAPI document (schemathesis) on a real
``oncely api`` process, on the test servers, with a valid key and generated
Idempotency-Keys: no 5xx, every error problem+json, every response valid
for the document (status, content type, headers, body), 405 with ``Allow``
for undocumented methods, 401 without the key. Seeded and bounded, so a
CI run is reproducible and short.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode

from tests.processes import api_with_key, flush_redis

# A real process to start, and (fuzzing) a few hundred requests on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROBLEM = "application/problem+json"
SEED = 20261201
# Examples per operation and generation mode (valid and invalid data).
EXAMPLES = 60


@pytest.fixture(scope="module")
def fuzz_api(
    server_urls: tuple[str, str],
    module_database_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str, Path]]:
    """A real ``oncely api`` on a database of its own: (base URL, API key, log)."""
    redis_url, _ = server_urls
    flush_redis(redis_url)
    directory = tmp_path_factory.mktemp("fuzz")
    with api_with_key(
        redis_url,
        module_database_url,
        directory,
        "fuzz",
        ONCELY_DATA_DIR=str(directory),
        ONCELY_APP="tests.fuzz_app:app",
    ) as served:
        yield served


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_api: tuple[str, str, Path]) -> schemathesis.BaseSchema:
    url, _, _ = fuzz_api
    config = SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            # NUL is refused in any text (docs/decisions.md), which the
            # document cannot say of every string field.
            "generation": {
                "max-examples": EXAMPLES,
                "deterministic": True,
                "database": "none",
                "allow-x00": False,
            },
            # Invalid data may also be refused as too large (the body limit,
            # 413; the header bounds, 431), before validation.
            "checks": {
                "negative_data_rejection": {
                    "expected-statuses": [
                        "400",
                        "401",
                        "403",
                        "404",
                        "405",
                        "406",
                        "409",
                        "413",
                        "415",
                        "422",
                        "428",
                        "429",
                        "431",
                        "5xx",
                    ]
                }
            },
        }
    )
    return schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)


# The service refuses addresses at special-use domains (`.test`, `.local`,
# …: docs/decisions.md); JSON Schema's `email` format allows them.
schemathesis.openapi.format(
    "email",
    st.from_regex(r"[a-z0-9]{1,12}(\.[a-z0-9]{1,12})?@[a-z]{1,12}\.(com|org|net)", fullmatch=True),
)

# Neither shrinking nor a database of examples: each run sends the same
# requests (seeded), and a failure reports the request to reproduce it.
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


_sent = itertools.count()


def _unique_key(case) -> None:  # type: ignore[no-untyped-def]
    """A generated key made unique (still valid for the document): valid
    requests that happened to share a key would be answered 422 (reused)."""
    for name in list(case.headers or {}):
        if name.lower() == "idempotency-key":
            case.headers[name] = f"{case.headers[name][:240]}~{next(_sent):06d}"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_as_documented(fuzz_schema, fuzz_api, mode) -> None:  # type: ignore[no-untyped-def]
    _, key, _ = fuzz_api
    auth = {"Authorization": f"Bearer {key}"}
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    assert len(operations) >= 7, "both workflows' POST and GET, health, readiness, metrics"
    statuses = {operation.label: fuzz(operation, mode, auth) for operation in operations}
    print(json.dumps({label: sorted(s) for label, s in statuses.items()}))
    for method in ("POST", "GET"):
        for route in ("/v1/summaries", "/v1/triage", "/v1/refunds"):
            label = f"{method} {route}" + ("/{job_id}" if method == "GET" else "")
            assert statuses[label], f"{label} was never fuzzed"
    for label in ("POST /v1/refunds/{job_id}/cancel", "POST /v1/refunds/{job_id}/events/approval"):
        assert statuses[label], f"{label} was never fuzzed"


def fuzz(operation, mode: GenerationMode, auth: dict[str, str]) -> set[int]:  # type: ignore[no-untyped-def]
    """Send ``operation``'s generated requests; the statuses they were answered."""
    seen: set[int] = set()

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case) -> None:  # type: ignore[no-untyped-def]
        if mode is GenerationMode.POSITIVE:
            _unique_key(case)
        response = case.call_and_validate(headers=auth)
        seen.add(response.status_code)
        assert response.status_code < 500, response.text
        content_type = response.headers.get("content-type", [""])[0]
        if response.status_code >= 400:
            assert content_type.startswith(PROBLEM), content_type

    try:
        one()
    except Unsatisfiable:
        # No invalid request exists for it (no body, no parameter to break).
        assert mode is GenerationMode.NEGATIVE and not seen, operation.label
    return seen


def test_the_fuzzed_api_logged_no_request_text(fuzz_api) -> None:  # type: ignore[no-untyped-def]
    """After the fuzzing above: no unhandled error, and the log is JSON lines
    with stable event names only."""
    _, _, log = fuzz_api
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]
    assert not [e for e in events if e.get("event") == "api.unhandled"]
    assert all(e.get("level") != "error" for e in events), events
