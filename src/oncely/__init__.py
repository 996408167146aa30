"""oncely: exactly-once effects for LLM steps in business workflows.

The public API: declare a ``Workflow`` (request model, step, result model,
effects), register it on an ``App``, and run ``oncely --app module:app …``.
See the README, "Write your own workflow".
"""

from oncely.app import App
from oncely.effects import Email, Event, email, webhook
from oncely.errors import DeadlineExceeded, PermanentError, TransientError
from oncely.jobs.store import JobRecord
from oncely.llm.model import InvalidOutput, Model, Usage
from oncely.shadow.evaluate import Evaluation, ModelJudge, field_agreement
from oncely.workflow import Context, JobView, Variant, Workflow

__version__ = "0.1.0"

__all__ = [
    "App",
    "Context",
    "DeadlineExceeded",
    "Email",
    "Evaluation",
    "Event",
    "InvalidOutput",
    "JobRecord",
    "JobView",
    "Model",
    "ModelJudge",
    "PermanentError",
    "TransientError",
    "Usage",
    "Variant",
    "Workflow",
    "__version__",
    "email",
    "field_agreement",
    "webhook",
]
