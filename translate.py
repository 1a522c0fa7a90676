"""Translate sentences with a trained checkpoint, one output line per input line.

    python translate.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt < input.de > output.en
    python translate.py checkpoint=PATH input=input.de output=output.en decode.beam_size=5 device=cpu

Arguments (key=value, as for train.py):
    checkpoint=PATH            a checkpoint written by train.py (the tokenizer is inside it)
    ensemble=[PATH,...]        more checkpoints with the same tokenizer; probabilities are averaged
    input=PATH output=PATH     default: stdin and stdout
    device=auto|cpu|cuda
    decode.strategy=beam|greedy|sample   decode.beam_size=5   decode.length_penalty=0.6
    decode.n_best=N            N > 1 writes N lines per input: index <TAB> score <TAB> translation
    decode.max_tokens=8192     source tokens per batch
    decode.temperature / decode.top_k / decode.top_p / decode.seed   for sampling
Empty input lines give empty output lines; over-long lines are truncated with a warning.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformer.cli import load_decoder, parse_args, setup_logging
from transformer.config import exit_on_user_error
from transformer.data import DataError, read_lines
from transformer.decoding import DecodeConfig, Hypothesis, translate_ids
from transformer.monitoring import progress_bar

log = logging.getLogger("translate")


@dataclass
class TranslateConfig:
    checkpoint: str = "???"
    ensemble: list[str] = field(default_factory=list)
    input: Optional[str] = None
    output: Optional[str] = None
    device: str = "auto"
    decode: DecodeConfig = field(default_factory=DecodeConfig)


def read_input(path: str | None) -> list[str]:
    if path is None:
        try:
            return [line.strip() for line in sys.stdin]
        except UnicodeDecodeError:
            raise DataError("standard input is not valid UTF-8") from None
    return read_lines(Path(path))


def encode_sources(lines: list[str], tokenizer, max_tokens: int, source_name: str) -> list[list[int]]:
    ids = tokenizer.encode(lines)
    for number, sentence in enumerate(ids, 1):
        if len(sentence) > max_tokens:
            log.warning("%s:%d: %d tokens, truncated to %d", source_name, number, len(sentence), max_tokens)
            ids[number - 1] = sentence[:max_tokens]
    return ids


def format_output(n_best: list[list[Hypothesis]], tokenizer, n: int) -> str:
    if n == 1:
        return "".join(tokenizer.decode(hyps[0].tokens) + "\n" for hyps in n_best)
    return "".join(f"{i}\t{h.score:.4f}\t{tokenizer.decode(h.tokens)}\n" for i, hyps in enumerate(n_best) for h in hyps)


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, TranslateConfig, __doc__)
        from transformer.training import pick_device

        device = pick_device(cfg.device)
        model, tokenizer, _ = load_decoder(cfg.checkpoint, cfg.ensemble, device)
        lines = read_input(cfg.input)
        if not lines:
            log.warning("the input (%s) has no lines: nothing to translate", cfg.input or "stdin")
        ids = encode_sources(lines, tokenizer, model.cfg.max_positions - 1, cfg.input or "stdin")
        todo = [i for i, line in enumerate(lines) if line]  # empty lines stay empty
        with progress_bar(len(todo), "translate") as bar:
            found = translate_ids(model, [ids[i] for i in todo], tokenizer, cfg.decode, device, bar)
        n_best = [[Hypothesis([], 0.0, 0.0)] * cfg.decode.n_best for _ in lines]
        for i, hyps in zip(todo, found):
            n_best[i] = hyps
        text = format_output(n_best, tokenizer, cfg.decode.n_best)
        if cfg.output is None:
            sys.stdout.write(text)
            return
        try:
            Path(cfg.output).write_text(text, encoding="utf-8")
        except OSError as e:
            raise DataError(f"cannot write {cfg.output}: {e.strerror}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
