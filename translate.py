"""Translate sentences with a trained checkpoint (greedy decoding).

    python translate.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt < input.de > output.en
    python translate.py checkpoint=PATH input=input.de output=output.en device=cpu

Arguments are key=value pairs like train.py's; the tokenizer comes from the checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from transformer.config import ConfigError, exit_on_user_error, to_config
from transformer.data import DataError, read_lines
from transformer.decoding import DecodeConfig


@dataclass
class TranslateConfig:
    checkpoint: str = "???"
    input: Optional[str] = None  # a text file, one sentence per line; default stdin
    output: Optional[str] = None  # default stdout
    device: str = "auto"
    decode: DecodeConfig = field(default_factory=DecodeConfig)


def parse_args(argv: list[str]) -> TranslateConfig:
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise ConfigError(f"expected key=value arguments, got {bad[0]!r} (see python translate.py --help)")
    cfg = to_config(OmegaConf.from_dotlist(argv), TranslateConfig)
    if cfg.checkpoint == "???":
        raise ConfigError("missing checkpoint=PATH")
    return cfg


def read_input(path: str | None) -> list[str]:
    if path is None:
        return [line.strip() for line in sys.stdin]
    return read_lines(Path(path))


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    with exit_on_user_error():
        cfg = parse_args(argv)
        from transformer.checkpoint import load_model
        from transformer.decoding import translate
        from transformer.training import pick_device

        device = pick_device(cfg.device)
        model, tokenizer, _ = load_model(Path(cfg.checkpoint), device)
        translations = translate(model, read_input(cfg.input), tokenizer, cfg.decode, device)
        text = "".join(t + "\n" for t in translations)
        if cfg.output is None:
            sys.stdout.write(text)
        else:
            try:
                Path(cfg.output).write_text(text, encoding="utf-8")
            except OSError as e:
                raise DataError(f"cannot write {cfg.output}: {e.strerror}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
