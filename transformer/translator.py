"""The one way in to translating: a `Translator` owns the model (one checkpoint, an ensemble, an
imported or averaged checkpoint, or the model being trained), its runtime (the speed paths of
transformer/fast/), its precision (fp32; bf16 or fp16 autocast; int8 linear layers), its device,
its tokenizer and its decoding settings. translate.py, evaluate.py, serve.py, training's validation
and test decoding, and every script that decodes go through it, so a precision or runtime option
added here reaches all of them.

    translator = Translator.load("checkpoint_best.pt", runtime=RuntimeConfig(precision="int8"))
    translator.translate(["Ein Hund läuft."])            # -> ["A dog is running."]
    translator.score(["Ein Hund läuft."], ["A dog is running."])   # log-probability per token
    translator.translate_stream(lines, write, SchedulerConfig(kind="continuous"))  # in order, as they end
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .checkpoint import direction, directions_of, language_pair, load_model, same_direction
from .decoding import DecodeConfig, Ensemble, Hypothesis, encode_sources
from .decoding import corpus as decoding
from .decoding.alignment import align_translations
from .decoding.config import SchedulerConfig
from .decoding.engine import Engine, unsupported_settings
from .decoding.inputs import encode_prefixes
from .decoding.shortlist import Shortlist, ShortlistModel, shortlist_path
from .decoding.strategies import empty_n_best
from .decoding.stream import translate_stream
from .devices import pick_device
from .errors import ConfigError
from .fast import accelerate, paged
from .fast.int8 import available as int8_available
from .fast.int8 import quantize_int8
from .runtime import RuntimeConfig

log = logging.getLogger(__name__)


class Translator:
    """A model ready to decode with `decode`'s settings, in `precision` (runtime.precision, which
    the model was prepared for when it loaded: an int8 model's layers are int8); one call at a time
    per Translator (`lock` serializes callers from several threads, as the server's are)."""

    def __init__(self, model, tokenizer, device, decode: DecodeConfig, payload: dict | None = None, precision: str = "fp32"):  # fmt: skip
        self.model, self.tokenizer, self.device, self.decode = model.eval(), tokenizer, torch.device(device), decode
        self.precision = precision
        self.payload = payload or {}
        self.pair = language_pair(self.payload.get("train_config"))
        self.language_pair = direction(self.pair) if self.pair else None  # e.g. "de->en"; None for a model without one
        # A many-to-many model's directions, e.g. ["de-en", "en-fr"]; [] for another.
        self.directions = directions_of(self.payload.get("train_config"))
        self.lock = threading.Lock()
        self.fallback: str | None = None  # why scheduler=continuous was not used when asked for (continuous_engine)
        self.shortlist: Shortlist | None = None  # read from shortlist_file when decode.shortlist first asks
        self.shortlist_file: Path | None = None  # beside the checkpoint (set by load)

    @classmethod
    def load(
        cls,
        checkpoint: str | Path,
        ensemble: list[str] = (),
        device: str = "auto",
        decode: DecodeConfig | None = None,
        runtime: RuntimeConfig | None = None,
    ) -> Translator:
        """A checkpoint (any written by train.py, scripts/average_checkpoints.py or
        scripts/import_marian.py), or an ensemble of it and `ensemble`, each with `runtime`'s speed
        paths, in `runtime.precision`. ConfigError names what cannot be decoded as asked."""
        decode, runtime, device = decode or DecodeConfig(), runtime or RuntimeConfig(), pick_device(device)
        check_precision(runtime.precision, device)
        model, tokenizer, payload = load_model(Path(checkpoint), device)
        others = [load_model(Path(path), device) for path in ensemble]
        pair = language_pair(payload.get("train_config"))
        for path, (_, other_tokenizer, other_payload) in zip(ensemble, others):
            other_pair = language_pair(other_payload.get("train_config"))
            if not same_direction(pair, other_pair):
                raise ConfigError(
                    f"ensemble checkpoint {path} translates {direction(other_pair)}, but {checkpoint} translates {direction(pair)}"
                )
            if other_tokenizer.target_tags != tokenizer.target_tags:
                have = lambda t: ", ".join(sorted(t)) or "none"  # noqa: E731
                raise ConfigError(f"ensemble checkpoint {path} has target-language tags {have(other_tokenizer.target_tags)}, but {checkpoint} has {have(tokenizer.target_tags)}")  # fmt: skip
            if not other_tokenizer.same_as(tokenizer):
                raise ConfigError(f"ensemble checkpoint {path} has another tokenizer than {checkpoint}")
        int8 = runtime.precision == "int8"
        models = [accelerate(m, runtime, int8) for m in [model] + [m for m, _, _ in others]]
        model = models[0] if len(models) == 1 else Ensemble(models)
        translator = cls(model, tokenizer, device, decode, payload, runtime.precision)
        translator.shortlist_file = shortlist_path(Path(checkpoint))
        if decode.shortlist:
            translator.decoding_model(decode)  # a missing shortlist stops here, before any input is read
        return translator

    @classmethod
    def of_training(cls, model, tokenizer, decode: DecodeConfig, precision: str = "fp32") -> Translator:
        """The model being trained (its runtime installed when it was built), decoding with
        `decode` in `precision`: for int8 a quantized copy, so the trained weights stay fp32."""
        device = next(model.parameters()).device
        check_precision(precision, device)
        if precision == "int8":  # fp32 products where int8 is slower: oneDNN's where the runtime chose it
            model = quantize_int8(copy.deepcopy(model), getattr(model, "onednn", False))
        return cls(model, tokenizer, device, decode, precision=precision)

    # ---- target languages

    @property
    def target_languages(self) -> list[str]:
        """The languages a many-to-many model translates into, by its tokenizer's target tags; [] for another."""
        return sorted(self.tokenizer.target_tags)

    def target_tag(self, tgt_lang: str | None) -> int | None:
        """The tag id a source starts with to be translated into `tgt_lang` (None: the model's
        default), or None for a model without tags. A model with tags has a default when it was
        fine-tuned on one direction or has one tag; otherwise tgt_lang is needed. ConfigError names
        a language the model does not translate into."""
        tags = self.tokenizer.target_tags
        if not tags:
            if tgt_lang is not None and self.pair is not None and tgt_lang != self.pair[1]:
                raise ConfigError(f"tgt_lang={tgt_lang}, but this model translates {self.language_pair} only")
            return None
        if tgt_lang is None:
            tgt_lang = self.pair[1] if self.pair is not None else next(iter(tags)) if len(tags) == 1 else None
        if tgt_lang is None:
            raise ConfigError(
                f"this model translates into {', '.join(self.target_languages)}: choose one with tgt_lang="
            )
        if tgt_lang not in tags:
            raise ConfigError(f"tgt_lang={tgt_lang}: this model translates into {', '.join(self.target_languages)}")
        return tags[tgt_lang]

    # ---- decoding

    def settings(self, beam_size: int | None = None, n_best: int | None = None, length_penalty: float | None = None):
        """These decode settings with a caller's changes (a server request's); a ValueError names a
        bad combination. Asking for a beam or an n-best list asks for beam search."""
        changes = {"beam_size": beam_size, "n_best": n_best, "length_penalty": length_penalty}
        changes = {key: value for key, value in changes.items() if value is not None}
        if "beam_size" in changes or changes.get("n_best", 1) > 1:
            changes["strategy"] = "beam"
        if "n_best" in changes and "beam_size" not in changes:
            changes["beam_size"] = max(self.decode.beam_size, changes["n_best"])
        return dataclasses.replace(self.decode, **changes)

    def chosen(self, settings: DecodeConfig | None) -> DecodeConfig:
        """`settings`, or this Translator's."""
        return settings or self.decode

    def decoding_model(self, cfg: DecodeConfig):
        """The model the searches decode with these settings: with decode.shortlist, narrowed to
        each batch's shortlist candidates (decoding/shortlist.py)."""
        if not cfg.shortlist:
            return self.model
        if self.shortlist is None:
            if self.shortlist_file is None or not self.shortlist_file.is_file():
                where = f" ({self.shortlist_file} does not exist)" if self.shortlist_file else ""
                raise ConfigError(f"decode.shortlist=true needs a shortlist beside the checkpoint{where}: build it with python scripts/build_shortlist.py checkpoint=PATH")  # fmt: skip
            self.shortlist = Shortlist.load(self.shortlist_file, self.tokenizer)
            log.info("shortlist %s: %d frequent target pieces and up to %d per source piece", self.shortlist_file, len(self.shortlist.fixed), self.shortlist.best)  # fmt: skip
        t = self.tokenizer
        return ShortlistModel(self.model, self.shortlist, (t.eos_id, t.unk_id, t.bos_id))

    def translate_ids(self, sources: list[list[int]], settings=None, progress=None, prefixes=None, constraints=None):
        """n-best lists (Hypothesis) of token-id sentences, in input order (decoding/corpus.py)."""
        cfg = self.chosen(settings)
        with self.lock:
            return decoding.translate_ids(self.decoding_model(cfg), sources, self.tokenizer, cfg, self.device, progress, prefixes, constraints, self.precision)  # fmt: skip

    def score_ids(self, sources: list[list[int]], targets: list[list[int]], settings=None) -> list[list[float]]:
        """Each target's log-probability per token, its EOS last, given its source, in input order
        (decoding/corpus.py: score_ids; CTranslate2's score_batch). A pair's score is the sum."""
        with self.lock:
            return decoding.score_ids(self.model, sources, targets, self.tokenizer, self.chosen(settings), self.device, self.precision)  # fmt: skip

    def score(self, sources: list[str], targets: list[str], tgt_lang: str | None = None, source_name: str = "input", first_line: int = 1) -> list[list[float]]:  # fmt: skip
        """score_ids of texts: each target text's log-probability per token, given its source text.
        A source too long for the model is truncated with a warning, as one to translate; a target
        too long to end within the model's positions is a DataError naming its line (sources[0]
        is line `first_line` of source_name)."""
        tag = self.target_tag(tgt_lang)
        source_ids = encode_sources(sources, self.tokenizer, self.max_source_tokens, source_name, first_line, tag)
        target_ids = encode_prefixes(targets, self.tokenizer, self.model.cfg.max_positions - 1, source_name, first_line)
        return self.score_ids(source_ids, target_ids)

    def translate_texts(self, texts: list[str], settings=None, progress=None, source_name="input", first_line=1, prefixes=None, constraints=None, tgt_lang=None):  # fmt: skip
        """n-best lists of texts in input order; an empty text gets empty hypotheses. Warnings name
        texts[0] as line `first_line` of source_name. prefixes / constraints: decoding/inputs.py.
        tgt_lang: the target language of a many-to-many model (target_tag)."""
        tag, cfg = self.target_tag(tgt_lang), self.chosen(settings)
        with self.lock:
            return decoding.translate_texts(self.decoding_model(cfg), texts, self.tokenizer, cfg, self.device, progress, source_name, first_line, prefixes, constraints, tag, self.precision)  # fmt: skip

    def translate(self, texts: list[str], settings=None, progress=None, source_name="input", tgt_lang=None) -> list[str]:  # fmt: skip
        """The best translation of each text, in input order; empty texts give empty translations."""
        n_best = self.translate_texts(texts, settings, progress, source_name, tgt_lang=tgt_lang)
        return self.tokenizer.decode([hyps[0].tokens for hyps in n_best])

    def translate_corpus(self, corpus, settings=None) -> list[str]:
        """The best translation of each sentence of a tokenized corpus (batching.TokenizedCorpus)."""
        cfg = self.chosen(settings)
        with self.lock:
            return decoding.translate_corpus(self.decoding_model(cfg), corpus, self.tokenizer, cfg, self.device, self.precision)  # fmt: skip

    def align(self, texts: list[str], n_best: list[list[Hypothesis]], settings=None) -> list[list[str]]:
        """Each hypothesis's word alignment to its source, as i-j pairs (decoding/alignment.py)."""
        with self.lock:
            return align_translations(self.model, texts, n_best, self.tokenizer, self.chosen(settings), self.device)

    # ---- scheduling: batches, or the step-level engine

    def continuous_engine(self, scheduler: SchedulerConfig, max_beam_size: int, beam_key: str, refused: str | None = None, source_tokens: int | None = None, length_key: str | None = None):  # fmt: skip
        """For scheduler=continuous, the step-level engine (decoding/engine.py) on this model, its
        pool scheduler.pool_mib; None for scheduler=batch, and None after one warning line where
        the engine cannot run this model, these settings or a command's option (`refused`, why
        not): the command then decodes in batches. translate.py and serve.py share this policy.
        ConfigError when the pool cannot hold the longest sentence at `max_beam_size` alone: of
        `source_tokens` tokens where a command bounds them (serve.py's `length_key`), else of as
        many as the model's positions take."""
        if scheduler.kind != "continuous":
            return None
        self.fallback = refused or paged.supports(self.model) or unsupported_settings(self.decode)
        if self.fallback:
            log.warning("scheduler=continuous cannot run here (%s): decoding with scheduler=batch", self.fallback)
            return None
        engine = Engine(self.model, self.tokenizer, self.decode, self.device, scheduler.pool_bytes, scheduler.block_size, self.precision)  # fmt: skip
        longest = min(source_tokens or self.max_source_tokens, self.max_source_tokens) + 1  # EOS
        problem = engine.pool_too_small(longest, max_beam_size, beam_key, "scheduler.pool_mib", scheduler.pool_mib)
        if problem:
            raise ConfigError(problem + (f", or lower {length_key}" if length_key else ""))
        pool = engine.pool
        log.info(
            "scheduler=continuous: a key/value pool of %d blocks x %d positions (%.0f MiB)",
            pool.n_blocks, pool.block_size, engine.mib(pool.n_blocks),
        )  # fmt: skip
        return engine

    def translate_stream(self, lines: Iterable[str], write: Callable[[int, list[Hypothesis]], None], scheduler: SchedulerConfig | None = None, tgt_lang: str | None = None, source_name: str = "input", chunk_lines: int = 2000, engine: Engine | None = None) -> int:  # fmt: skip
        """Translate each line of `lines` (any iterable: a file, a pipe, a generator) and hand its
        n-best list to write(index, n_best) in input order; returns the number of lines.

        scheduler=continuous: each line joins the running batch of the step-level engine as soon as
        it is read and is written as soon as it and every line before it have ended (where the
        engine cannot run this model or these settings: a warning and batches). batch: chunks of
        `chunk_lines` lines, each translated in length-sorted batches and written before the next
        is read. Memory stays bounded either way, whatever the length of `lines`. `engine`: one
        made by `continuous_engine` already, to decode on."""
        scheduler = scheduler or SchedulerConfig()
        engine = engine or self.continuous_engine(scheduler, self.decode.beam_size, "decode.beam_size")
        tag = self.target_tag(tgt_lang)
        if engine is not None:

            def encode(text: str, index: int) -> list[int]:
                return encode_sources([text], self.tokenizer, self.max_source_tokens, source_name, index + 1, tag)[0]

            with self.lock:
                return translate_stream(engine, lines, encode, write, self.decode, self.tokenizer.eos_id)
        count, lines = 0, iter(lines)
        while chunk := list(itertools.islice(lines, chunk_lines)):
            for i, n_best in enumerate(
                self.translate_texts(chunk, None, None, source_name, count + 1, tgt_lang=tgt_lang)
            ):
                write(count + i, n_best)
            count += len(chunk)
        return count

    # ---- what the server asks of a model

    @property
    def max_source_tokens(self) -> int:
        """Source tokens a sentence may have: the EOS takes one position, and a target tag another."""
        return self.model.cfg.max_positions - 1 - bool(self.tokenizer.target_tags)

    def encode(self, texts: list[str], tgt_lang: str | None = None) -> list[list[int]]:
        """Source token ids, starting with tgt_lang's tag for a many-to-many model; an over-long
        text is truncated to what the model's positions allow (with a warning)."""
        return encode_sources(texts, self.tokenizer, self.max_source_tokens, "request", tag=self.target_tag(tgt_lang))

    def translate_batch(self, sources: list[list[int]], settings: DecodeConfig) -> list[list[Hypothesis]]:
        """n-best lists of token-id sentences in input order; an empty one gets empty hypotheses."""
        todo = [i for i, ids in enumerate(sources) if ids]
        empty = empty_n_best(settings)
        out = [empty for _ in sources]
        for i, hyps in zip(todo, self.translate_ids([sources[i] for i in todo], settings)):
            out[i] = hyps
        return out

    def texts(self, hypotheses: list[Hypothesis]) -> list[str]:
        return self.tokenizer.decode([h.tokens for h in hypotheses])

    @property
    def first_model(self):
        """The model whose attention is shown: the first member of an ensemble."""
        return self.model.models[0] if isinstance(self.model, Ensemble) else self.model

    @property
    def n_layers(self) -> int:
        return self.first_model.cfg.n_decoder_layers

    @torch.no_grad()
    def cross_attention(self, source: str, translation: str, layer: int, tgt_lang: str | None = None) -> dict:
        """Decoder layer `layer`'s cross-attention for the pair, averaged over heads: weights[i][j] is
        how much the step that wrote target token i looked at source token j (both end in </s>)."""
        if not -self.n_layers <= layer < self.n_layers:
            raise ValueError(
                f"layer={layer} is not a decoder layer: the model has {self.n_layers} (0..{self.n_layers - 1})"
            )
        src_ids = self.encode([source], tgt_lang)[0]
        tgt_ids = self.tokenizer.encode([translation])[0][: self.first_model.cfg.max_positions - 1]
        src = torch.tensor([src_ids + [self.tokenizer.eos_id]], device=self.device)
        tgt = torch.tensor([[self.tokenizer.bos_id] + tgt_ids], device=self.device)  # row i predicts token i
        with self.lock:
            weights = self.first_model.attention_weights(src, tgt)["cross"][layer]  # (1, heads, tgt_len, src_len)
        source_piece, target_piece = self.tokenizer.source.id_to_piece, self.tokenizer.id_to_piece
        return {
            "layer": layer % self.n_layers,
            "layers": self.n_layers,
            "source_tokens": [source_piece(i) for i in src_ids] + ["</s>"],
            "target_tokens": [target_piece(i) for i in tgt_ids] + ["</s>"],
            "weights": weights[0].float().mean(0).cpu().tolist(),  # (tgt_len, src_len)
        }


def check_precision(precision: str, device: torch.device) -> None:
    """int8 decodes on a CPU, with torch's oneDNN quantized product."""
    if precision == "int8" and device.type != "cpu":
        raise ConfigError(f"runtime.precision=int8 decodes on the CPU only, but device={device.type}")
    if precision == "int8" and not int8_available():
        raise ConfigError(
            "runtime.precision=int8 needs torch built with oneDNN's quantized linear; this torch has none"
        )


def output_lines(n_best: list[list[Hypothesis]], tokenizer, n: int, first: int = 0, alignments=None) -> list[str]:
    """One line per input (n = 1), or n lines per input: index <TAB> score <TAB> translation, where
    n_best[0] is input `first` (counted from 0); with alignments, each translation is followed by
    <TAB> and its i-j word alignment."""
    texts = [tokenizer.decode([h.tokens for h in hyps]) for hyps in n_best]
    if alignments is not None:
        texts = [[f"{t}\t{a}" for t, a in zip(ts, links)] for ts, links in zip(texts, alignments)]
    if n == 1:
        return [ts[0] for ts in texts]
    return [f"{i}\t{h.score:.4f}\t{t}" for i, (hyps, ts) in enumerate(zip(n_best, texts), first) for h, t in zip(hyps, ts)]  # fmt: skip
