"""Export a checkpoint to a CTranslate2 model directory, for fast CPU (and GPU) inference.

    python scripts/export_ctranslate2.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt output=exported/
    python scripts/export_ctranslate2.py checkpoint=PATH output=DIR quantization=int8

Arguments (key=value):
    checkpoint=PATH     a checkpoint written by train.py
    output=DIR          the directory to write: new or empty (overwrite=true replaces an existing one)
    quantization=float32|int8|int8_float32|bfloat16   the weights' type on disk (default float32;
                        a float32 export can still be loaded with compute_type=int8 or bfloat16)
    overwrite=false

The directory holds model.bin, config.json, the vocabularies, the SentencePiece model(s), the
run's lexical shortlist as vmap.txt when it has one (scripts/build_shortlist.py), and a README.md
with usage. Needs the ctranslate2 package (pip install -e '.[export]'). Models with
an attention variant CTranslate2 cannot express (model.attention.kind other than standard) are refused.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from transformer.checkpoint import direction, directions_of, language_pair, load_model
from transformer.cli import parse_args
from transformer.decoding.shortlist import shortlist_path
from transformer.errors import exit_on_user_error
from transformer.interop.export import (
    QUANTIZATIONS,
    VOCABULARY_MAP,
    check_exportable,
    check_output_dir,
    export,
    require_ctranslate2,
)


@dataclass
class ExportConfig:
    checkpoint: str = "???"
    output: str = "???"
    quantization: str = "float32"
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not one of {QUANTIZATIONS}")


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, ExportConfig, __doc__)
        require_ctranslate2()
        output = check_output_dir(cfg.output, cfg.overwrite)
        model, tokenizer, payload = load_model(Path(cfg.checkpoint))
        check_exportable(model.cfg)
        pair = language_pair(payload.get("train_config"))
        note = f"Exported from {cfg.checkpoint} (step {payload.get('step')}"
        ways = directions_of(payload.get("train_config"))
        note += f", {direction(pair)}).\n" if pair else f", {len(ways)} directions: {', '.join(ways)}).\n" if ways else ").\n"  # fmt: skip
        shortlist = shortlist_path(Path(cfg.checkpoint))
        shortlist = shortlist if shortlist.is_file() else None
        export(model, tokenizer, output, cfg.quantization, note, shortlist)
        vmap = f", with {shortlist} as {VOCABULARY_MAP} for use_vmap=True" if shortlist else ""
        print(f"exported {cfg.checkpoint} to {output} ({cfg.quantization}{vmap})")


if __name__ == "__main__":
    main(sys.argv[1:])
