"""SentencePiece models trained on the training split: one joint model for source and target (the
default), or one per language (data.joint_vocab=false). An imported model (scripts/import_marian.py)
brings its own: two SentencePiece models, one per side, whose pieces are numbered by one shared
`Vocabulary` of its own (Marian's vocab.json) with its own special ids."""

from __future__ import annotations

import functools
import io
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from .corpus import DataError

# Fixed ids so a model and its tokenizer always agree on the special tokens (a Vocabulary names its own).
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Target-language tags, the first token of a many-to-many model's sources: ours are <2en>
# (SentencePiece user symbols, added by data.directions), Marian's multilingual models' >>fra<<.
TAG_PATTERNS = (re.compile(r"^<2([A-Za-z_]+)>$"), re.compile(r"^>>([A-Za-z_]+)<<$"))


def tag_piece(lang: str) -> str:
    """The tag our tokenizers give target language `lang`: <2en>."""
    return f"<2{lang}>"


@dataclass(frozen=True)
class Vocabulary:
    """Token ids of their own for the pieces of one or two SentencePiece models: id i is pieces[i].

    Marian's models number the pieces of both sides' SentencePiece models in one table (vocab.json),
    so that source and target share one embedding. bos_id is the token the decoder starts from
    (Marian's decoder_start_token_id, its padding token)."""

    pieces: tuple[str, ...]
    pad_id: int
    unk_id: int
    bos_id: int
    eos_id: int

    def __post_init__(self) -> None:
        if len(set(self.pieces)) != len(self.pieces):
            raise DataError("the vocabulary has a piece more than once")
        for key in ("pad_id", "unk_id", "bos_id", "eos_id"):
            if not 0 <= getattr(self, key) < len(self.pieces):
                raise DataError(f"the vocabulary's {key}={getattr(self, key)} is not one of its {len(self.pieces)} ids")

    def to_dict(self) -> dict:
        """Plain values, for a checkpoint (torch.load(weights_only=True) reads them) or JSON."""
        return asdict(self) | {"pieces": list(self.pieces)}

    @classmethod
    def from_dict(cls, values: dict) -> Vocabulary:
        try:
            return cls(**(values | {"pieces": tuple(values["pieces"])}))
        except (TypeError, KeyError) as e:
            raise DataError(f"not a vocabulary ({e})") from None


class Tokenizer:
    """Text <-> token ids of the target side, and through `source` of the source side: the same
    object for a joint vocabulary, another Tokenizer (built from source_bytes) for a separate one.
    With a `vocabulary`, ids are its numbers for the pieces SentencePiece returns (unknown pieces:
    its unk_id); source and target then share it, and with it one embedding. The serialized models
    (and the vocabulary) travel inside every checkpoint."""

    def __init__(self, model_bytes: bytes, source_bytes: bytes | None = None, vocabulary: Vocabulary | None = None):
        self.model_bytes, self.source_bytes, self.vocabulary = model_bytes, source_bytes, vocabulary
        if not model_bytes:  # SentencePiece would quietly leave the model unloaded
            raise DataError("not a SentencePiece model: it is empty")
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        except RuntimeError:  # how SentencePiece refuses bytes that are not one of its models
            raise DataError("not a SentencePiece model: its bytes do not parse") from None
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
        if vocabulary is not None:
            v = vocabulary
            self.pad_id, self.unk_id, self.bos_id, self.eos_id = v.pad_id, v.unk_id, v.bos_id, v.eos_id
            self.ids = {piece: i for i, piece in enumerate(v.pieces)}
        self.source = self if source_bytes is None else Tokenizer(source_bytes, vocabulary=vocabulary)

    @property
    def joint(self) -> bool:
        """True when source and target share one vocabulary (and embedding)."""
        return self.source is self or self.vocabulary is not None

    def same_as(self, other: Tokenizer) -> bool:
        mine, theirs = (self.model_bytes, self.source_bytes), (other.model_bytes, other.source_bytes)
        return mine == theirs and self.vocabulary == other.vocabulary

    @classmethod
    def train(
        cls, sentences: Iterable[str], vocab_size: int, model_type: str, sample: int = 0, symbols: Iterable[str] = ()
    ) -> Tokenizer:
        """sample > 0: train on that many sentences drawn at random from the stream (SentencePiece
        keeps only those in memory); 0 uses them all. `symbols`: pieces kept whole (user symbols,
        e.g. the target tags), numbered right after the special ones."""
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
                user_defined_symbols=list(symbols),
            )
        except RuntimeError as e:  # how SentencePiece reports bad settings, e.g. too large a vocabulary
            settings = f"data.vocab_size={vocab_size}, data.spm_model_type={model_type}"
            raise DataError(f"cannot train the tokenizer ({settings}): {str(e).splitlines()[0]}") from None
        return cls(stream.getvalue())

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        """The model saved at `path`, with its separate source model and its vocabulary if they
        are saved beside it."""
        source, vocabulary = source_path(Path(path)), vocabulary_path(Path(path))
        try:
            vocab = Vocabulary.from_dict(json.loads(vocabulary.read_text())) if vocabulary.is_file() else None
            return cls(Path(path).read_bytes(), source.read_bytes() if source.is_file() else None, vocab)
        except (DataError, ValueError) as e:
            raise DataError(f"{path}: {e}") from None

    def save(self, path: Path) -> None:
        """The (target or joint) model at `path`; a separate source model beside it, as
        spm.src.model for spm.model, and a vocabulary as spm.vocab.json (a tokenizer without
        them removes any such file left from an earlier run)."""
        Path(path).write_bytes(self.model_bytes)
        extras = (
            (source_path(Path(path)), self.source_bytes),
            (vocabulary_path(Path(path)), self.vocabulary and json.dumps(self.vocabulary.to_dict()).encode()),
        )
        for extra, data in extras:
            if data is None:
                extra.unlink(missing_ok=True)
            else:
                extra.write_bytes(data)

    def __len__(self) -> int:
        return self.sp.get_piece_size() if self.vocabulary is None else len(self.vocabulary.pieces)

    @functools.cached_property
    def target_tags(self) -> dict[str, int]:
        """{language: id} of the target-language tags a source may start with (<2en>, or an imported
        Marian model's >>fra<<); empty for a model that translates into one language. The tags are
        source tokens: with a separate source vocabulary, they are its pieces."""
        side = self.source
        pieces = side.vocabulary.pieces if side.vocabulary is not None else map(side.sp.id_to_piece, range(len(side)))
        tags = {}
        for i, piece in enumerate(pieces):
            for pattern in TAG_PATTERNS:
                if (match := pattern.match(piece)) is not None:
                    tags.setdefault(match.group(1), i)
        return tags

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.vocabulary is None:
            return self.sp.encode(texts, out_type=int)
        return [self.piece_ids(pieces) for pieces in self.sp.encode(texts, out_type=str)]

    def piece_ids(self, pieces: list[str]) -> list[int]:
        """The vocabulary's ids of SentencePiece's pieces."""
        return [self.ids.get(piece, self.unk_id) for piece in pieces]

    def nbest(self, texts: list[str], n: int) -> list[list[list[int]]]:
        """The n most likely segmentations of each text (unigram models), best first."""
        if self.vocabulary is None:
            return self.sp.nbest_encode(texts, nbest_size=n, out_type=int)
        return [[self.piece_ids(p) for p in best] for best in self.sp.nbest_encode(texts, nbest_size=n, out_type=str)]

    def piece_scores(self) -> np.ndarray:
        """Each piece's score: its log-probability in a unigram model (0 for a vocabulary's pieces
        that this side's SentencePiece model lacks)."""
        if self.vocabulary is None:
            return np.array([self.sp.get_score(i) for i in range(len(self))], dtype=np.float64)
        scores = np.zeros(len(self), dtype=np.float64)
        for i, piece in enumerate(self.vocabulary.pieces):
            j = self.sp.piece_to_id(piece)  # its unknown-piece id when it lacks the piece
            scores[i] = self.sp.get_score(j) if self.sp.id_to_piece(j) == piece else 0.0
        return scores

    def decode(self, ids: list[list[int]]) -> list[str]:
        if not ids:  # SentencePiece reads an empty list as one empty sentence
            return []
        if self.vocabulary is None:
            return self.sp.decode(ids)
        # A piece of the other side's model is left as it is by SentencePiece, word boundary mark included.
        texts = [self.sp.decode_pieces([self.vocabulary.pieces[i] for i in row]) for row in ids]
        return [text.replace("\u2581", " ").strip() for text in texts]

    def pieces(self, text: str) -> list[str]:
        return self.sp.encode(text, out_type=str)

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(i) if self.vocabulary is None else self.vocabulary.pieces[i]

    def piece_to_id(self, piece: str) -> int:
        return self.sp.piece_to_id(piece) if self.vocabulary is None else self.ids.get(piece, self.unk_id)


def vocabulary_path(path: Path) -> Path:
    """Where the vocabulary of the model saved at `path` goes: spm.model -> spm.vocab.json."""
    return path.with_name(f"{path.stem}.vocab.json")


def source_path(path: Path) -> Path:
    """Where the separate source model of the model saved at `path` goes: spm.model -> spm.src.model."""
    return path.with_name(f"{path.stem}.src{path.suffix}")
