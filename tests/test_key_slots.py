"""Every Lua script and transaction touches keys of one Redis Cluster slot."""

from __future__ import annotations

import dataclasses

from redis.crc import key_slot

from oncely import names
from oncely.builtin import app as builtin_app


def test_a_workflows_keys_share_one_slot_and_workflows_spread() -> None:
    slots = {}
    for workflow in builtin_app:
        keys = dataclasses.asdict(workflow.keys)
        redis_keys = [v for k, v in keys.items() if k not in ("workflow", "group")]
        assert len({key_slot(k.encode()) for k in redis_keys}) == 1, workflow.name
        slots[workflow.name] = key_slot(workflow.keys.stream.encode())
    assert len(set(slots.values())) == len(slots), "workflows hash to different slots"


def test_the_limiters_keys_share_one_slot() -> None:
    keys = [names.LLM_PAUSE, names.LLM_RPM, names.LLM_TPM, names.LLM_SHARE_RPM, names.LLM_SHARE_TPM]
    assert len({key_slot(k.encode()) for k in keys}) == 1


def test_a_shadow_variants_keys_live_in_its_workflows_slot() -> None:
    for workflow in builtin_app:
        keys = dataclasses.asdict(names.shadow_keys(workflow.name, "fake-v2"))
        redis_keys = [v for k, v in keys.items() if k not in ("workflow", "group")]
        slots = {key_slot(k.encode()) for k in redis_keys}
        assert slots == {key_slot(workflow.keys.stream.encode())}, workflow.name
