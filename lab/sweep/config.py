"""The sweep's configuration: one typed object, and the argparse glue that fills it.

``add_sweep_arguments(parser)`` adds the ``kvscope sweep`` options to a parser;
``config_from_args(args)`` turns the parsed namespace into a validated
:class:`SweepConfig`. Library callers build a :class:`SweepConfig` directly.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from typing import Any

from kvscope.args import duration, positive_duration
from kvscope.lab.sweep.errors import SweepError
from kvscope.lab.sweep.prompts import TOKENS_PER_WORD
from kvscope.lab.sweep.routing import POLICIES, Router
from kvscope.lab.sweep.traces import load_trace
from kvscope.lab.sweep.workload import Workload

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)


@dataclass
class SweepConfig:
    """What to load, how hard, for how long. Times in seconds, lengths in tokens or words."""

    url: str = "http://127.0.0.1:8000"
    """Base URL of an OpenAI-compatible server (with or without a trailing ``/v1``)."""
    replicas: list[str] = field(default_factory=list)
    """More servers of the same model: requests are spread over ``url`` and these."""
    routing: str = "round-robin"
    """How requests are spread over the servers (see :mod:`kvscope.lab.sweep.routing`)."""
    affinity_words: int | None = None
    """Prompt words hashed by ``prefix-affine`` routing (default: the shared prefix's
    length when there is one, else 32)."""
    model: str | None = None
    """Model name for requests; ``None`` takes the first one ``GET /v1/models`` lists."""
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    """Concurrency levels, run in this order: clients each keeping one request in flight."""
    duration_s: float = 10.0
    """Measurement window per level."""
    max_requests: int | None = None
    """Send at most this many requests per level (warm-up included); the level then ends
    when they have all finished, or at the window's end if that comes first. Two runs with
    the same seed and count serve the same requests, however fast each server is."""
    warmup_s: float = 2.0
    """Load before each window that is not measured (the ramp-up of a level); with
    ``steady_state`` the least warm-up."""
    steady_state: bool = True
    """Stretch each level into its steady state (not with ``max_requests``): the warm-up
    lasts until every client's first request has returned, and the window at least one
    cycle of the closed loop (concurrency over the request rate the warm-up measured).
    The clients start together, so the first requests are served as one wave; a level
    shorter than the time a request spends in the server measures only that wave, and
    its latency percentiles are cut off at the level's length."""
    max_stretch_s: float = 120.0
    """With ``steady_state``, the warm-up and the window each last at most this long
    (or ``warmup_s`` / ``duration_s`` if longer)."""
    cooldown_s: float = 1.0
    """Pause between levels, after in-flight requests are cancelled."""
    prompt_words: tuple[int, int] = (8, 40)
    """Prompt body length in words, uniform in [lo, hi] (without a trace)."""
    output_tokens: tuple[int, int] = (128, 128)
    """``max_tokens`` per request, uniform in [lo, hi] (without a trace)."""
    trace: str | None = None
    """Trace file (Mooncake JSONL, Azure CSV, ShareGPT/arXiv length CSV) giving lengths."""
    trace_order: str = "sample"
    """``sample`` (random rows, with replacement) or ``sequential`` (file order)."""
    trace_scale: float = 1.0
    """Factor applied to a trace's prompt and output lengths (and Mooncake block size)."""
    trace_limit: int | None = None
    """Read only the first rows of the trace."""
    max_prompt_tokens: int | None = None
    """Clamp on each prompt (estimated tokens, shared prefix included)."""
    max_output_tokens: int | None = None
    """Clamp on each request's ``max_tokens``."""
    shared_prefix_words: int = 0
    """Words of shared prefix at the start of every prompt (0: no shared prefixes)."""
    prefix_groups: int = 1
    """Number of distinct shared prefixes; each request picks one uniformly."""
    tokens_per_word: float = TOKENS_PER_WORD
    """Prompt tokens per word, to convert token counts (traces, clamps) into words."""
    ignore_eos: bool = True
    """Send vLLM's ``ignore_eos`` so every request produces exactly ``max_tokens`` tokens."""
    continuous_usage_stats: bool = True
    """Ask for vLLM's per-chunk usage (exact token counts); off for strict OpenAI servers."""
    temperature: float = 0.0
    seed: int = 0
    request_timeout_s: float = 300.0
    """Total time limit of one request."""
    error_backoff_s: float = 0.1
    """A client whose request failed (a 503 from admission control, say) waits this long
    before its next one. Raise it to model a gateway that sends a refused request to
    another replica: with 0.1 s the clients beyond a server's admission limit send it
    about ten refused requests per second each."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer ...`` when set."""
    out: str | None = None
    """Write the result JSON here."""
    progress: bool = True
    """Show a progress bar per level on stderr."""

    def validate(self) -> SweepConfig:
        """Check the values; raises :class:`SweepError` naming the bad one. Returns self."""
        checks = [
            (bool(self.concurrency), "concurrency: at least one level"),
            (all(c >= 1 for c in self.concurrency), "concurrency: levels must be >= 1"),
            (self.duration_s > 0, "duration_s must be > 0"),
            (self.max_requests is None or self.max_requests >= 1, "max_requests must be >= 1"),
            (self.warmup_s >= 0 and self.cooldown_s >= 0, "warmup_s, cooldown_s must be >= 0"),
            (self.max_stretch_s > 0, "max_stretch_s must be > 0"),
            (1 <= self.prompt_words[0] <= self.prompt_words[1], "prompt_words: need 1 <= lo <= hi"),
            (
                1 <= self.output_tokens[0] <= self.output_tokens[1],
                "output_tokens: need 1 <= lo <= hi",
            ),
            (self.trace_order in ("sample", "sequential"), "trace_order: sample or sequential"),
            (self.trace_scale > 0, "trace_scale must be > 0"),
            (
                self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
                "max_prompt_tokens >= 1",
            ),
            (
                self.max_output_tokens is None or self.max_output_tokens >= 1,
                "max_output_tokens >= 1",
            ),
            (self.shared_prefix_words >= 0, "shared_prefix_words must be >= 0"),
            (self.prefix_groups >= 1, "prefix_groups must be >= 1"),
            (self.tokens_per_word > 0, "tokens_per_word must be > 0"),
            (self.request_timeout_s > 0, "request_timeout_s must be > 0"),
            (self.error_backoff_s >= 0, "error_backoff_s must be >= 0"),
            (self.routing in POLICIES, f"routing: one of {', '.join(POLICIES)}"),
            (self.affinity_words is None or self.affinity_words >= 1, "affinity_words >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise SweepError(f"invalid sweep configuration: {message}")
        if (
            self.max_prompt_tokens is not None
            and self.shared_prefix_words * self.tokens_per_word >= self.max_prompt_tokens
        ):
            raise SweepError(
                "invalid sweep configuration: the shared prefix fills max_prompt_tokens"
            )
        return self

    @property
    def targets(self) -> list[str]:
        """Every server requests go to: ``url`` first, then ``replicas``."""
        return [self.url, *self.replicas]

    def router(self) -> Router:
        """A fresh :class:`~kvscope.lab.sweep.routing.Router` over :attr:`targets`."""
        words = self.affinity_words or self.shared_prefix_words or 32
        return Router(len(self.targets), self.routing, words)

    def workload(self) -> Workload:
        """The :class:`Workload` this configuration describes (reads the trace, if any)."""
        trace = load_trace(self.trace, self.trace_limit) if self.trace else None
        return Workload(
            prompt_words=self.prompt_words,
            output_tokens=self.output_tokens,
            trace=trace,
            trace_order=self.trace_order,
            trace_scale=self.trace_scale,
            max_prompt_tokens=self.max_prompt_tokens,
            max_output_tokens=self.max_output_tokens,
            shared_prefix_words=self.shared_prefix_words,
            prefix_groups=self.prefix_groups,
            tokens_per_word=self.tokens_per_word,
            seed=self.seed,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy, without the API key."""
        data = asdict(self)
        data["api_key"] = "***" if self.api_key else None
        data["prompt_words"] = list(self.prompt_words)
        data["output_tokens"] = list(self.output_tokens)
        return data


def parse_int_range(text: str) -> tuple[int, int]:
    """``"8-40"`` -> ``(8, 40)``; ``"128"`` -> ``(128, 128)``."""
    lo, sep, hi = text.partition("-")
    try:
        pair = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return pair


def parse_int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (positive integers)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_sweep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvscope sweep`` options to ``parser`` (returned for chaining)."""
    d = SweepConfig()
    target = parser.add_argument_group("server")
    target.add_argument(
        "--url",
        action="append",
        default=None,
        metavar="URL",
        help=f"base URL of the OpenAI-compatible server (default: {d.url}); repeat it for the replicas of a pool, which then share the load by --routing",
    )
    target.add_argument(
        "--routing",
        choices=POLICIES,
        default=d.routing,
        help="how requests are spread over several --url: round-robin (default), least-loaded (fewest in flight) or prefix-affine (a hash of the prompt's first words picks the replica)",
    )
    target.add_argument(
        "--affinity-words",
        type=int,
        default=None,
        metavar="N",
        help="prompt words hashed by prefix-affine routing (default: --shared-prefix-words, else 32)",
    )
    target.add_argument(
        "--model", default=None, help="model name (default: the first one GET /v1/models lists)"
    )
    target.add_argument(
        "--api-key", default=None, help="bearer token for the server, if it needs one"
    )
    target.add_argument(
        "--request-timeout",
        type=positive_duration,
        default=d.request_timeout_s,
        metavar="DURATION",
        help="time limit of one request in seconds (default: %(default)s)",
    )
    target.add_argument(
        "--error-backoff",
        type=duration,
        default=d.error_backoff_s,
        metavar="DURATION",
        help="seconds a client waits after a failed request, e.g. a 503 from admission "
        "control (default: %(default)s)",
    )
    target.add_argument(
        "--no-continuous-usage",
        action="store_true",
        help="do not ask for vLLM's per-chunk usage stats (for servers that reject stream_options.continuous_usage_stats); tokens are then counted per streamed chunk",
    )
    target.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send vLLM's ignore_eos: outputs may stop before max_tokens",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=parse_int_list,
        default=list(d.concurrency),
        metavar="N,N,...",
        help="concurrency levels: closed-loop clients, each keeping one request in flight (default: 1,2,4,8,16,32)",
    )
    load.add_argument(
        "--duration",
        type=positive_duration,
        default=d.duration_s,
        metavar="DURATION",
        help="measured seconds per level, the least with steady-state levels (default: %(default)s)",
    )
    load.add_argument(
        "--max-requests",
        type=int,
        default=None,
        metavar="N",
        help="send at most N requests per level, then end the level once they have "
        "finished: with the same --seed, two runs serve the same requests (default: no limit)",
    )
    load.add_argument(
        "--warmup",
        type=duration,
        default=d.warmup_s,
        metavar="DURATION",
        help="unmeasured seconds of load before each level's window, the least with "
        "steady-state levels (default: %(default)s)",
    )
    load.add_argument(
        "--fixed-windows",
        action="store_true",
        help="levels of exactly --warmup + --duration seconds; by default each level is "
        "stretched into its steady state: the warm-up lasts until every client's first "
        "request has returned, the window at least one closed-loop cycle (concurrency / "
        "requests per second), each at most --max-stretch seconds",
    )
    load.add_argument(
        "--max-stretch",
        type=positive_duration,
        default=d.max_stretch_s,
        metavar="DURATION",
        help="longest steady-state warm-up, and longest window, per level (default: %(default)s)",
    )
    load.add_argument(
        "--cooldown",
        type=duration,
        default=d.cooldown_s,
        metavar="DURATION",
        help="pause between levels (default: %(default)s)",
    )
    load.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of all prompt randomness (default: %(default)s)",
    )

    prompts = parser.add_argument_group("requests")
    prompts.add_argument(
        "--prompt-words",
        type=parse_int_range,
        default=d.prompt_words,
        metavar="LO-HI",
        help="prompt length in words, uniform (about 1 token per word with common tokenizers; default: 8-40)",
    )
    prompts.add_argument(
        "--output-tokens",
        type=parse_int_range,
        default=d.output_tokens,
        metavar="LO-HI",
        help="output tokens per request (max_tokens), uniform (default: 128)",
    )
    prompts.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="take prompt/output lengths from a trace instead: Mooncake JSONL (input_length, output_length, hash_ids), Azure CSV (ContextTokens, GeneratedTokens) or length CSV (num_prefill_tokens, num_decode_tokens)",
    )
    prompts.add_argument(
        "--trace-order",
        choices=("sample", "sequential"),
        default=d.trace_order,
        help="draw trace rows at random (sample, default) or in file order (sequential)",
    )
    prompts.add_argument(
        "--trace-scale",
        type=float,
        default=d.trace_scale,
        metavar="F",
        help="multiply trace lengths by F (default: %(default)s)",
    )
    prompts.add_argument(
        "--trace-limit",
        type=int,
        default=None,
        metavar="N",
        help="read only the first N trace rows",
    )
    prompts.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="clamp each prompt to about N tokens (so traces fit a small model's context)",
    )
    prompts.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        metavar="N",
        help="clamp each request's max_tokens to N",
    )
    prompts.add_argument(
        "--shared-prefix-words",
        type=int,
        default=d.shared_prefix_words,
        metavar="N",
        help="start every prompt with one of --prefix-groups shared prefixes of N words (exercises the prefix cache; default: 0, none)",
    )
    prompts.add_argument(
        "--prefix-groups",
        type=int,
        default=d.prefix_groups,
        metavar="K",
        help="number of distinct shared prefixes (default: %(default)s)",
    )
    prompts.add_argument(
        "--tokens-per-word",
        type=float,
        default=d.tokens_per_word,
        metavar="R",
        help="prompt tokens per word, to turn token counts into words (default: %(default)s, measured with the lab tokenizer)",
    )
    prompts.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help="sampling temperature (default: %(default)s)",
    )

    output = parser.add_argument_group("output")
    output.add_argument("--out", default=None, metavar="FILE", help="write the result JSON to FILE")
    output.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    """The validated :class:`SweepConfig` of parsed ``add_sweep_arguments`` options."""
    urls = args.url or [SweepConfig.url]
    return SweepConfig(
        url=urls[0],
        replicas=list(urls[1:]),
        routing=args.routing,
        affinity_words=args.affinity_words,
        model=args.model,
        concurrency=list(args.concurrency),
        duration_s=args.duration,
        max_requests=args.max_requests,
        warmup_s=args.warmup,
        steady_state=not args.fixed_windows,
        max_stretch_s=args.max_stretch,
        cooldown_s=args.cooldown,
        prompt_words=args.prompt_words,
        output_tokens=args.output_tokens,
        trace=args.trace,
        trace_order=args.trace_order,
        trace_scale=args.trace_scale,
        trace_limit=args.trace_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        shared_prefix_words=args.shared_prefix_words,
        prefix_groups=args.prefix_groups,
        tokens_per_word=args.tokens_per_word,
        ignore_eos=not args.no_ignore_eos,
        continuous_usage_stats=not args.no_continuous_usage,
        temperature=args.temperature,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        error_backoff_s=args.error_backoff,
        api_key=args.api_key,
        out=args.out,
        progress=not args.no_progress,
    ).validate()
