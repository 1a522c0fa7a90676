"""Import a MarianMT (OPUS-MT) model saved by Hugging Face transformers into a checkpoint of this toolkit.

    huggingface-cli download Helsinki-NLP/opus-mt-de-en --local-dir opus-mt-de-en   # needs network access
    python scripts/import_marian.py path=opus-mt-de-en output=opus-mt-de-en.pt
    python train.py init_from=opus-mt-de-en.pt data.dir=MY_CORPUS ...             # fine-tune it

Arguments (key=value):
    path=DIR        a directory as `save_pretrained` writes it: config.json, model.safetensors (or
                    pytorch_model.bin), source.spm, target.spm, vocab.json (tokenizer_config.json optional)
    output=PATH     the checkpoint to write (an existing checkpoint is never overwritten)
    src_lang=, tgt_lang=   the language pair, recorded in the checkpoint (default: tokenizer_config.json's
                    source_lang and target_lang; required when it has none)

The checkpoint loads like any other: translate.py, evaluate.py, serve.py, scripts/export_ctranslate2.py
and train.py init_from=. Its tokenizer keeps Marian's two SentencePiece models and shared vocabulary.
A multilingual model (target tokens such as >>fra<< in vocab.json) becomes a many-to-many checkpoint:
translate.py tgt_lang=fra puts the token in front of each source, as Marian's tokenizer does.
What our model cannot compute exactly (separate vocabularies, pre-norm,
unscaled embeddings, ...) is refused with one line naming the key. docs/FINETUNING.md has the details.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from transformer import checkpoint
from transformer.cli import parse_args
from transformer.config import Config
from transformer.errors import ConfigError, exit_on_user_error
from transformer.files import check_output
from transformer.interop.marian import read_marian
from transformer.model import count_parameters


@dataclass
class ImportConfig:
    path: str = "???"
    output: str = "???"
    src_lang: Optional[str] = None
    tgt_lang: Optional[str] = None


def train_config(model_cfg, tokenizer, source: dict, src_lang: str, tgt_lang: str) -> dict:
    """The config a training run of this model would have had: ours by default, with the model,
    the language pair and the vocabulary of the import, so that scripts reading it find them. A
    multilingual model's target tokens (>>fra<<) make it a many-to-many one: a direction from
    src_lang into each of them (its sources start with one, as translate.py tgt_lang=fra adds)."""
    cfg = Config(model=model_cfg)
    targets = [lang for lang in sorted(tokenizer.target_tags) if lang != src_lang]
    tgt_lang = tgt_lang or targets[0]
    directions = [f"{src_lang}-{lang}" for lang in targets]
    cfg.data = replace(cfg.data, src_lang=src_lang, tgt_lang=tgt_lang, vocab_size=len(tokenizer), joint_vocab=True, directions=directions)  # fmt: skip
    return asdict(cfg) | {"imported_from": source}


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        cfg = parse_args(argv, ImportConfig, __doc__)
        output = check_output(cfg.output)
        model, tokenizer, source = read_marian(Path(cfg.path))
        src_lang, tgt_lang = cfg.src_lang or source["source_lang"], cfg.tgt_lang or source["target_lang"]
        tags = tokenizer.target_tags
        for key, lang in (("src_lang", src_lang), ("tgt_lang", tgt_lang or tags)):
            if not lang:
                raise ConfigError(f"{cfg.path} does not say its languages: give {key}=...")
        config = train_config(model.cfg, tokenizer, source, src_lang, None if tags else tgt_lang)
        checkpoint.save(output, model, tokenizer, config, step=0, imported_from=source)
        languages = (
            f"{src_lang}->{','.join(sorted(tags))} by target tokens >>xxx<<" if tags else f"{src_lang}->{tgt_lang}"
        )
        print(f"imported {cfg.path} ({languages}, {count_parameters(model):,} parameters, {len(tokenizer)} pieces) into {output}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
