"""The web console at ``/console``: server-rendered pages for operators.

Per workflow of the app: jobs by status, stream backlog and consumers, the
outbox; a job's request, result, deliveries and outbox rows; dead letters
with replay and failed outbox rows with retry. Behind the operator key
(``ONCELY_CONSOLE_KEY``); the composition root mounts it
(``oncely.bootstrap.standalone_app``), without a key it serves none.
"""

from oncely.console.routes import console_router, mount_console

__all__ = ["console_router", "mount_console"]
