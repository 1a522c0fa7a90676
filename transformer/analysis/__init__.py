"""Looking inside a trained model: each attention head's confidence and importance, pruning
(heads.py), and their heatmaps (plotting.py).

Used by scripts/analyze_heads.py; the core (training, decoding, serving) never imports it. The
attention images the trainer writes to TensorBoard are core: transformer/plotting.py.
"""
