"""The decoding settings, `decode.*` in the configs: the strategy and its knobs, the length limits,
batching and MBR reranking (the precision is chosen when a model loads: runtime.precision). Every value is checked when the config is built."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# The strategies by name, and whether each keeps beam_size hypotheses per sentence and ranks them
# (then n_best and MBR apply). strategies.py registers one search function under each name; this
# module, which every other one reads, imports none of them.
STRATEGY_RANKS = {"greedy": False, "beam": True, "sample": False}
MBR_UTILITIES = ("none", "chrf", "bleu")  # decode.mbr (mbr.py)
MBR_WEIGHTS = ("model", "uniform")  # decode.mbr_weights


@dataclass
class DecodeConfig:
    strategy: str = "beam"  # a name in strategies.py: "greedy", "beam" or "sample"
    beam_size: int = 5
    n_best: int = 1  # hypotheses returned per sentence (beam search)
    length_penalty: float = 0.6  # GNMT's alpha: scores are divided by ((5 + length) / 6) ** alpha
    max_len_a: float = 1.2  # a translation of a source of n tokens has at most a * n + b tokens
    max_len_b: int = 10
    min_len: int = 0  # tokens generated before EOS may end a translation (0: no minimum)
    max_tokens: int = 8192  # source tokens per decoding batch
    temperature: float = 1.0  # sampling
    top_k: int = 0  # sampling: keep the k most probable tokens; 0 keeps all
    top_p: float = 1.0  # sampling: keep the smallest set of tokens with this much probability
    seed: int = 1  # sampling
    mbr: str = "none"  # beam: rerank the beam_size finished hypotheses by expected chrf or bleu (mbr.py)
    mbr_weights: str = "model"  # mbr: weigh the pseudo-references by the model's probabilities, or uniform
    shortlist: bool = False  # restrict the output layer to the shortlist beside the checkpoint (shortlist.py)
    alignment: bool = False  # translate.py: each translation, TAB, its word links i-j (alignment.py)
    alignment_layer: int = -1  # the decoder layer whose cross-attention aligns (negative: from the last)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_RANKS:
            raise ValueError(f"decode.strategy={self.strategy!r} is not one of {tuple(STRATEGY_RANKS)}")
        self.check_ranges()
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError(f"decode.n_best={self.n_best} must be between 1 and decode.beam_size={self.beam_size}")
        if self.mbr not in MBR_UTILITIES or self.mbr_weights not in MBR_WEIGHTS:
            raise ValueError(f"decode.mbr must be one of {MBR_UTILITIES} and decode.mbr_weights one of {MBR_WEIGHTS}")
        if self.mbr != "none" and not self.ranks:
            ranking = "|".join(name for name, ranks in STRATEGY_RANKS.items() if ranks)
            raise ValueError(
                f"decode.mbr={self.mbr} reranks beam search's hypotheses: it needs decode.strategy={ranking}"
            )

    def check_ranges(self) -> None:
        for key, low in (("beam_size", 1), ("max_tokens", 1), ("max_len_b", 0), ("min_len", 0), ("top_k", 0)):
            if getattr(self, key) < low:
                raise ValueError(f"decode.{key}={getattr(self, key)} must be >= {low}")
        for key in ("max_len_a", "length_penalty"):  # search_done needs a penalty that grows with length
            if not 0 <= getattr(self, key) < math.inf:
                raise ValueError(f"decode.{key}={getattr(self, key)} must be >= 0 and finite")
        if self.max_len_a == 0 and self.max_len_b < 2:  # the limit counts the EOS
            raise ValueError(f"decode.max_len_b={self.max_len_b} with decode.max_len_a=0 leaves no room for a token")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"decode.temperature={self.temperature} must be > 0 and finite")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"decode.top_p={self.top_p} is not in (0, 1]")

    def greedy(self) -> DecodeConfig:
        """These settings with greedy search (and no MBR, which needs a beam)."""
        return dataclasses.replace(self, strategy="greedy", mbr="none")

    @property
    def ranks(self) -> bool:
        """Whether the strategy keeps beam_size hypotheses per sentence and ranks them."""
        return STRATEGY_RANKS[self.strategy]

    @property
    def label(self) -> str:
        """A short name for file names and reports: greedy, beam5, beam5-mbr-chrf, sample;
        -shortlist at the end with decode.shortlist (evaluate.py's output does not overwrite the
        full vocabulary's)."""
        shortlist = "-shortlist" if self.shortlist else ""
        if not self.ranks:
            return self.strategy + shortlist
        return f"{self.strategy}{self.beam_size}" + (f"-mbr-{self.mbr}" if self.mbr != "none" else "") + shortlist


SCHEDULERS = ("batch", "continuous")


@dataclass
class SchedulerConfig:
    """How translate.py and serve.py schedule sentences for decoding: `scheduler=batch|continuous`
    (configs/scheduler/), the same names in both commands.

    batch: sentences decode in batches sorted by length, each to its end (translate.py's chunks
    of lines; serve.py's requests merged for up to limits.max_wait_ms). continuous: each sentence
    joins the running batch at the next decoding step and leaves when it ends (decoding/engine.py),
    on a paged key/value pool. A model or setting the continuous engine cannot run falls back to
    batch with one warning line saying why, in both commands (and serve.py's /health says it)."""

    kind: str = "batch"
    pool_mib: float = 256.0  # continuous: the key/value pool, allocated at start; sentences wait when it is full
    block_size: int = 16  # continuous: positions per block of the pool

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULERS:
            raise ValueError(f"scheduler.kind={self.kind!r} is not one of {SCHEDULERS}")
        if not 0 < self.pool_mib < math.inf:
            raise ValueError(f"scheduler.pool_mib={self.pool_mib} must be > 0 and finite")
        if self.block_size < 1:
            raise ValueError(f"scheduler.block_size={self.block_size} must be >= 1")

    @property
    def pool_bytes(self) -> int:
        return int(self.pool_mib * 2**20)
