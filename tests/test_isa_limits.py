"""Each instruction-set limit of the ISA matrix (tests/isa_matrix.py, ISA_LIMITS in
transformer/devices.py) takes effect: ATen runs the capability ATEN_CPU_CAPABILITY names,
CTranslate2 the ISA CT2_FORCE_CPU_ISA names, and FBGEMM's int8 product saturates as products without
VNNI do where FBGEMM_ENABLE_INSTRUCTIONS names such a set. (oneDNN's kernels are checked against
ONEDNN_MAX_CPU_ISA wherever tests/test_kernels.py reads them.) Without a limit the tests record
what runs. A library that ignored its variable would otherwise pass the matrix on native kernels."""

import os
import re
import subprocess
import sys

import pytest
import torch

from transformer.devices import cpu_flags
from transformer.fast.int8 import NARROW_WEIGHTS, exact_weight_levels, kernel_available

from .briefly_trained import multi30k_corpus, trained_model

pytestmark = pytest.mark.isa


def test_aten_runs_the_capability_it_is_limited_to(record_property):
    capability = torch.backends.cpu.get_cpu_capability()
    limit = os.environ.get("ATEN_CPU_CAPABILITY")
    record_property("kernels", f"ATen: {capability} (ATEN_CPU_CAPABILITY={limit or 'unset'})")
    if limit:
        assert capability == limit.upper(), f"ATEN_CPU_CAPABILITY={limit} took no effect: ATen runs {capability}"


# Limits whose int8 products have no VNNI: pairs of u8 x s8 products are summed in 16 bits, which
# saturates with full-range weights on every CPU. FBGEMM's, and oneDNN's that the ISA matrix pairs
# with FBGEMM's (FBGEMM must be kept to the CPU the setting stands for, as oneDNN is).
FBGEMM_WITHOUT_VNNI = ("AVX2", "AVX512", "AVX512_256")
ONEDNN_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX512_CORE")


def test_fbgemm_runs_the_instructions_it_is_limited_to(record_property):
    """FBGEMM says nothing of its kernels, but they show in its products: where the limits name a
    set without VNNI, full-range int8 weights saturate (the start-up check narrows them), whatever
    the CPU has. A limit FBGEMM ignored, or an ISA setting without FBGEMM's limit, would give exact
    full-range products on a VNNI CPU."""
    if not kernel_available("fbgemm"):
        record_property("kernels", "FBGEMM: none in this torch")
        return
    levels = exact_weight_levels("fbgemm")
    limit, onednn = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", ""), os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    record_property("kernels", f"FBGEMM: int8 weights exact up to {levels} (FBGEMM_ENABLE_INSTRUCTIONS={limit or 'unset'})")  # fmt: skip
    if limit.upper() in FBGEMM_WITHOUT_VNNI or onednn.upper() in ONEDNN_WITHOUT_VNNI:
        assert levels == NARROW_WEIGHTS, f"FBGEMM_ENABLE_INSTRUCTIONS={limit or 'unset'} (ONEDNN_MAX_CPU_ISA={onednn or 'unset'}): full-range products exact, so FBGEMM ran VNNI"  # fmt: skip


def test_ctranslate2_runs_the_isa_it_is_limited_to(tmp_path, record_property):
    pytest.importorskip("ctranslate2")
    from transformer.interop.export import export

    model, tokenizer = trained_model(multi30k_corpus(), {}, steps=0)
    export(model, tokenizer, tmp_path / "ct2", "float32")
    code = f"import ctranslate2; ctranslate2.Translator({str(tmp_path / 'ct2')!r}, device='cpu')"
    env = {**os.environ, "CT2_VERBOSE": "1"}
    log = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stderr
    selected = re.search(r"Selected ISA: (\w+)", log)
    assert selected, f"CTranslate2 did not say which ISA it selected: {log[-500:]}"
    limit = os.environ.get("CT2_FORCE_CPU_ISA")
    record_property("kernels", f"CTranslate2: {selected[1]} (CT2_FORCE_CPU_ISA={limit or 'unset'})")
    if limit:
        assert selected[1] == limit, f"CT2_FORCE_CPU_ISA={limit} took no effect: CTranslate2 selected {selected[1]}"
    if not limit and "avx512f" not in cpu_flags():
        assert selected[1] != "AVX512"
