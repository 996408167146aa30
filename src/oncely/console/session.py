"""The console's sign-in: a cookie that proves the operator key without holding it.

The cookie is an HMAC of a fixed label under the key, so it reveals nothing
about the key and changes when the key does (every session ends). Write
actions also carry a CSRF token, an HMAC of the cookie, in a hidden field: a
page on another site can make the browser send the cookie, never read the
token. Every comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac

COOKIE = "oncely_console"
# A signed-in browser stays signed in this long (or until the key changes).
COOKIE_MAX_AGE_S = 8 * 3600


class ConsoleKey:
    def __init__(self, key: str) -> None:
        self._key = key.encode()
        self.cookie_value = self._sign(b"oncely.console.session")

    def _sign(self, message: bytes) -> str:
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def matches(self, candidate: str) -> bool:
        """The operator key? Compared as digests: constant time whatever its length."""
        given = hashlib.sha256(candidate.encode()).digest()
        return hmac.compare_digest(given, hashlib.sha256(self._key).digest())

    def signed_in(self, cookie: str | None) -> bool:
        return cookie is not None and hmac.compare_digest(cookie, self.cookie_value)

    def csrf_token(self) -> str:
        return self._sign(b"csrf:" + self.cookie_value.encode())

    def csrf_ok(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token, self.csrf_token())
