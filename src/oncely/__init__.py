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
    "ApprovalDecision": "oncely.decisions",
    "NOT_DONE": "oncely.decisions",
    "UncertainDecision": "oncely.decisions",
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
    "NotSent": "oncely.errors",
    "PermanentError": "oncely.errors",
    "Refused": "oncely.errors",
    "TransientError": "oncely.errors",
    "JobRecord": "oncely.jobs.records",
    "Emitted": "oncely.journal",
    "Scope": "oncely.journal",
    "InvalidOutput": "oncely.llm.model",
    "ToolSpec": "oncely.llm.base",
    "ResponseSchema": "oncely.llm.base",
    "RunLimits": "oncely.agent",
    "ToolOutcome": "oncely.tools",
    "Model": "oncely.llm.model",
    "Reply": "oncely.llm.reply",
    "ToolCall": "oncely.llm.reply",
    "Tool": "oncely.tools",
    "ToolContext": "oncely.tools",
    "Toolset": "oncely.tools",
    "mcp_tools": "oncely.mcp.client",
    "call_tool": "oncely.tools",
    "tool": "oncely.tools",
    "Usage": "oncely.llm.reply",
    "Deadline": "oncely.retry",
    "RetryPolicy": "oncely.retry",
    "Evaluation": "oncely.shadow.evaluate",
    "ModelJudge": "oncely.shadow.evaluate",
    "field_agreement": "oncely.shadow.evaluate",
    "ChildResult": "oncely.context",
    "tool_key": "oncely.context",
    "current_context": "oncely.context",
    "Mapped": "oncely.context",
    "Context": "oncely.context",
    "ApprovalView": "oncely.views",
    "DecisionView": "oncely.views",
    "ChildrenView": "oncely.views",
    "JobView": "oncely.views",
    "ResolutionView": "oncely.views",
    "StepView": "oncely.views",
    "UncertainView": "oncely.views",
    "UsageView": "oncely.views",
    "WaitingView": "oncely.views",
    "Timetable": "oncely.timetable",
    "Variant": "oncely.workflow",
    "Workflow": "oncely.workflow",
}

__all__ = [
    "NOT_DONE",
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
    "DecisionView",
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
    "NotSent",
    "PermanentError",
    "Refused",
    "Reply",
    "ResolutionView",
    "ResponseSchema",
    "RetryPolicy",
    "RunLimits",
    "Scope",
    "StepView",
    "Timetable",
    "Tool",
    "ToolCall",
    "ToolCallRecord",
    "ToolContext",
    "ToolOutcome",
    "ToolSpec",
    "Toolset",
    "TransientError",
    "UncertainDecision",
    "UncertainView",
    "Usage",
    "UsageView",
    "Variant",
    "WaitingView",
    "WebhookEffect",
    "Workflow",
    "__version__",
    "call_tool",
    "current_context",
    "email",
    "field_agreement",
    "mcp_tools",
    "tool",
    "tool_key",
    "webhook",
]

if TYPE_CHECKING:
    from oncely.agent import Agent, AgentLimitReached, AgentRun, RunLimits, ToolCallRecord
    from oncely.app import App
    from oncely.context import ChildResult, Context, Mapped, current_context, tool_key
    from oncely.decisions import NOT_DONE, ApprovalDecision, UncertainDecision
    from oncely.effects import Email, EmailEffect, Event, WebhookEffect, email, webhook
    from oncely.errors import (
        CallFailed,
        DeadlineExceeded,
        NotSent,
        PermanentError,
        Refused,
        TransientError,
    )
    from oncely.jobs.records import JobRecord
    from oncely.journal import Emitted, Scope
    from oncely.llm.base import ResponseSchema, ToolSpec
    from oncely.llm.model import InvalidOutput, Model
    from oncely.llm.reply import Reply, ToolCall, Usage
    from oncely.mcp.client import mcp_tools
    from oncely.retry import Deadline, RetryPolicy
    from oncely.shadow.evaluate import Evaluation, ModelJudge, field_agreement
    from oncely.timetable import Timetable
    from oncely.tools import Tool, ToolContext, ToolOutcome, Toolset, call_tool, tool
    from oncely.views import (
        ApprovalView,
        ChildrenView,
        DecisionView,
        JobView,
        ResolutionView,
        StepView,
        UncertainView,
        UsageView,
        WaitingView,
    )
    from oncely.workflow import Variant, Workflow


__getattr__ = exports(globals(), _EXPORTS)


def __dir__() -> list[str]:
    return __all__
