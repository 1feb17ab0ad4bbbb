"""KV-event endpoints: where to connect for an engine's advertised publisher endpoint,
and whether the collector may.

A hello names the endpoint its engine publishes on, and the collector connects there:
left open, any engine holding an ingest token could make the collector connect
anywhere, and 1,100 such hellos exhausted its sockets (issue 44). :class:`EndpointPolicy`
therefore lets through only an endpoint on the host the hello came from (what vLLM's
default ``tcp://*:5557`` means) or on a host or network the operator allows; ``ipc://``
only when allowed. The operator's own overrides (``--kv-events-endpoint``) are not
checked. :func:`socket_budget` bounds how many subscriptions may be open at once.

Standard library only, so the command line can check its flags without the ZMQ
dependencies.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

__all__ = [
    "EndpointPolicy",
    "Refusal",
    "parse_allow",
    "parse_override",
    "resolve_endpoint",
    "socket_budget",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str], frozenset[IPAddress]]

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")

RESOLVE_TTL_S = 60.0
"""How long a host name's addresses (or its failure to resolve) are reused."""
MAX_RESOLVED = 10_000
"""Host names remembered at most; the memory is emptied when full."""
FDS_PER_SUBSCRIPTION = 2
"""Open files a subscription holds: the ZMQ socket's mailbox and its TCP connection."""
FD_SHARE = 0.5
"""Share of the process's open-file limit (``ulimit -n``) subscriptions may take; the
rest is for HTTP connections (one per engine: the plugin keeps its connection) and the
store."""


def resolve_endpoint(endpoint: str, remote: str | None) -> str | None:
    """The endpoint to connect to, or None when it cannot be reached (yet).

    A wildcard host (vLLM binds on every interface) becomes ``remote``, the address
    the engine's ingest requests come from (None: not known yet). Other hosts are
    used as given. Note that vLLM binds only wildcard (and ``ipc``) endpoints and
    *connects* its PUB socket to any other, expecting a forwarder to bind there;
    subscribing to such an address reaches nothing, so point an override at where
    the events can be subscribed to.

    >>> resolve_endpoint("tcp://*:5557", "10.0.0.7")
    'tcp://10.0.0.7:5557'
    >>> resolve_endpoint("tcp://node-3:5558", None)
    'tcp://node-3:5558'
    """
    scheme, sep, rest = endpoint.strip().partition("://")
    if not sep:
        return None
    if scheme == "ipc":
        return endpoint.strip()
    if scheme != "tcp":
        return None
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host in _WILDCARDS:
        if not remote:
            return None
        host = remote[7:] if remote.startswith("::ffff:") and "." in remote else remote
        if ":" in host:
            host = f"[{host}]"
    return f"tcp://{host}:{int(port)}"


def parse_override(text: str) -> tuple[str, str]:
    """``ENGINE_ID=tcp://host:port`` -> (engine_id, endpoint); ValueError if malformed."""
    engine_id, sep, endpoint = text.partition("=")
    engine_id, endpoint = engine_id.strip(), endpoint.strip()
    if not sep or not engine_id or resolve_endpoint(endpoint, "127.0.0.1") is None:
        raise ValueError(f"expected ENGINE_ID=tcp://host:port, got {text!r}")
    return engine_id, endpoint


def parse_allow(text: str) -> IPNetwork | str:
    """A ``--kv-events-allow`` entry: a network (``10.0.0.0/8``, an address) or a host
    name (lower case); ValueError if it is neither."""
    t = text.strip().strip("[]")
    try:
        return ipaddress.ip_network(t, strict=False)
    except ValueError:
        pass
    name = t.rstrip(".").lower()
    if not _HOSTNAME.fullmatch(name):
        raise ValueError(
            f"expected a host name, an address or a network (10.0.0.0/8), got {text!r}"
        )
    return name


class Refusal(NamedTuple):
    """Why an advertised endpoint is not subscribed to."""

    reason: str
    """``not_allowed`` or ``ipc`` (the ``reason`` label of the refusal counter)."""
    detail: str
    """What was found and what to set to allow it, for the log."""


class EndpointPolicy:
    """Which advertised KV-event endpoints the collector may connect to.

    Parameters
    ----------
    allow:
        Hosts or networks allowed besides the hello's source address (``--kv-events-allow``).
    allow_ipc:
        Whether ``ipc://`` endpoints are allowed (``--kv-events-allow-ipc``).
    resolve:
        Host name -> its IPv4 addresses (the ones ZMQ connects to without its IPv6 option);
        empty if it does not resolve. Default: :func:`socket.getaddrinfo`, remembered for
        :data:`RESOLVE_TTL_S`. It may block: call :meth:`check` off the event loop.

    >>> p = EndpointPolicy(allow=["10.9.0.0/16"])
    >>> p.check("tcp://10.0.0.7:5557", "10.0.0.7") is None  # the hello's own host
    True
    >>> p.check("tcp://10.9.3.4:5557", "10.0.0.7") is None  # an allowed network
    True
    >>> p.check("tcp://10.8.3.4:5557", "10.0.0.7").reason
    'not_allowed'
    """

    def __init__(
        self, allow: Iterable[str] = (), allow_ipc: bool = False, resolve: Resolver | None = None
    ) -> None:
        self.allow_ipc = allow_ipc
        self._networks: list[IPNetwork] = []
        self._names: set[str] = set()
        for text in allow:
            entry = parse_allow(text)
            if isinstance(entry, str):
                self._names.add(entry)
            else:
                self._networks.append(entry)
        self._resolve = resolve or self._getaddrinfo
        self._resolved: dict[str, tuple[float, frozenset[IPAddress]]] = {}

    def check(self, endpoint: str, remote: str | None) -> Refusal | None:
        """None if the collector may connect to ``endpoint`` (as :func:`resolve_endpoint`
        gives it) for an engine whose hello came from ``remote``; else why not."""
        scheme, _, rest = endpoint.partition("://")
        if scheme == "ipc":
            if self.allow_ipc:
                return None
            return Refusal(
                "ipc",
                "ipc:// (a local socket path) endpoints are not allowed: pass "
                "--kv-events-allow-ipc if the engines share this host",
            )
        host = rest.rpartition(":")[0]
        name = host.strip("[]").rstrip(".").lower()
        if name in self._names:
            return None
        addrs = self.addresses(host)
        if not addrs:
            return Refusal(
                "not_allowed",
                f"host {host} does not resolve; name the engine's endpoint with "
                "--kv-events-endpoint ENGINE_ID=tcp://HOST:PORT",
            )
        source = _address(remote) if remote else None
        if source is not None and all(_same_host(a, source) for a in addrs):
            return None
        if all(self._allowed(a) for a in addrs):
            return None
        shown = host
        if _address(host.strip("[]")) is None:  # a name: say what it resolved to
            shown += f" ({', '.join(sorted(str(a) for a in addrs))})"
        return Refusal(
            "not_allowed",
            f"host {shown} is not the hello's source address {remote} nor in "
            f"--kv-events-allow: pass --kv-events-allow {name} (or a network holding it), "
            "or name the engine's endpoint with --kv-events-endpoint ENGINE_ID=tcp://HOST:PORT",
        )

    def addresses(self, host: str) -> frozenset[IPAddress]:
        """The addresses of an endpoint's host: a literal address, or a name resolved."""
        literal = _address(host.strip("[]"))
        if literal is not None:
            return frozenset({literal})
        name = host.rstrip(".").lower()
        now = time.monotonic()
        hit = self._resolved.get(name)
        if hit is not None and now - hit[0] < RESOLVE_TTL_S:
            return hit[1]
        if len(self._resolved) >= MAX_RESOLVED:
            self._resolved.clear()
        addrs = frozenset(_plain(a) for a in self._resolve(name))
        self._resolved[name] = (now, addrs)
        return addrs

    def _allowed(self, a: IPAddress) -> bool:
        if any(a in net for net in self._networks if net.version == a.version):
            return True
        return any(a in self.addresses(n) for n in self._names)

    @staticmethod
    def _getaddrinfo(name: str) -> frozenset[IPAddress]:
        try:
            infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, ValueError):  # not found; a name IDNA or the OS cannot take
            return frozenset()
        out = set()
        for info in infos:
            a = _address(str(info[4][0]))
            if a is not None:
                out.add(a)
        return frozenset(out)


def socket_budget(max_sockets: int, open_files: int | None) -> int:
    """Most subscriptions at once: ``max_sockets``, lowered to fit :data:`FD_SHARE` of
    the open-file limit ``open_files`` (None: unlimited) at :data:`FDS_PER_SUBSCRIPTION`.

    >>> socket_budget(512, 1024), socket_budget(512, 65536), socket_budget(512, None)
    (256, 512, 512)
    """
    if open_files is None:
        return max_sockets
    return max(1, min(max_sockets, int(open_files * FD_SHARE) // FDS_PER_SUBSCRIPTION))


def _address(text: str) -> IPAddress | None:
    try:
        return _plain(ipaddress.ip_address(text.split("%", 1)[0]))
    except ValueError:
        return None


def _plain(a: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (``::ffff:10.0.0.7``) as the IPv4 address it maps."""
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def _same_host(a: IPAddress, source: IPAddress) -> bool:
    """``a`` is the source address, or both are loopback (the hello came from this host)."""
    return a == source or (a.is_loopback and source.is_loopback)
