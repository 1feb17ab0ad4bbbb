"""How a Prometheus client authenticates and checks TLS: one typed object, standard library.

:class:`PromAuth` holds a bearer token, or a basic-auth user and password, extra
headers (``X-Scope-OrgID`` for Mimir/Cortex tenants, a proxy's own header) and the TLS
options (a CA bundle, or no verification at all). Its ``repr`` masks every secret, and
:class:`~kvscope.sources.prometheus.client.PromClient` never puts a header value in an error message, so
a secret cannot reach a log line or a traceback through them.

:func:`read_secret` reads a secret from a file the way Prometheus' own
``bearer_token_file`` / ``password_file`` do: the whole file, surrounding whitespace
stripped.
"""

from __future__ import annotations

import base64
import ssl
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PromAuth", "read_secret"]


def read_secret(path: str | Path, what: str) -> str:
    """The stripped content of ``path``; ``ValueError`` naming ``what`` (never the
    content) when it cannot be read or is empty."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(f"cannot read the {what} file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the {what} file {path} is not UTF-8 text") from None
    if not text:
        raise ValueError(f"the {what} file {path} is empty")
    return text


@dataclass(frozen=True)
class PromAuth:
    """Credentials and TLS options for one Prometheus-compatible server.

    ``bearer_token`` goes out as ``Authorization: Bearer ...``; ``username`` and
    ``password`` as basic auth (a bearer token and basic auth exclude each other);
    ``headers`` are added to every request (``(name, value)`` pairs); ``ca_file`` is a
    PEM bundle trusted for ``https://`` URLs besides the system's; ``insecure_skip_verify``
    turns certificate and host name checks off.
    """

    bearer_token: str | None = field(default=None, repr=False)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    ca_file: str | None = None
    insecure_skip_verify: bool = False

    def __post_init__(self) -> None:
        if self.bearer_token and (self.username or self.password):
            raise ValueError(
                "give either a bearer token or basic auth (user and password), not both"
            )
        if self.password and not self.username:
            raise ValueError("a basic-auth password needs a user name")
        for name, _ in self.headers:
            if name.lower() == "authorization" and (self.bearer_token or self.username):
                raise ValueError(
                    "an Authorization header and a bearer token or basic auth exclude each other"
                )

    @property
    def kind(self) -> str:
        """``bearer``, ``basic``, ``headers`` or ``none``: what a message may say."""
        if self.bearer_token:
            return "bearer"
        if self.username:
            return "basic"
        return "headers" if self.headers else "none"

    def request_headers(self) -> dict[str, str]:
        """The headers every request carries."""
        out = dict(self.headers)
        if self.bearer_token:
            out["Authorization"] = f"Bearer {self.bearer_token}"
        elif self.username:
            pair = f"{self.username}:{self.password or ''}".encode()
            out["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
        return out

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for ``https://`` (None: the default one)."""
        if not self.ca_file and not self.insecure_skip_verify:
            return None
        ctx = ssl.create_default_context()
        if self.ca_file:
            try:
                ctx.load_verify_locations(cafile=self.ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"cannot load the CA file {self.ca_file}: {e}") from None
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx
