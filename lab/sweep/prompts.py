"""Prompt text for load generation: words from a fixed vocabulary.

Prompts are sequences of words drawn from :data:`WORDS`, a fixed list of short,
common English words. The lab tokenizer (:func:`kvscope.lab.engine.build_model`) is
trained on text made of the same words, so prompt lengths in tokens are stable
and close to proportional to lengths in words; general-purpose tokenizers split
these words into about one token each too.

:data:`TOKENS_PER_WORD` is the ratio measured with the lab tokenizer (see
``tests/test_lab.py``); it converts token counts (from traces, ``--max-prompt-tokens``)
to word counts. It excludes the one BOS token the tokenizer adds per prompt.

All randomness comes from :class:`random.Random` instances seeded by the caller,
so the same seed gives the same prompts.
"""

from __future__ import annotations

import random

WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he",
    "was", "for", "on", "are", "with", "as", "his", "they", "be", "at",
    "one", "have", "this", "from", "or", "had", "by", "hot", "word", "but",
    "what", "some", "we", "can", "out", "other", "were", "all", "there", "when",
    "up", "use", "your", "how", "said", "an", "each", "she", "which", "do",
    "their", "time", "if", "will", "way", "about", "many", "then", "them", "write",
    "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him",
    "two", "has", "look", "more", "day", "could", "go", "come", "did", "number",
    "sound", "no", "most", "people", "my", "over", "know", "water", "than", "call",
    "first", "who", "may", "down", "side", "been", "now", "find", "any", "new",
    "work", "part", "take", "get", "place", "made", "live", "where", "after", "back",
    "little", "only", "round", "man", "year", "came", "show", "every", "good", "me",
    "give", "our", "under", "name", "very", "through", "just", "form",
)  # fmt: skip

#: Prompt tokens per word with the lab tokenizer (BOS excluded), measured over
#: 300 prompts each of 8, 24, 40 and 1,000 random words: tokens = 1.016 x words + ~1
#: (the first word has no leading space and often takes two tokens). Add the BOS
#: token: an 8-40-word prompt is 10-43 prompt tokens.
TOKENS_PER_WORD = 1.02


def random_words(rng: random.Random, n_words: int) -> str:
    """``n_words`` words drawn uniformly from :data:`WORDS`, joined by spaces."""
    return " ".join(rng.choices(WORDS, k=max(0, n_words)))


def words_for_tokens(n_tokens: float, tokens_per_word: float = TOKENS_PER_WORD) -> int:
    """The number of words expected to give ``n_tokens`` prompt tokens (at least 1)."""
    return max(1, round(n_tokens / tokens_per_word))
