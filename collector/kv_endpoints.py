"""KV-event endpoints: where to connect for an engine's advertised publisher endpoint.

Standard library only, so the command line can check ``--kv-events-endpoint``
without the ZMQ dependencies.
"""

from __future__ import annotations

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


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
