"""Translate sentences with a trained checkpoint, one output line per input line.

    python translate.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt < input.de > output.en
    python translate.py checkpoint=PATH input=input.de output=output.en decode.beam_size=5 device=cpu
    python translate.py checkpoint=PATH interactive=true      # type a sentence, read its translation

Arguments (key=value and config groups, composed by Hydra from configs/ as for train.py):
    checkpoint=PATH            a checkpoint written by train.py (the tokenizer is inside it)
    ensemble=[PATH,...]        more checkpoints with the same tokenizer; probabilities are averaged
    input=PATH output=PATH     default: stdin and stdout
    chunk_lines=2000           lines read, translated and written at a time: memory stays bounded
                               and output follows a pipe as its lines arrive (scheduler=batch)
    interactive=true           translate each line as it arrives (the default when stdin is a terminal)
    scheduler=batch|continuous continuous: each line joins the running batch at the next decoding
                               step as soon as it is read, and is written as soon as it and the
                               lines before it have ended (for streams; plain lines, greedy and
                               beam search; otherwise a warning and scheduler=batch), as serve.py's
    scheduler.pool_mib=256     continuous: the key/value pool; lines wait when it is full
    device=auto|cpu|cuda
    runtime=fast|reference     reference: the model as written, without the speed paths
    decode=beam|greedy|sample  a decoding preset (configs/decode/); then decode.beam_size=5 etc.
    runtime.precision=fp32|bf16|fp16|auto|int8
    decode.strategy=beam|greedy|sample   decode.beam_size=5   decode.length_penalty=0.6
    decode.n_best=N            N > 1 writes N lines per input: index <TAB> score <TAB> translation
    decode.max_tokens=8192     source tokens per batch
    decode.temperature / decode.top_k / decode.top_p / decode.seed   for sampling
    prefix=true                input lines are source<TAB>prefix: each translation starts with its prefix
    constraints=true           input lines are source<TAB>phrase<TAB>...: each translation contains the phrases
    score=true                 input lines are source<TAB>translation: writes each translation's log-probability
                               given its source (tokens and EOS, summed), as Marian's scorer
    decode.alignment=true      translation <TAB> its word alignment, i-j pairs (source word i, output word j)
    tgt_lang=fr                a many-to-many model's target language (data.directions); a source
                               language need not be named
    pivot=en                   translate into the pivot language first, then from it into tgt_lang
                               (the baseline for directions a many-to-many model was not trained on)
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
from transformer.decoding import DecodeConfig, Hypothesis, split_constraints, split_prefixes
from transformer.decoding.config import SchedulerConfig
from transformer.errors import exit_on_user_error
from transformer.files import atomic_open, check_output
from transformer.monitoring import progress_bar
from transformer.runtime import RuntimeConfig
from transformer.translator import Translator, output_lines

log = logging.getLogger("translate")

CHUNK_LINES = 2000  # scheduler=batch reads this many lines at a time unless chunk_lines= says


@dataclass
class TranslateConfig:
    checkpoint: str = "???"
    ensemble: list[str] = field(default_factory=list)
    input: Optional[str] = None
    output: Optional[str] = None
    device: str = "auto"
    chunk_lines: Optional[int] = None  # None: CHUNK_LINES; set, it cannot go with scheduler=continuous
    interactive: bool = False
    prefix: bool = False  # input lines are source<TAB>prefix (transformer/decoding/inputs.py)
    constraints: bool = False  # input lines are source<TAB>phrase<TAB>phrase... (beam search only)
    score: bool = False  # input lines are source<TAB>translation: write each translation's log-probability
    scheduler: SchedulerConfig = field(
        default_factory=SchedulerConfig
    )  # scheduler=continuous: lines join the running batch step by step (decoding/stream.py)
    tgt_lang: Optional[str] = None  # a many-to-many model's target language
    pivot: Optional[str] = None  # translate into this language first, then from it into tgt_lang
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def line_options(self) -> list[str]:
        """The options set that make a line more than a sentence to translate, or change its output."""
        given = {"prefix": self.prefix, "constraints": self.constraints, "pivot": self.pivot, "decode.alignment": self.decode.alignment}  # fmt: skip
        return [key for key, value in given.items() if value]

    def __post_init__(self) -> None:
        if self.chunk_lines is not None and self.chunk_lines < 1:
            raise ValueError(f"chunk_lines={self.chunk_lines} must be >= 1")
        if self.scheduler.kind == "continuous" and self.chunk_lines is not None:
            raise ValueError("scheduler=continuous reads each line as it arrives: it cannot be used with chunk_lines=")
        if self.prefix and self.constraints:
            raise ValueError("prefix=true and constraints=true read different lines: choose one")
        if self.score and self.line_options():
            raise ValueError(f"score=true scores given translations: it cannot be used with {self.line_options()[0]}=")
        if self.pivot is not None and (self.tgt_lang is None or self.pivot == self.tgt_lang):
            raise ValueError(f"pivot={self.pivot} needs tgt_lang= naming another language to translate into")
        if self.pivot is not None and self.decode.alignment:
            raise ValueError(
                "decode.alignment=true aligns a translation with its source: it cannot be used with pivot="
            )


def input_chunks(cfg: TranslateConfig, size: int | None = None) -> Iterator[list[str]]:
    """The input's lines in chunks: one line at a time when interactive (or stdin is a terminal).
    Bytes are decoded strictly: text mode would let invalid UTF-8 through as escapes."""
    terminal = cfg.input is None and sys.stdin.isatty()
    if terminal:
        log.info("type one sentence per line; Ctrl-D ends")
    size = size or (1 if cfg.interactive or terminal else cfg.chunk_lines or CHUNK_LINES)
    return line_chunks(None if cfg.input is None else Path(cfg.input), size)


@contextmanager
def output_stream(path: Path | None) -> Iterator[Callable[[list[str]], None]]:
    """A function that writes lines: to stdout at once (flushed), or to `path` atomically when done."""
    if path is None:
        yield lambda lines: (sys.stdout.write("".join(line + "\n" for line in lines)), sys.stdout.flush())
        return
    with atomic_open(path) as f:
        yield lambda lines: f.write("".join(line + "\n" for line in lines).encode("utf-8"))


def warn_if_target_language(path: str | None, translator: Translator) -> None:
    """An input file named in the language the model translates into is likely the wrong file."""
    pair = language_pair(translator.payload.get("train_config"))
    if pair and file_language(path) == pair[1] and pair[1] not in pair[0]:
        log.warning("input=%s looks like %s, the language the checkpoint translates into (%s)", path, pair[1], direction(pair))  # fmt: skip


def translate_chunk(cfg: TranslateConfig, translator: Translator, lines: list[str], bar, name: str, count: int) -> list[str]:  # fmt: skip
    """The output lines of one chunk of input lines, the first of them line count + 1 of `name`."""
    first = count + 1
    if cfg.score:
        return score_lines(cfg, translator, lines, bar, name, first)
    lines, prefixes = split_prefixes(lines, name, first) if cfg.prefix else (lines, None)
    lines, constraints = split_constraints(lines, name, first) if cfg.constraints else (lines, None)
    if cfg.pivot is not None:  # the pivot translations are the sources of the second leg
        lines = translator.translate(lines, None, None, name, tgt_lang=cfg.pivot)
    n_best = translator.translate_texts(lines, None, bar, name, first, prefixes, constraints, cfg.tgt_lang)
    alignments = translator.align(lines, n_best) if cfg.decode.alignment else None
    return output_lines(n_best, translator.tokenizer, cfg.decode.n_best, count, alignments)


def score_lines(cfg: TranslateConfig, translator: Translator, lines: list[str], bar, name: str, first: int) -> list[str]:  # fmt: skip
    """score=true: for each source<TAB>translation line, the translation's log-probability given
    its source (its tokens' and its EOS's, summed; what Marian's scorer writes), to 4 decimals."""
    sources, targets = split_prefixes(lines, name, first, second="translation")
    log_probs = translator.score(sources, targets, cfg.tgt_lang, name, first)
    out = [""] * len(lines)
    for i, lp in enumerate(log_probs):
        if lines[i]:  # an empty line gets an empty line
            out[i] = f"{sum(lp):.4f}"
    bar.update(len(lines))
    return out


def plain_lines_only(cfg: TranslateConfig) -> str | None:
    """Why the continuous engine cannot translate these inputs (it takes plain lines), or None."""
    given = cfg.line_options() + (["score"] if cfg.score else [])
    return f"it translates plain lines, not {given[0]}=" if given else None


def translate_continuous(cfg: TranslateConfig, translator: Translator, engine, bar, name: str, write) -> int:
    """scheduler=continuous: every input line through Translator.translate_stream on the
    step-level engine; returns the line count."""

    def write_line(index: int, n_best: list[Hypothesis]) -> None:
        write(output_lines([n_best], translator.tokenizer, translator.decode.n_best, index))
        bar.update(1)

    lines = (line for chunk in input_chunks(cfg, size=1) for line in chunk)
    return translator.translate_stream(lines, write_line, cfg.scheduler, cfg.tgt_lang, name, engine=engine)


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, TranslateConfig, __doc__, "translate")
        inputs = [cfg.checkpoint, *cfg.ensemble, cfg.input]
        output = None if cfg.output is None else check_output(cfg.output, inputs)
        translator = Translator.load(cfg.checkpoint, cfg.ensemble, cfg.device, cfg.decode, cfg.runtime)
        translator.target_tag(cfg.tgt_lang)  # a language the model lacks fails before any input is read
        if cfg.pivot is not None:
            translator.target_tag(cfg.pivot)
        warn_if_target_language(cfg.input, translator)
        engine = translator.continuous_engine(cfg.scheduler, cfg.decode.beam_size, "decode.beam_size", plain_lines_only(cfg))  # fmt: skip
        name, count = cfg.input or "stdin", 0
        with progress_bar(None, "translate") as bar, output_stream(output) as write:
            if engine is not None:
                count = translate_continuous(cfg, translator, engine, bar, name, write)
            else:
                for lines in input_chunks(cfg):  # each chunk's translations written before the next is read
                    write(translate_chunk(cfg, translator, lines, bar, name, count))
                    count += len(lines)
        if not count:
            log.warning("the input (%s) has no lines: nothing to translate", cfg.input or "stdin")


if __name__ == "__main__":
    main(sys.argv[1:])
