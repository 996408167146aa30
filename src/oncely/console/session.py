"""The console's sign-in: a session per login, kept in Redis, that ends.

Signing in with the operator key starts a session: a random id in an
HttpOnly, SameSite=Strict cookie, and on the server its SHA-256 (never the
id itself) under a key that expires ``SESSION_S`` after the login. Every
request looks the session up, so a copied cookie stops working when the
session expires or its holder signs out (``POST /console/logout`` ends that
session alone), and every session ends at once when Redis forgets them or
the key changes (a session records the key's digest). Write actions also
carry a CSRF token, an HMAC of the session id under the key, in a hidden
field: another site can make the browser send the cookie, never read the
token. Cookies and tokens of the wrong shape are refused before any lookup
or comparison, and every comparison is constant-time.

Failed sign-ins are counted per client address, fleet-wide (Redis): past
``LOGIN_FAILURES`` in ``LOGIN_WINDOW_S`` the address is refused until the
window ends, and each refusal is logged with the address.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

from oncely import names
from oncely.redis_client import RedisClient

COOKIE = "oncely_console"
# A session lasts this long after its login, whatever happens in it.
SESSION_S = 8 * 3600
# Failed sign-ins an address may make per window before it is refused.
LOGIN_FAILURES = 10
LOGIN_WINDOW_S = 60
# What ``secrets.token_urlsafe(32)`` makes, and what an HMAC-SHA256 hex is.
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{43}")
_TOKEN = re.compile(r"[0-9a-f]{64}")


class ConsoleKey:
    """The operator key: checks a candidate, signs CSRF tokens."""

    def __init__(self, key: str) -> None:
        self._key = key.encode()
        # Stored with each session: a new key ends every session.
        self.digest = hashlib.sha256(b"oncely.console.key:" + self._key).hexdigest()

    def matches(self, candidate: str) -> bool:
        """The operator key? Compared as digests: constant time whatever its length."""
        given = hashlib.sha256(candidate.encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(given, hashlib.sha256(self._key).digest())

    def csrf_token(self, session: str) -> str:
        return hmac.new(self._key, b"csrf:" + session.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, session: str, token: str | None) -> bool:
        if token is None or not _TOKEN.fullmatch(token):
            return False
        return hmac.compare_digest(token.encode(), self.csrf_token(session).encode())


class Sessions:
    """Console sessions and the sign-in throttle, in Redis."""

    def __init__(self, redis: RedisClient, key: ConsoleKey, *, lifetime_s: int = SESSION_S) -> None:
        self.redis = redis
        self.key = key
        self.lifetime_s = lifetime_s

    async def start(self) -> str:
        """A new session's id (for the cookie)."""
        session = secrets.token_urlsafe(32)
        value = f"{self.key.digest}:{time.time():.0f}"
        await self.redis.set(_stored(session), value, ex=self.lifetime_s)
        return session

    async def current(self, cookie: str | None) -> str | None:
        """The session the cookie names, while it lasts; None otherwise."""
        if cookie is None or not _SESSION_ID.fullmatch(cookie):
            return None
        value = await self.redis.get(_stored(cookie))
        if value is None or not str(value).startswith(self.key.digest + ":"):
            return None
        return cookie

    async def end(self, session: str) -> None:
        await self.redis.delete(_stored(session))

    async def refused(self, client: str) -> int:
        """Seconds until ``client`` may try again (0: it may now)."""
        key = names.console_login_failures(_digest(client))
        failures = await self.redis.get(key)
        if failures is None or int(failures) < LOGIN_FAILURES:
            return 0
        ttl = int(await self.redis.ttl(key))
        return max(ttl, 1)

    async def failed(self, client: str) -> None:
        """Count a failed sign-in from ``client`` (the window starts at the first)."""
        key = names.console_login_failures(_digest(client))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, LOGIN_WINDOW_S, nx=True)
            await pipe.execute()


def _stored(session: str) -> str:
    return names.console_session(_digest(session))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
