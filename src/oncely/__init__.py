"""oncely: exactly-once effects for LLM steps in business workflows."""

__version__ = "0.1.0"
