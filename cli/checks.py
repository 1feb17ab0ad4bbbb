"""Start-up checks of the ``kvscope`` command: the optional dependencies a subcommand needs.

``pip install kvscope`` installs the engine side only (standard library); each subcommand
checks its extra before importing it and names the one to install.
"""

from __future__ import annotations

EXTRA_HINT = (
    "kvscope {cmd}: this command needs the '{extra}' extra ({missing} is not installed).\n"
    "Install it with:  pip install 'kvscope[{extra}]'"
    "{cpu}"
)
TWIN_CPU_HINT = "\n(on a machine without a GPU:  pip install 'kvscope[twin-cpu]', vLLM's CPU build)"


class MissingExtraError(SystemExit):
    """Raised when a subcommand's optional dependencies are not installed."""


def require(cmd: str, extra: str, also: tuple[str, ...] = ()) -> None:
    """Fail with an install hint when an extra's packages (and ``also``) are missing."""
    import importlib.util

    collector = ("aiohttp", "duckdb", "pandas", "prometheus_client", "scipy", "sklearn", "tqdm")
    needed = {"collector": collector, "twin": (*collector, "vllm")}[extra]
    for mod in (*needed, *also):
        if importlib.util.find_spec(mod) is None:
            cpu = TWIN_CPU_HINT if extra == "twin" else ""
            raise MissingExtraError(EXTRA_HINT.format(cmd=cmd, extra=extra, missing=mod, cpu=cpu))
