"""The ``oncely`` command (``oncely.cli:main``) and what only it uses: the
command tree (``commands.py``), one module per command group (``keys.py``,
``dlq.py``, ``outbox.py``, ``tenants.py``, ``shadow_eval.py``, ``usage.py``,
``schedules.py``, ``jobs.py``), the processes (``processes.py``) and the fake
providers (``fake_servers.py``), what every command runs on
(``invocation.py``), the operator commands' work (``ops.py``), what ``oncely
status`` reads (``status.py``), printing stored text literally
(``terminal.py``) and ``oncely dev`` (``dev.py``, ``dev_address.py``).
Nothing outside this package imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.lazy import exports

if TYPE_CHECKING:
    from oncely.cli.commands import app

__all__ = ["app", "main"]

__getattr__ = exports(globals(), {"app": "oncely.cli.commands"})


def main() -> None:
    """Run the command line."""
    from oncely.cli.commands import main as run

    run()
