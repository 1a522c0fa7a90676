"""Score a checkpoint with sacreBLEU and chrF (signatures included) and write its hypotheses.

    python evaluate.py checkpoint=outputs/de-en/RUN/checkpoint_best.pt                  # test_2016_flickr
    python evaluate.py checkpoint=PATH split=test_2017_flickr decode.strategy=greedy
    python evaluate.py checkpoint=PATH src=newstest.de ref=newstest.en lowercase=true

Arguments (key=value and config groups, composed by Hydra from configs/ as for train.py):
    checkpoint=PATH   ensemble=[PATH,...]   device=auto|cpu|cuda
    runtime=fast|reference  reference: the model as written, without the speed paths
    split=NAME        a split of the training run's corpus (data.dir and languages from the checkpoint;
                      override with data_dir=, src_lang=, tgt_lang=)
    src=PATH ref=PATH a source file and its reference translations instead of a split
    lowercase=false   case-insensitive BLEU (sacreBLEU -lc)
    output=PATH       where the hypotheses go; default: next to the checkpoint
    compare=PATH      another system's translations of the same source: paired bootstrap and approximate
                      randomization tests against it (sacreBLEU), with the difference's 95% confidence interval
    compare_seed=12345  the tests' random draws
    decode=beam|greedy|sample, decode.*   as for translate.py (default: beam search, beam 5)
A many-to-many checkpoint (data.directions) translates into tgt_lang= (by default the language of
the reference file); all_directions=true scores every pair of its languages that the split has,
trained or zero-shot, and prints a table with their means (it takes no src=, ref=, src_lang=,
tgt_lang=, output= or compare=).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformer.cli import ScoringInputs, file_language, parse_args, setup_logging, source_and_reference
from transformer.data import corpus_file, has_corpus_file, read_parallel, write_lines
from transformer.decoding import DecodeConfig
from transformer.errors import ConfigError, exit_on_user_error
from transformer.evaluation import score
from transformer.files import check_output
from transformer.monitoring import progress_bar
from transformer.significance import compare
from transformer.translator import Translator

# What all_directions=true has no use for: it reads split= in every language and names its own outputs.
NOT_WITH_ALL_DIRECTIONS = ("src", "ref", "src_lang", "tgt_lang", "output", "compare")


@dataclass
class EvaluateConfig(ScoringInputs):
    lowercase: bool = False
    output: Optional[str] = None
    compare: Optional[str] = None  # a baseline's hypotheses: test whether this checkpoint differs from it
    compare_seed: int = 12345
    device: str = "auto"
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    all_directions: bool = False  # a many-to-many checkpoint: every pair of its languages on split=

    def __post_init__(self) -> None:
        if self.compare_seed < 1:  # sacreBLEU reads a seed of 0 as "no seed"
            raise ValueError(f"compare_seed={self.compare_seed} must be >= 1")
        given = [key for key in NOT_WITH_ALL_DIRECTIONS if getattr(self, key) is not None]
        if self.all_directions and given:
            raise ValueError(f"all_directions=true scores every direction of split= into files of its own: it cannot be used with {given[0]}=")  # fmt: skip


def main(argv: list[str]) -> None:
    setup_logging()
    with exit_on_user_error():
        cfg = parse_args(argv, EvaluateConfig, __doc__, "evaluate")
        translator = Translator.load(cfg.checkpoint, cfg.ensemble, cfg.device, cfg.decode, cfg.runtime)
        if cfg.all_directions:
            return evaluate_directions(cfg, translator)
        src_path, ref_path = source_and_reference(cfg, translator.payload.get("train_config", {}))
        label = cfg.decode.label
        tgt_lang = cfg.tgt_lang or (file_language(str(ref_path)) if translator.target_languages else None)
        direction = (
            f".{file_language(str(src_path))}-{tgt_lang}" if translator.target_languages else ""
        )  # one file per direction
        default_output = Path(cfg.checkpoint).with_suffix(f".{src_path.name.split('.')[0]}.{label}{direction}.hyp")
        inputs = [cfg.checkpoint, *cfg.ensemble, src_path, ref_path, cfg.compare]
        output = check_output(cfg.output or default_output, inputs)
        sources, references = read_parallel(src_path, ref_path)
        baseline = None if cfg.compare is None else read_parallel(Path(cfg.compare), ref_path)[0]
        with progress_bar(len(sources), "evaluate") as bar:
            hyps = translator.translate(sources, progress=bar, source_name=str(src_path), tgt_lang=tgt_lang)
        write_lines(output, hyps)
        scores = score(hyps, references, lowercase=cfg.lowercase)
        print(scores.summary(f"{src_path.name} -> {ref_path.name} {label}"))
        print(f"hypotheses: {output}")
        if baseline is not None:
            print(f"{label} against compare={cfg.compare} (seed {cfg.compare_seed}):")
            for result in compare(baseline, hyps, references, cfg.lowercase, cfg.compare_seed):
                print("  " + result.summary())


def evaluate_directions(cfg: EvaluateConfig, translator: Translator) -> None:
    """Score every direction between the languages of a many-to-many checkpoint that split= has
    files for; the directions it was trained on and the zero-shot ones get a mean each."""
    if not translator.directions:
        raise ConfigError(f"all_directions=true needs a many-to-many checkpoint (data.directions); {cfg.checkpoint} is not one")  # fmt: skip
    data = translator.payload["train_config"]["data"]
    directory = Path(cfg.data_dir or data.get("dir", "data/multi30k"))
    langs = list(dict.fromkeys(lang for name in translator.directions for lang in name.split("-")))
    have = [lang for lang in langs if has_corpus_file(directory, cfg.split, lang)]
    rows = []
    for src, tgt in ((s, t) for s in have for t in have if s != t and t in translator.target_languages):
        sources, references = read_parallel(
            corpus_file(directory, cfg.split, src), corpus_file(directory, cfg.split, tgt)
        )
        with progress_bar(len(sources), f"{src}-{tgt}") as bar:
            hyps = translator.translate(sources, progress=bar, source_name=f"{cfg.split}.{src}", tgt_lang=tgt)
        write_lines(Path(cfg.checkpoint).with_suffix(f".{cfg.split}.{cfg.decode.label}.{src}-{tgt}.hyp"), hyps)
        scores = score(hyps, references, lowercase=cfg.lowercase)
        rows.append((f"{src}-{tgt}", f"{src}-{tgt}" in translator.directions, scores))
        print(scores.summary(f"{cfg.split} {src}-{tgt} {cfg.decode.label}"), file=sys.stderr)
    print(f"| {cfg.split} {cfg.decode.label} | trained | BLEU | chrF |\n|---|---|---:|---:|")
    for name, trained, scores in rows:
        print(f"| {name} | {'yes' if trained else 'zero-shot'} | {scores.bleu:.2f} | {scores.chrf:.2f} |")
    for trained in (True, False):
        group = [scores for _, t, scores in rows if t == trained]
        if group:
            bleu, chrf = (sum(getattr(s, key) for s in group) / len(group) for key in ("bleu", "chrf"))
            print(f"| mean of {len(group)} | {'yes' if trained else 'zero-shot'} | {bleu:.2f} | {chrf:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
