"""Translate sentences with a trained checkpoint, one output line per input line.

    python translate.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt < input.de > output.en
    python translate.py checkpoint=PATH input=input.de output=output.en decode.beam_size=5 device=cpu

Arguments (key=value, as for train.py):
    checkpoint=PATH            a checkpoint written by train.py (the tokenizer is inside it)
    ensemble=[PATH,...]        more checkpoints with the same tokenizer; probabilities are averaged
    input=PATH output=PATH     default: stdin and stdout
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformer.checkpoint import direction, language_pair
from transformer.cli import file_language, parse_args, setup_logging
from transformer.data import decode_lines, read_lines, write_lines
from transformer.decoding import DecodeConfig, Hypothesis, load_decoder, translate_texts
from transformer.errors import exit_on_user_error
from transformer.fast import RuntimeConfig
from transformer.files import check_output
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
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


def read_input(path: str | None) -> list[str]:
    if path is None:  # the bytes, decoded strictly: text mode would let invalid UTF-8 through as escapes
        return decode_lines(sys.stdin.buffer.read(), "standard input")
    return read_lines(Path(path))


def warn_if_target_language(path: str | None, payload: dict) -> None:
    """An input file named in the language the model translates into is likely the wrong file."""
    pair = language_pair(payload.get("train_config"))
    if pair and file_language(path) == pair[1] and pair[1] not in pair[0]:
        log.warning("input=%s looks like %s, the language the checkpoint translates into (%s)", path, pair[1], direction(pair))  # fmt: skip


def output_lines(n_best: list[list[Hypothesis]], tokenizer, n: int) -> list[str]:
    """One line per input (n = 1), or n lines per input: index <TAB> score <TAB> translation."""
    if n == 1:
        return tokenizer.decode([hyps[0].tokens for hyps in n_best])
    return [f"{i}\t{h.score:.4f}\t{tokenizer.decode([h.tokens])[0]}" for i, hyps in enumerate(n_best) for h in hyps]


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, TranslateConfig, __doc__)
        inputs = [cfg.checkpoint, *cfg.ensemble, cfg.input]
        output = None if cfg.output is None else check_output(cfg.output, inputs)
        device, model, tokenizer, payload = load_decoder(
            cfg.checkpoint, cfg.ensemble, cfg.device, cfg.runtime, cfg.decode.precision
        )
        warn_if_target_language(cfg.input, payload)
        lines = read_input(cfg.input)
        if not lines:
            log.warning("the input (%s) has no lines: nothing to translate", cfg.input or "stdin")
        name = cfg.input or "stdin"
        with progress_bar(sum(1 for line in lines if line), "translate") as bar:
            n_best = translate_texts(model, lines, tokenizer, cfg.decode, device, bar, source_name=name)
        out = output_lines(n_best, tokenizer, cfg.decode.n_best)
        if output is None:
            sys.stdout.write("".join(line + "\n" for line in out))
        else:
            write_lines(output, out)


if __name__ == "__main__":
    main(sys.argv[1:])
