"""Translate sentences with a trained checkpoint, one output line per input line.

    python translate.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt < input.de > output.en
    python translate.py checkpoint=PATH input=input.de output=output.en decode.beam_size=5 device=cpu
    python translate.py checkpoint=PATH interactive=true      # type a sentence, read its translation

Arguments (key=value, as for train.py):
    checkpoint=PATH            a checkpoint written by train.py (the tokenizer is inside it)
    ensemble=[PATH,...]        more checkpoints with the same tokenizer; probabilities are averaged
    input=PATH output=PATH     default: stdin and stdout
    chunk_lines=2000           lines read, translated and written at a time: memory stays bounded
                               and output follows a pipe as its lines arrive
    interactive=true           translate each line as it arrives (the default when stdin is a terminal)
    device=auto|cpu|cuda
    runtime.fast=true          false: decode with the reference model, without the speed paths
    decode.strategy=beam|greedy|sample   decode.beam_size=5   decode.length_penalty=0.6
    decode.n_best=N            N > 1 writes N lines per input: index <TAB> score <TAB> translation
    decode.max_tokens=8192     source tokens per batch
    decode.temperature / decode.top_k / decode.top_p / decode.seed   for sampling
Empty input lines give empty output lines; over-long lines are truncated with a warning.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformer.checkpoint import direction, language_pair
from transformer.cli import file_language, parse_args, setup_logging
from transformer.data import line_chunks
from transformer.decoding import DecodeConfig, Hypothesis, load_decoder, translate_texts
from transformer.errors import exit_on_user_error
from transformer.fast import RuntimeConfig
from transformer.files import atomic_open, check_output
from transformer.monitoring import progress_bar

log = logging.getLogger("translate")


@dataclass
class TranslateConfig:
    checkpoint: str = "???"
    ensemble: list[str] = field(default_factory=list)
    input: Optional[str] = None
    output: Optional[str] = None
    device: str = "auto"
    chunk_lines: int = 2000
    interactive: bool = False
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        if self.chunk_lines < 1:
            raise ValueError(f"chunk_lines={self.chunk_lines} must be >= 1")


def input_chunks(cfg: TranslateConfig) -> Iterator[list[str]]:
    """The input's lines in chunks: one line at a time when interactive (or stdin is a terminal).
    Bytes are decoded strictly: text mode would let invalid UTF-8 through as escapes."""
    terminal = cfg.input is None and sys.stdin.isatty()
    if terminal:
        log.info("type one sentence per line; Ctrl-D ends")
    size = 1 if cfg.interactive or terminal else cfg.chunk_lines
    return line_chunks(None if cfg.input is None else Path(cfg.input), size)


@contextmanager
def output_stream(path: Path | None) -> Iterator[Callable[[list[str]], None]]:
    """A function that writes lines: to stdout at once (flushed), or to `path` atomically when done."""
    if path is None:
        yield lambda lines: (sys.stdout.write("".join(line + "\n" for line in lines)), sys.stdout.flush())
        return
    with atomic_open(path) as f:
        yield lambda lines: f.write("".join(line + "\n" for line in lines).encode("utf-8"))


def warn_if_target_language(path: str | None, payload: dict) -> None:
    """An input file named in the language the model translates into is likely the wrong file."""
    pair = language_pair(payload.get("train_config"))
    if pair and file_language(path) == pair[1] and pair[1] not in pair[0]:
        log.warning("input=%s looks like %s, the language the checkpoint translates into (%s)", path, pair[1], direction(pair))  # fmt: skip


def output_lines(n_best: list[list[Hypothesis]], tokenizer, n: int, first: int = 0) -> list[str]:
    """One line per input (n = 1), or n lines per input: index <TAB> score <TAB> translation, where
    n_best[0] is input `first` (counted from 0)."""
    if n == 1:
        return tokenizer.decode([hyps[0].tokens for hyps in n_best])
    return [
        f"{i}\t{h.score:.4f}\t{tokenizer.decode([h.tokens])[0]}" for i, hyps in enumerate(n_best, first) for h in hyps
    ]


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, TranslateConfig, __doc__)
        inputs = [cfg.checkpoint, *cfg.ensemble, cfg.input]
        output = None if cfg.output is None else check_output(cfg.output, inputs)
        device, model, tokenizer, payload = load_decoder(cfg.checkpoint, cfg.ensemble, cfg.device, cfg.runtime)
        warn_if_target_language(cfg.input, payload)
        name, count = cfg.input or "stdin", 0
        with progress_bar(None, "translate") as bar, output_stream(output) as write:
            for lines in input_chunks(cfg):  # each chunk's translations written before the next is read
                n_best = translate_texts(model, lines, tokenizer, cfg.decode, device, bar, name, count + 1)
                write(output_lines(n_best, tokenizer, cfg.decode.n_best, count))
                count += len(lines)
        if not count:
            log.warning("the input (%s) has no lines: nothing to translate", cfg.input or "stdin")


if __name__ == "__main__":
    main(sys.argv[1:])
