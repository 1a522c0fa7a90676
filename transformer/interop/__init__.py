"""Models in and out of other formats: CTranslate2 export (export.py), Hugging Face MarianMT import
(marian.py) and multi-head to grouped-query attention conversion (gqa.py).

Used by the user tools in scripts/ (export_ctranslate2.py, import_marian.py, convert_to_gqa.py) and
by the benchmarks; the core (training, decoding, serving) never imports it.
"""
