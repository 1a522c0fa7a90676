"""The search strategies by name (`decode.strategy`), registered in one place: each name's search
function, and how the strategies differ for the code around them (rows and hypotheses per
sentence, whether n-best lists and MBR apply, whether the result depends on a seed, the label).

A new strategy is one search function (here, or a module of its own beside search.py and
beam.py) and one entry in STRATEGIES."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from .beam import beam_search
from .config import STRATEGY_RANKS
from .search import Hypothesis, argmax, generate, sampler

if TYPE_CHECKING:
    from .config import DecodeConfig

# search(model, src, bos_id, eos_id, cfg, generator, prefix) -> per sentence, its hypotheses best first;
# prefix: None, or each sentence's target prefix (batch, prefix_len; -1 after its end) that it must start with
Search = Callable[..., list[list[Hypothesis]]]


@dataclass(frozen=True)
class Strategy:
    name: str
    search: Search
    random: bool = False  # draws tokens from decode.seed's generator rather than choosing the best

    @property
    def ranks(self) -> bool:
        """Keeps beam_size hypotheses per sentence and ranks them: n_best and MBR apply (config.py)."""
        return STRATEGY_RANKS[self.name]

    def rows_per_sentence(self, cfg: DecodeConfig) -> int:
        """Rows of the decoding batch one sentence takes while it is searched."""
        return cfg.beam_size if self.ranks else 1

    def hypotheses_per_sentence(self, cfg: DecodeConfig) -> int:
        """The length of the n-best list each sentence gets."""
        return cfg.n_best if self.ranks else 1


def search_greedy(model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig, generator=None, prefix=None):
    """The most probable token at every step: one hypothesis per sentence."""
    return [[h] for h in generate(model, src, bos_id, eos_id, cfg, argmax, prefix)]


def search_sample(model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig, generator=None, prefix=None):
    """Tokens drawn from the model's distribution (temperature, top-k, top-p): one hypothesis per sentence."""
    return [[h] for h in generate(model, src, bos_id, eos_id, cfg, sampler(cfg, generator), prefix)]


def search_beam(model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig, generator=None, prefix=None):
    """Beam search: the n_best best of beam_size finished hypotheses per sentence (no randomness)."""
    return beam_search(model, src, bos_id, eos_id, cfg, prefix)


def empty_n_best(cfg: DecodeConfig) -> list[Hypothesis]:
    """The n-best list of an empty source: as many empty hypotheses as a sentence gets."""
    return [Hypothesis([], 0.0, 0.0)] * STRATEGIES[cfg.strategy].hypotheses_per_sentence(cfg)


STRATEGIES: dict[str, Strategy] = {
    strategy.name: strategy
    for strategy in (
        Strategy("greedy", search_greedy),
        Strategy("beam", search_beam),
        Strategy("sample", search_sample, random=True),
    )
}
if set(STRATEGIES) != set(STRATEGY_RANKS):  # the names the settings accept are the names registered
    raise ImportError(f"strategies {sorted(STRATEGIES)} differ from config.STRATEGY_RANKS {sorted(STRATEGY_RANKS)}")
