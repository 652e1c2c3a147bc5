"""The supervisor's socket at the system's level: bound private, and whose process is at the other end.

`bind_private_socket` gives the socket mode 0600 from the moment it has its name (bound under a
temporary name, chmod-ed, renamed into place) and replaces only a socket nothing answers on;
`peer_uid` is what `engine/supervisor/server_connections.py` checks each connection by.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import uuid
from pathlib import Path

from engine.errors import LineError
from engine.protocol import wire

LISTEN_BACKLOG = 1024
"""Connections the kernel queues before accepting: a burst past it is refused (EAGAIN) unseen by the server."""


def peer_uid(connection: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return uid


def bind_private_socket(socket_path: Path) -> socket.socket:
    """A listening Unix socket at `socket_path`, mode 0600 from the moment it has that name.

    An existing socket there is replaced only when nothing answers on it (a crashed supervisor's
    leftover); one that answers means another supervisor serves the line: `LineError`.
    """
    directory = socket_path.parent
    info = os.stat(directory)
    if info.st_uid != os.getuid():
        raise LineError(f"{directory}: owned by uid {info.st_uid}, not by this user; refusing to serve there")
    if socket_path.exists() or socket_path.is_symlink():
        if not stat.S_ISSOCK(os.lstat(socket_path).st_mode):
            raise LineError(f"{socket_path}: exists and is not a socket; remove it")
        if _answers(socket_path):
            raise LineError(f"{socket_path}: another supervisor is serving this line")
    temporary_name = f".{socket_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    directory_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"/proc/self/fd/{directory_fd}/{temporary_name}")
        os.chmod(temporary_name, 0o600, dir_fd=directory_fd)
        os.rename(temporary_name, socket_path.name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary_name, dir_fd=directory_fd)
        raise
    finally:
        os.close(directory_fd)
    return listener


def _answers(socket_path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2)
    try:
        with wire.unix_address(socket_path) as address:
            probe.connect(address)
        return True
    except OSError:
        return False
    finally:
        probe.close()
