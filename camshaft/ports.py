"""Listening sockets for the servers: a host and port refused before any engine loads, saying why."""

from __future__ import annotations

import errno
import socket

from camshaft.errors import CamshaftError


def listen_error(host: str, port: int, exc: OSError, flags: str) -> CamshaftError:
    """What a failed bind means for the user (`flags`: the options that set the port)."""
    if isinstance(exc, socket.gaierror):
        return CamshaftError(f"--host {host} is no address of this machine ({exc.strerror}); pass an address such "
                             "as 127.0.0.1 or 0.0.0.0")
    if exc.errno == errno.EADDRINUSE:
        return CamshaftError(f"port {port} on {host} is in use; pick another ({flags}) or stop what listens there")
    hint = ("ports below 1024 need privileges: pick a higher one" if exc.errno == errno.EACCES else
            "pass an address of this machine, such as 127.0.0.1 or 0.0.0.0"
            if exc.errno == errno.EADDRNOTAVAIL else "pick another host or port")
    return CamshaftError(f"cannot listen on {host} port {port} ({exc.strerror}); {hint}")


def bound_socket(host: str, port: int, flags: str = "--port") -> socket.socket:
    """A TCP socket bound to host:port (IPv4 or IPv6, as the host resolves), for a server to listen on."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise listen_error(host, port, exc, flags) from None
    except (OverflowError, UnicodeError):
        raise CamshaftError(f"--host {host} port {port} is not an address and port to listen on") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closing socket in TIME_WAIT is no listener
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise listen_error(host, port, exc, flags) from None
    return sock
