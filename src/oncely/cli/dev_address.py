"""Where a running ``oncely dev`` leaves its servers' URLs, so that every
``oncely`` command started from the same directory finds them
(docs/cli.md, "oncely dev").

The file is ``<data dir>/dev.json`` (``.oncely/dev.json`` by default), written
once the stack is up and removed when it stops; a file left by a killed
stack is ignored, since its process is gone."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FILE = "dev.json"


@dataclass(frozen=True)
class DevAddress:
    pid: int
    api_url: str
    redis_url: str
    database_url: str
    app: str
    # Where the stack's model and providers are (its fakes, unless set):
    # settings by name, for a worker or relay run apart (``--no-worker``).
    providers: dict[str, str] = field(default_factory=dict)


def publish(data_dir: Path, address: DevAddress) -> Path:
    """Write the address for other commands (only its owner may read it:
    the URLs carry no secret, but the data dir is private)."""
    path = data_dir / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(asdict(address)) + "\n")
    partial.chmod(0o600)
    partial.replace(path)
    return path


def withdraw(data_dir: Path) -> None:
    """Remove the address, if it is still this process's own."""
    found = running(data_dir)
    if found is not None and found.pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            (data_dir / FILE).unlink()


def running(data_dir: Path) -> DevAddress | None:
    """The address of the stack running from ``data_dir``, if one is."""
    try:
        address = DevAddress(**json.loads((data_dir / FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return address if _alive(address.pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True
