"""Stream tokens (docs/streaming.md): a browser's ``EventSource`` cannot send
an ``Authorization`` header, so ``POST <route>/{job_id}/stream-token``
gives a token that opens that one job's stream, for a while, and nothing
else: ``GET <route>/{job_id}/stream?token=...``. A token names the API key
it was given for (by id, ``oncely keys list``'s): the stream route refuses
it once that key is revoked or erased, as it refuses the key.

A token is its claims (workflow, job, tenant, expiry) and an HMAC-SHA256 of
them under a key every API process shares: made once at random and kept in
Redis (``names.STREAM_TOKEN_KEY``, no expiry). If Redis loses it, a new key
is made and the tokens given before stop working (a client asks again).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from oncely import names
from oncely.redis_client import RedisClient

# How long a token opens its job's stream.
TOKEN_TTL_S = 600.0


@dataclass(frozen=True)
class StreamClaims:
    workflow: str
    job_id: str
    tenant: str
    expires_at: float
    # The id of the API key the token was given for (None: given without
    # one, or before tokens named their key).
    key_id: str | None = None


class StreamTokens:
    def __init__(self, redis: RedisClient, ttl_s: float = TOKEN_TTL_S) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def issue(
        self, workflow: str, job_id: str, tenant: str, key_id: str | None = None
    ) -> tuple[str, int]:
        """A token for the job's stream, and when it expires (whole unix seconds)."""
        expires_at = round(time.time() + self.ttl_s)
        claims = {"w": workflow, "j": job_id, "t": tenant, "e": expires_at, "k": key_id}
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{body}.{_b64(await self._sign(body))}", expires_at

    async def claims(self, token: str) -> StreamClaims | None:
        """The token's claims if it is genuine and unexpired, else None."""
        body, _, signature = token.partition(".")
        try:
            given = _unb64(signature)
            raw = json.loads(_unb64(body))
            key_id = None if raw.get("k") is None else str(raw["k"])
            claims = StreamClaims(
                str(raw["w"]), str(raw["j"]), str(raw["t"]), float(raw["e"]), key_id
            )
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
            return None
        if not hmac.compare_digest(given, await self._sign(body)):
            return None
        return claims if claims.expires_at > time.time() else None

    async def _sign(self, body: str) -> bytes:
        return hmac.new(await self._secret(), body.encode(), hashlib.sha256).digest()

    async def _secret(self) -> bytes:
        """The shared key, read each time (a token is made or checked once
        per stream opened), so that every process signs with the same one."""
        found = await self.redis.get(names.STREAM_TOKEN_KEY)
        if found is None:
            await self.redis.set(names.STREAM_TOKEN_KEY, secrets.token_hex(32), nx=True)
            found = await self.redis.get(names.STREAM_TOKEN_KEY)
        if found is None:
            raise RuntimeError("the stream token key could not be read")
        return found.encode() if isinstance(found, str) else bytes(found)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
