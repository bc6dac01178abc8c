"""Listening sockets for the servers: a host and port refused before any engine loads, saying why."""

from __future__ import annotations

import contextlib
import errno
import resource
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


OPEN_FILES = 65535  # what servers raise the soft limit on open files to, as vLLM does (within the hard limit)


def raise_open_files(wanted: int = OPEN_FILES) -> None:
    """The soft limit on open files raised toward the hard one: at the common soft 1024, a server past ~1000
    connections hits EMFILE, and asyncio's accept loop then logs tracebacks at megabytes a second (CPython's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):  # a sandbox that forbids it: the limit stays
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def listening_sockets(host: str, port: int, flags: str = "--port") -> list[socket.socket]:
    """TCP sockets listening on every address `host` resolves to (localhost: 127.0.0.1 and ::1 where both are
    listed; "": every interface), as asyncio binds a host name, for a server to take over."""
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise listen_error(host, port, exc, flags) from None
    except (OverflowError, UnicodeError):
        raise CamshaftError(f"--host {host} port {port} is not an address and port to listen on") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys((f, k, p, "", a) for f, k, p, _, a in found):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closing socket in TIME_WAIT is no listener
            if family == socket.AF_INET6:  # :: beside 0.0.0.0: each family its own socket, as asyncio does
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)  # now: two servers may bind one port (SO_REUSEADDR), only one may listen
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise listen_error(host, port, exc, flags) from None
    return sockets


def url_host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host or "0.0.0.0"
