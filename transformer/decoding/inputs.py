"""What translate.py reads beside the sources: `source<TAB>prefix` lines (prefix=true), whose
translations start with the prefix, and `source<TAB>phrase<TAB>phrase...` lines (constraints=true),
whose translations contain every phrase; and their target token ids, checked against the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError, DataError

if TYPE_CHECKING:
    from .config import DecodeConfig


def split_prefixes(lines: list[str], source_name: str, first_line: int = 1, second: str = "prefix") -> tuple[list[str], list[str]]:  # fmt: skip
    """`source<TAB>prefix` lines -> (sources, prefixes) (or source<TAB>`second`, e.g. a translation
    to score). An empty line stays an empty source (and an empty translation); any other line
    needs exactly one TAB with a source before it, or it is a DataError naming its line."""
    sources, prefixes = [], []
    for number, line in enumerate(lines, first_line):
        fields = line.split("\t") if line else ["", ""]
        if line and (len(fields) != 2 or not fields[0].strip()):
            problem = "an empty source" if len(fields) == 2 else f"{len(fields) - 1} TABs"
            raise DataError(f"{source_name}:{number}: expected source<TAB>{second}, found {problem}")
        sources.append(fields[0].strip())
        prefixes.append(fields[1].strip())
    return sources, prefixes


def encode_prefixes(
    prefixes: list[str], tokenizer, limit: int, source_name: str, first_line: int = 1
) -> list[list[int]]:
    """Target token ids of each prefix (tokenized on its own); one that leaves no room for the EOS
    within the model's `limit` of generated tokens is a DataError naming its line."""
    ids = tokenizer.encode(prefixes)
    for number, prefix in enumerate(ids, first_line):
        if len(prefix) >= limit:
            raise DataError(f"{source_name}:{number}: the prefix has {len(prefix)} tokens; the model fits at most {limit - 1}")  # fmt: skip
    return ids


def split_constraints(lines: list[str], source_name: str, first_line: int = 1) -> tuple[list[str], list[list[str]]]:
    """`source<TAB>phrase<TAB>phrase...` lines -> (sources, each line's phrases); a line without a
    TAB has none. An empty source before a TAB, or an empty phrase, is a DataError naming its line."""
    sources, constraints = [], []
    for number, line in enumerate(lines, first_line):
        source, *phrases = [field.strip() for field in line.split("\t")]
        if phrases and not source:
            raise DataError(f"{source_name}:{number}: expected source<TAB>phrase<TAB>..., found an empty source")
        if not all(phrases):
            raise DataError(f"{source_name}:{number}: expected source<TAB>phrase<TAB>..., found an empty phrase")
        sources.append(source)
        constraints.append(phrases)
    return sources, constraints


def encode_constraints(
    constraints: list[list[str]], tokenizer, cfg: DecodeConfig, limit: int, source_name: str, first_line: int = 1
) -> list[list[list[int]]]:
    """Target token ids of each line's phrases (each tokenized on its own); phrases that leave no
    room for the EOS within the model's `limit` are a DataError naming their line."""
    if cfg.strategy != "beam":
        raise ConfigError(f"constraints need decode.strategy=beam, not {cfg.strategy}")
    out = []
    for number, phrases in enumerate(constraints, first_line):
        ids = tokenizer.encode(phrases)
        if sum(map(len, ids)) >= limit:
            raise DataError(f"{source_name}:{number}: the phrases have {sum(map(len, ids))} tokens; the model fits at most {limit - 1}")  # fmt: skip
        out.append(ids)
    return out
