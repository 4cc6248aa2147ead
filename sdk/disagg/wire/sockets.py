"""Unix-socket listeners and TCP ports, shared by the fabric-manager server, its clients and the driver server.

Neither channel authenticates anyone yet, so who may connect is decided by file permissions: the directories
made for a socket are never open to other users, whatever the umask, and a socket is bound closed to them
(`bind_unix_socket`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

from disagg.errors import ConfigError
from disagg.lockfile import try_lock
from disagg.statedir import make_directories

SOCKET_MODE_MASK = 0o660
"""The most a socket's mode may be (`bind_unix_socket`), less the umask: connecting needs write permission."""
MAX_PORT = 65535
URI_CHARACTERS = "%?#,"
"""The characters gRPC reads as URI syntax in a ``unix:`` address: it percent-decodes the path as it binds
(``unix:/run/a%20b.sock`` is ``/run/a b.sock``, another server's perhaps), and a client takes ``?`` and ``#`` to
begin a query and a fragment, and ``,`` to separate addresses, so that it never reaches the socket."""
_UMASK = threading.Lock()
T = TypeVar("T")


def address_text_refusal(address: str) -> str:
    """Why ``address`` cannot be given to gRPC, which takes it as UTF-8 text ending at the first NUL; empty when
    it can. A name read from the command line or the environment may hold bytes that are not UTF-8."""
    if "\0" in address:
        return "it holds a NUL character, which no address or file name can"
    try:
        address.encode()
    except UnicodeEncodeError:
        return "it is not UTF-8 text, which gRPC takes addresses as"
    return ""


def unix_path_refusal(path: str) -> str:
    """Why ``path`` cannot be a unix socket's that gRPC binds, and a client reaches, as written; empty when it
    can (`URI_CHARACTERS`)."""
    found = " ".join(c for c in URI_CHARACTERS if c in path)
    if found:
        return (
            f"gRPC reads {found} in a unix socket's path as URI syntax, so it would bind or reach another path "
            f"than this one: choose a path without any of {' '.join(URI_CHARACTERS)}"
        )
    return address_text_refusal(path)


def prepare_unix_socket(path: Path) -> IO[bytes]:
    """Create the missing parent directories (`DIRECTORY_MODE`), claim the socket's path, and remove a stale
    socket file (left by a server that died); refuse a socket another server listens on, a file that is not a
    socket, or a path gRPC would not bind as written (`unix_path_refusal`), with `ConfigError`. Returns the claim,
    an ``flock`` on ``<path>.lock``, to hold for as long as the server listens: a probe of the socket alone let
    two servers started at once both pass it, and gRPC removes a socket file before it binds."""
    refused = unix_path_refusal(str(path))
    if refused:  # before anything is made or removed: gRPC would unlink and bind the path it decoded
        raise ConfigError(f"cannot listen on the unix socket {path}: {refused}", field="listen")
    lock = path.with_name(path.name + ".lock")
    try:
        make_directories(path.parent)
        claim = try_lock(lock)
    except OSError as exc:
        raise ConfigError(
            f"cannot prepare the unix socket {path}: {_claim_refusal(lock, exc)}", field="listen"
        ) from exc
    if claim is None:
        raise ConfigError(f"another server is already listening on {path}", field="listen")
    try:
        _clear(path)
    except BaseException:
        claim.close()
        raise
    return claim


def _claim_refusal(lock: Path, exc: OSError) -> str:
    """Why the claim on a socket's path could not be taken: a lock file that is not there was to be made in the
    socket's directory, which is what to name (the user never named the lock file)."""
    if exc.filename == str(lock) and not lock.exists():
        return f"no file can be made in its directory {lock.parent} ({exc.strerror})"
    return str(exc)


def bind_unix_socket(path: Path, bind: Callable[[], T], mode: int = SOCKET_MODE_MASK) -> T:
    """Run ``bind``, which creates the socket at ``path`` (gRPC's ``add_insecure_port`` binds and listens at once),
    under umask 077, then give the socket ``mode`` less the process's umask (0o600 keeps it to its owner).
    Taking permissions off after the bind left a moment in which another user could connect, and a connection
    made then is served: the kernel checks permissions as a client connects. The umask is the process's, so it
    is changed under one lock for every caller in the process, and a file another thread creates in that moment
    is made private too, never more open (and a directory keeps its owner's search permission)."""
    with _UMASK:
        umask = os.umask(0o077)
        try:
            result = bind()
        finally:
            os.umask(umask)
    try:
        path.chmod(mode & ~umask)
    except OSError as exc:
        raise ConfigError(f"cannot set the permissions of the unix socket {path}: {exc}", field="listen") from exc
    return result


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


def port_from_text(text: str) -> int | None:
    """The TCP port ``text`` writes in ASCII digits, 0 to `MAX_PORT`; None for anything else. `str.isdigit`
    alone takes other scripts' digits: ``int`` refuses some (``²``) with a bare ValueError, and reads others
    (``١٢٣``) as a number, while gRPC would be given the characters as written."""
    if not (text.isascii() and text.isdigit()):
        return None
    port = int(text)
    return port if port <= MAX_PORT else None
