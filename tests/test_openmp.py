"""The OpenMP spin default (transformer/openmp.py): set unless the user chose, and set by every
entry point before torch loads its OpenMP runtime."""

import os
import re
import subprocess
import sys

import pytest

from transformer import openmp

from .conftest import ROOT

pytestmark = pytest.mark.isa_free  # no kernel an instruction-set limit changes: `make test-avx2` leaves it out


def test_the_spin_count_is_set_only_where_the_user_chose_neither_variable():
    environ = {}
    assert openmp.set_default(environ) and environ == {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        environ = dict(chosen)
        assert not openmp.set_default(environ) and environ == chosen


def test_a_child_can_get_libgomps_own_default_back_but_never_loses_a_users_setting(monkeypatch):
    monkeypatch.setattr(openmp, "applied", True)
    assert "GOMP_SPINCOUNT" not in openmp.without_default({"GOMP_SPINCOUNT": openmp.SPIN_COUNT, "A": "1"})
    assert openmp.without_default({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}
    monkeypatch.setattr(openmp, "applied", False)  # the user set the same value: it stays
    assert openmp.without_default({"GOMP_SPINCOUNT": openmp.SPIN_COUNT}) == {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}


@pytest.mark.e2e
@pytest.mark.parametrize("entry_point", ["train.py", "translate.py", "evaluate.py", "serve.py"])
def test_entry_points_set_the_spin_count_before_torch_is_imported(entry_point):
    env = {k: v for k, v in os.environ.items() if k not in openmp.CHOICES}
    result = subprocess.run(
        [sys.executable, "-X", "importtime", entry_point, "--help"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    # -X importtime writes one line per module as its import ends, a package after its submodules
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", result.stderr, re.MULTILINE)
    first_torch = next(i for i, name in enumerate(names) if name == "torch" or name.startswith("torch."))
    assert names.index("transformer.openmp") < first_torch
