"""What the HTTP API's routes are handed, as types only: its clients, and
the API itself as the routes mounted beside it (the console) see it. A leaf,
so that the console and the API need not import each other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

    from oncely.api.streaming import Live
    from oncely.app import App
    from oncely.jobs.store import Jobs
    from oncely.redis_client import RedisClient


class Clients(Protocol):
    @property
    def redis(self) -> RedisClient: ...
    @property
    def pool(self) -> AsyncConnectionPool: ...


class Host(Protocol):
    """The API, as the console uses it (``oncely.api.app.OncelyAPI``)."""

    @property
    def app(self) -> App: ...
    @property
    def clients(self) -> Clients: ...
    @property
    def jobs(self) -> Jobs: ...
    @property
    def live(self) -> Live: ...
