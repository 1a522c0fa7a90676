"""A readable encoder-decoder Transformer for machine translation (Vaswani et al., 2017).

Modules, in reading order: model (the network), data, tokenizer and batching (corpora to batches),
training (the loop), decoding (greedy search over an incremental decoder state),
evaluation (sacreBLEU), checkpoint (self-contained files), config (the typed run config).
"""

from .openmp import set_default as _set_openmp_spin

_set_openmp_spin()  # before any module here imports torch (see openmp.py)
