"""Temperature sampling for many-to-many training (data.directions): each direction's share of the
training pairs, and each language's share of the tokenizer's text, proportional to its size **
(1 / data.temperature) (Arivazhagan et al., 2019)."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


def direction_sizes(counts: dict[str, int], temperature: float) -> dict[str, int]:
    """How many training pairs (or sentences) each direction (or language) gets, from its own
    count: shares proportional to count ** (1 / temperature), the total kept (temperature 1 keeps
    every count)."""
    total = sum(counts.values())
    weights = {name: n ** (1 / temperature) for name, n in counts.items()}
    return {name: round(total * w / sum(weights.values())) for name, w in weights.items()}


def draw(items: list, size: int, rng: random.Random) -> list:
    """`size` of `items`: whole copies of them all, then a random draw of the rest (in their order)."""
    copies, rest = divmod(size, len(items))
    return items * copies + [items[i] for i in sorted(rng.sample(range(len(items)), rest))]


def resample(ds: datasets.Dataset, temperature: float, seed: int) -> datasets.Dataset:
    """A multilingual training split with each direction's pairs repeated or thinned to its
    temperature-sampled size (direction_sizes): whole copies, then a seeded random draw of the rest."""
    names = [f"{s}-{t}" for s, t in zip(ds["src_lang"], ds["tgt_lang"])]
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        rows.setdefault(name, []).append(i)
    sizes = direction_sizes({name: len(r) for name, r in rows.items()}, temperature)
    if all(sizes[name] == len(r) for name, r in rows.items()):
        return ds
    rng = random.Random(seed)
    picked = []
    for name, r in rows.items():
        picked += draw(r, sizes[name], rng)
        log.info("direction %s: %d training pairs drawn from %d (data.temperature)", name, sizes[name], len(r))
    return ds.select(picked)


def language_text(ds: datasets.Dataset, temperature: float, seed: int) -> list[str]:
    """The text a multilingual tokenizer is trained on: each language's sentences once (from the
    first direction that has the language on either side: a language on both sides of several
    directions would otherwise count several times), resampled to shares proportional to
    count ** (1 / temperature) as resample does for directions."""
    columns = ds.select_columns(["src", "tgt", "src_lang", "tgt_lang"]).to_dict()
    first: dict[str, tuple[str, str]] = {}  # language -> (direction, side) whose sentences it takes
    for s, t in dict.fromkeys(zip(columns["src_lang"], columns["tgt_lang"])):
        first.setdefault(s, (f"{s}-{t}", "src"))
        first.setdefault(t, (f"{s}-{t}", "tgt"))
    text: dict[str, list[str]] = {lang: [] for lang in first}
    for i, (s, t) in enumerate(zip(columns["src_lang"], columns["tgt_lang"])):
        for lang, side in ((s, "src"), (t, "tgt")):
            if first[lang] == (f"{s}-{t}", side):
                text[lang].append(columns[side][i])
    sizes = direction_sizes({lang: len(lines) for lang, lines in text.items()}, temperature)
    rng = random.Random(seed)
    return [line for lang, lines in text.items() for line in draw(lines, sizes[lang], rng)]
