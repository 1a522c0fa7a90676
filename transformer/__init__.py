"""A readable encoder-decoder Transformer for machine translation (Vaswani et al., 2017).

Modules, in reading order: model (the network), data and tokenizer (corpora to batches),
training (the loop), decoding (greedy search over an incremental decoder state),
evaluation (sacreBLEU), checkpoint (self-contained files), config (the typed run config).
"""
