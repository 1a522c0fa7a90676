"""Data: parallel corpora and their splits (corpus.py), the tokenizer (tokenizer.py), token ids in
batches (batching.py) and the directions' shares of many-to-many training (sampling.py)."""

from .corpus import (
    DataConfig,
    DataError,
    clean_training_pairs,
    corpus_file,
    has_corpus_file,
    line_chunks,
    load_split,
    primary_rows,
    read_lines,
    read_parallel,
    training_text,
    write_lines,
)

__all__ = [
    "DataConfig",
    "DataError",
    "clean_training_pairs",
    "corpus_file",
    "has_corpus_file",
    "line_chunks",
    "load_split",
    "primary_rows",
    "read_lines",
    "read_parallel",
    "training_text",
    "write_lines",
]
