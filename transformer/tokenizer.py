"""SentencePiece models trained on the training split: one joint model for source and target (the
default), or one per language (data.joint_vocab=false)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import sentencepiece as spm

from .data import DataError

# Fixed ids so a model and its tokenizer always agree on the special tokens.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
    """Text <-> token ids of the target side, and through `source` of the source side: the same
    object for a joint vocabulary, another Tokenizer (built from source_bytes) for a separate one.
    The serialized models travel inside every checkpoint."""

    def __init__(self, model_bytes: bytes, source_bytes: bytes | None = None):
        self.model_bytes, self.source_bytes = model_bytes, source_bytes
        if not model_bytes:  # SentencePiece would quietly leave the model unloaded
            raise DataError("not a SentencePiece model: it is empty")
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        except RuntimeError:  # how SentencePiece refuses bytes that are not one of its models
            raise DataError("not a SentencePiece model: its bytes do not parse") from None
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
        self.source = self if source_bytes is None else Tokenizer(source_bytes)

    @property
    def joint(self) -> bool:
        """True when source and target share one vocabulary."""
        return self.source is self

    def same_as(self, other: Tokenizer) -> bool:
        return (self.model_bytes, self.source_bytes) == (other.model_bytes, other.source_bytes)

    @classmethod
    def train(cls, sentences: Iterable[str], vocab_size: int, model_type: str, sample: int = 0) -> Tokenizer:
        """sample > 0: train on that many sentences drawn at random from the stream (SentencePiece
        keeps only those in memory); 0 uses them all."""
        stream = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences),
                model_writer=stream,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=1.0,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                num_threads=2,
                minloglevel=2,
                input_sentence_size=sample,
                shuffle_input_sentence=sample > 0,
            )
        except RuntimeError as e:  # how SentencePiece reports bad settings, e.g. too large a vocabulary
            settings = f"data.vocab_size={vocab_size}, data.spm_model_type={model_type}"
            raise DataError(f"cannot train the tokenizer ({settings}): {str(e).splitlines()[0]}") from None
        return cls(stream.getvalue())

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        """The model saved at `path`, with its separate source model if one is saved beside it."""
        source = source_path(Path(path))
        try:
            return cls(Path(path).read_bytes(), source.read_bytes() if source.is_file() else None)
        except DataError as e:
            raise DataError(f"{path}: {e}") from None

    def save(self, path: Path) -> None:
        """The (target or joint) model at `path`; a separate source model beside it, as
        spm.src.model for spm.model (a joint one removes any such file left from an earlier run)."""
        Path(path).write_bytes(self.model_bytes)
        if self.source_bytes is None:
            source_path(Path(path)).unlink(missing_ok=True)
        else:
            source_path(Path(path)).write_bytes(self.source_bytes)

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int)

    def nbest(self, texts: list[str], n: int) -> list[list[list[int]]]:
        """The n most likely segmentations of each text (unigram models), best first."""
        return self.sp.nbest_encode(texts, nbest_size=n, out_type=int)

    def piece_scores(self) -> np.ndarray:
        """Each piece's score: its log-probability in a unigram model."""
        return np.array([self.sp.get_score(i) for i in range(len(self))], dtype=np.float64)

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.sp.decode(ids) if ids else []  # SentencePiece reads an empty list as one empty sentence

    def pieces(self, text: str) -> list[str]:
        return self.sp.encode(text, out_type=str)


def source_path(path: Path) -> Path:
    """Where the separate source model of the model saved at `path` goes: spm.model -> spm.src.model."""
    return path.with_name(f"{path.stem}.src{path.suffix}")
