"""The web console at ``/console``: server-rendered pages for operators.

Per workflow of the app: jobs by status, stream backlog and consumers, the
outbox; a job's request, result, deliveries and outbox rows; dead letters
with replay and failed outbox rows with retry. Behind the operator key
(``ONCELY_CONSOLE_KEY``); without one, ``create_app`` serves no console.
"""

from oncely.console.routes import console_router

__all__ = ["console_router"]
