"""The server's limits, `limits.*` in serve.py: what one request may ask, how long the queue may
grow, how requests are merged into decoding batches. (The scheduler and its key/value pool are
`scheduler.*`, SchedulerConfig, as in translate.py.) Every value is checked when built."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ServeLimits:
    max_lines: int = 64  # sentences in one request
    max_chars: int = 2000  # characters in one sentence
    max_sentence_tokens: int = 0  # source tokens in one sentence; 0: as many as the model's positions take
    max_queue: int = 256  # requests waiting to be decoded; one more is answered 429
    max_batch_tokens: int = 4096  # source tokens merged into one decoding batch (one request may exceed it alone)
    max_wait_ms: float = 5.0  # how long the oldest waiting request waits for others to join its batch
    max_beam_size: int = 8  # a request's beam_size (and so its n_best) at most this
    max_length_penalty: float = 5.0  # a request's length_penalty in [0, this]

    def __post_init__(self) -> None:
        for key in ("max_lines", "max_chars", "max_queue", "max_batch_tokens", "max_beam_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"limits.{key}={getattr(self, key)} must be >= 1")
        if self.max_sentence_tokens < 0:
            raise ValueError(
                f"limits.max_sentence_tokens={self.max_sentence_tokens} must be >= 0 (0: no limit of its own)"
            )
        for key in ("max_wait_ms", "max_length_penalty"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ValueError(f"limits.{key}={getattr(self, key)} must be >= 0 and finite")

    def sentence_tokens(self, model_tokens: int) -> int:
        """The most source tokens a sentence may have (EOS aside): max_sentence_tokens, at most
        `model_tokens` (what the model's positions take; a longer text is truncated to it)."""
        return min(self.max_sentence_tokens, model_tokens) if self.max_sentence_tokens else model_tokens

    @property
    def max_body_bytes(self) -> int:
        """The largest request body read: every line at its longest in 4-byte UTF-8, JSON-escaped, and room for options."""
        return self.max_lines * (self.max_chars * 8 + 8) + 4096
