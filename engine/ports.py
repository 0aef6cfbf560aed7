"""Can a listening socket be bound? Asked before anything slow starts (torch-free, stdlib only).

`tandem serve` loads models for a while before its gateway binds; a port that is already taken
must be reported at once, in one line, not as a traceback after the load.
"""

from __future__ import annotations

import errno
import socket


def bind_error(host: str, port: int) -> str | None:
    """None if `host:port` can be bound now (as uvicorn binds: SO_REUSEADDR), else why not."""
    if port == 0:  # any free port: always possible
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve --host {host!r}: {e.strerror}"
    family, _, _, _, address = infos[0]
    try:
        with socket.create_server(address, family=family):
            return None
    except OSError as e:
        reason = (
            "is already in use"
            if e.errno == errno.EADDRINUSE
            else f"cannot be bound ({e.strerror})"
        )
        return f"port {port} on {host} {reason}; stop what holds it or pick another --port"
