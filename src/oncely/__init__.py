"""oncely: exactly-once effects for LLM steps in business workflows.

The public API: declare a ``Workflow`` (request model, step, result model,
effects), register it on an ``App``, and run ``oncely --app module:app …``.
See the docs/tutorial.md.

The names below are imported when first used, so that ``import
oncely.client`` (the HTTP client) loads none of the server's libraries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.lazy import exports

__version__ = "0.1.0"

# Each public name, and the module that defines it.
_EXPORTS = {
    "Agent": "oncely.agent",
    "AgentLimitReached": "oncely.agent",
    "AgentRun": "oncely.agent",
    "ApprovalDecision": "oncely.agent",
    "ToolCallRecord": "oncely.agent",
    "App": "oncely.app",
    "Email": "oncely.effects",
    "EmailEffect": "oncely.effects",
    "Event": "oncely.effects",
    "WebhookEffect": "oncely.effects",
    "email": "oncely.effects",
    "webhook": "oncely.effects",
    "CallFailed": "oncely.errors",
    "DeadlineExceeded": "oncely.errors",
    "PermanentError": "oncely.errors",
    "TransientError": "oncely.errors",
    "JobRecord": "oncely.jobs.store",
    "Emitted": "oncely.journal",
    "InvalidOutput": "oncely.llm.model",
    "ToolSpec": "oncely.llm.base",
    "Model": "oncely.llm.model",
    "Reply": "oncely.llm.model",
    "ToolCall": "oncely.llm.model",
    "Tool": "oncely.tools",
    "ToolContext": "oncely.tools",
    "call_tool": "oncely.tools",
    "tool": "oncely.tools",
    "Usage": "oncely.llm.model",
    "Deadline": "oncely.retry",
    "RetryPolicy": "oncely.retry",
    "Evaluation": "oncely.shadow.evaluate",
    "ModelJudge": "oncely.shadow.evaluate",
    "field_agreement": "oncely.shadow.evaluate",
    "ChildResult": "oncely.context",
    "Mapped": "oncely.context",
    "Context": "oncely.context",
    "ApprovalView": "oncely.views",
    "ChildrenView": "oncely.views",
    "JobView": "oncely.views",
    "StepView": "oncely.views",
    "UsageView": "oncely.views",
    "WaitingView": "oncely.views",
    "Timetable": "oncely.timetable",
    "Variant": "oncely.workflow",
    "Workflow": "oncely.workflow",
}

__all__ = [
    "Agent",
    "AgentLimitReached",
    "AgentRun",
    "App",
    "ApprovalDecision",
    "ApprovalView",
    "CallFailed",
    "ChildResult",
    "ChildrenView",
    "Context",
    "Deadline",
    "DeadlineExceeded",
    "Email",
    "EmailEffect",
    "Emitted",
    "Evaluation",
    "Event",
    "InvalidOutput",
    "JobRecord",
    "JobView",
    "Mapped",
    "Model",
    "ModelJudge",
    "PermanentError",
    "Reply",
    "RetryPolicy",
    "StepView",
    "Timetable",
    "Tool",
    "ToolCall",
    "ToolCallRecord",
    "ToolContext",
    "ToolSpec",
    "TransientError",
    "Usage",
    "UsageView",
    "Variant",
    "WaitingView",
    "WebhookEffect",
    "Workflow",
    "__version__",
    "call_tool",
    "email",
    "field_agreement",
    "tool",
    "webhook",
]

if TYPE_CHECKING:
    from oncely.agent import Agent, AgentLimitReached, AgentRun, ApprovalDecision, ToolCallRecord
    from oncely.app import App
    from oncely.context import ChildResult, Context, Mapped
    from oncely.effects import Email, EmailEffect, Event, WebhookEffect, email, webhook
    from oncely.errors import CallFailed, DeadlineExceeded, PermanentError, TransientError
    from oncely.jobs.records import JobRecord
    from oncely.journal import Emitted
    from oncely.llm.base import ToolSpec
    from oncely.llm.model import InvalidOutput, Model, Reply, ToolCall, Usage
    from oncely.retry import Deadline, RetryPolicy
    from oncely.shadow.evaluate import Evaluation, ModelJudge, field_agreement
    from oncely.timetable import Timetable
    from oncely.tools import Tool, ToolContext, call_tool, tool
    from oncely.views import (
        ApprovalView,
        ChildrenView,
        JobView,
        StepView,
        UsageView,
        WaitingView,
    )
    from oncely.workflow import Variant, Workflow


__getattr__ = exports(globals(), _EXPORTS)


def __dir__() -> list[str]:
    return __all__
