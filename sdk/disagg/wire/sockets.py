"""Unix-socket listeners, shared by the fabric-manager server and the driver server."""

from __future__ import annotations

import contextlib
import socket
import stat
from pathlib import Path
from typing import IO

from disagg.errors import ConfigError
from disagg.lockfile import try_lock


def prepare_unix_socket(path: Path) -> IO[bytes]:
    """Create the parent directory, claim the socket's path, and remove a stale socket file (left by a server
    that died); refuse a socket another server listens on, or a file that is not a socket, with `ConfigError`.
    Returns the claim, an ``flock`` on ``<path>.lock``, to hold for as long as the server listens: a probe of the
    socket alone let two servers started at once both pass it, and gRPC removes a socket file before it binds."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        claim = try_lock(path.with_name(path.name + ".lock"))
    except OSError as exc:
        raise ConfigError(f"cannot prepare the unix socket {path}: {exc}", field="listen") from exc
    if claim is None:
        raise ConfigError(f"another server is already listening on {path}", field="listen")
    try:
        _clear(path)
    except BaseException:
        claim.close()
        raise
    return claim


def _clear(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot prepare the unix socket {path}: {exc}", field="listen") from exc
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{path} exists and is not a socket; refusing to replace it", field="listen")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        except OSError as exc:
            raise ConfigError(f"cannot check the unix socket {path}: {exc}", field="listen") from exc
    raise ConfigError(f"another server is already listening on {path}", field="listen")
