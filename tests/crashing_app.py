"""The built-in app with the worker's lease renewal broken, for the test that
a dead background task stops its process (tests/test_supervision.py)."""

from oncely.builtin import app
from oncely.queue.worker import Worker


async def _broken_renewal(self: Worker) -> None:
    raise RuntimeError("lease renewal broke (injected by the test)")


Worker.renew_leases = _broken_renewal  # type: ignore[method-assign]

__all__ = ["app"]
