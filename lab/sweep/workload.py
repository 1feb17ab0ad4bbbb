"""The requests a sweep sends: prompt text and output length, seeded and reproducible.

A :class:`Workload` yields, for each concurrency level, an endless stream of
:class:`RequestSpec`, its lengths from

- a **length distribution**: prompt words and output tokens uniform in
  ``prompt_words`` and ``output_tokens`` (``(lo, hi)``), or
- a **trace** (:func:`kvscope.lab.sweep.traces.load_trace`): its rows' token counts times
  ``trace_scale``, sampled (``trace_order="sample"``) or in file order
  (``"sequential"``), turned into words by ``tokens_per_word``. A Mooncake trace's prefix
  block ids become fixed chunks of text (512 x ``trace_scale`` tokens), so requests sharing leading blocks share a
  prompt prefix here too.

``max_prompt_tokens`` and ``max_output_tokens`` clamp every request. With
``shared_prefix_words = N`` and ``prefix_groups = K`` every prompt starts with one of K
fixed N-word prefixes, to exercise the prefix cache. All text is keyed by ``(seed,
level)``: a level is reproducible on its own and starts with a prefix cache that holds
nothing of its prompts.

The command's options: docs/sweep.md#kvscope-sweep
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvscope.lab.sweep.prompts import TOKENS_PER_WORD, random_words, words_for_tokens
from kvscope.lab.sweep.traces import MOONCAKE_BLOCK_TOKENS, TraceRow


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    prompt: str
    max_tokens: int
    prompt_words: int
    est_prompt_tokens: int
    """``prompt_words x tokens_per_word``; used when the server reports no usage."""


class Workload:
    """Seeded request streams, one per concurrency level (see the module docstring)."""

    def __init__(
        self,
        *,
        prompt_words: tuple[int, int] = (8, 40),
        output_tokens: tuple[int, int] = (128, 128),
        trace: Sequence[TraceRow] | None = None,
        trace_order: str = "sample",
        trace_scale: float = 1.0,
        max_prompt_tokens: int | None = None,
        max_output_tokens: int | None = None,
        shared_prefix_words: int = 0,
        prefix_groups: int = 1,
        tokens_per_word: float = TOKENS_PER_WORD,
        seed: int = 0,
    ) -> None:
        if trace is not None and not trace:
            raise ValueError("trace has no rows")
        if trace_order not in ("sample", "sequential"):
            raise ValueError(f"trace_order must be 'sample' or 'sequential', not {trace_order!r}")
        self.prompt_words = prompt_words
        self.output_tokens = output_tokens
        self.trace = trace
        self.trace_order = trace_order
        self.trace_scale = trace_scale
        self.max_prompt_tokens = max_prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.shared_prefix_words = shared_prefix_words
        self.prefix_groups = prefix_groups
        self.tokens_per_word = tokens_per_word
        self.seed = seed

    def requests(self, level: int) -> Iterator[RequestSpec]:
        """An endless, reproducible stream of requests for level number ``level``."""
        rng = random.Random(f"{self.seed}:{level}:requests")
        prefixes = [self.prefix(level, group) for group in range(self.prefix_groups)]
        index = 0
        while True:
            if self.trace is None:
                body_words = rng.randint(*self.prompt_words)
                max_tokens = rng.randint(*self.output_tokens)
                row = None
            else:
                if self.trace_order == "sample":
                    row = rng.choice(self.trace)
                else:
                    row = self.trace[index % len(self.trace)]
                    index += 1
                body_words = words_for_tokens(
                    row.input_tokens * self.trace_scale, self.tokens_per_word
                )
                max_tokens = max(1, round(row.output_tokens * self.trace_scale))
            prefix = rng.choice(prefixes) if self.shared_prefix_words else ""
            body_words = min(body_words, self._max_body_words())
            if row is not None and row.block_ids:
                body = self._blocks_text(level, row.block_ids, body_words, rng)
            else:
                body = random_words(rng, body_words)
            if self.max_output_tokens is not None:
                max_tokens = min(max_tokens, self.max_output_tokens)
            words = self.shared_prefix_words + body_words
            yield RequestSpec(
                prompt=f"{prefix} {body}" if prefix else body,
                max_tokens=max_tokens,
                prompt_words=words,
                est_prompt_tokens=round(words * self.tokens_per_word),
            )

    def prefix(self, level: int, group: int) -> str:
        """The shared prefix of ``group`` in ``level`` (empty without shared prefixes)."""
        rng = random.Random(f"{self.seed}:{level}:prefix:{group}")
        return random_words(rng, self.shared_prefix_words)

    def _max_body_words(self) -> int:
        if self.max_prompt_tokens is None:
            return 1 << 30
        total = words_for_tokens(self.max_prompt_tokens, self.tokens_per_word)
        return max(1, total - self.shared_prefix_words)

    def _blocks_text(
        self, level: int, block_ids: Sequence[int], n_words: int, rng: random.Random
    ) -> str:
        """``n_words`` words made of one fixed chunk of text per prefix block id."""
        block_words = words_for_tokens(
            MOONCAKE_BLOCK_TOKENS * self.trace_scale, self.tokens_per_word
        )
        words: list[str] = []
        for block_id in block_ids:
            if len(words) >= n_words:
                break
            block_rng = random.Random(f"{self.seed}:{level}:block:{block_id}")
            words += random_words(block_rng, block_words).split(" ")
        if len(words) < n_words:  # the trace's blocks cover less than its input length
            words += random_words(rng, n_words - len(words)).split(" ")
        return " ".join(words[:n_words])
