"""The ISA matrix (`make test-isa`, run by CI after `make test`): the tests marked `isa` (a fast
path against its reference, the decoding equalities, the kernels each CPU-dependent fast path
runs) again with the libraries kept to lower instruction sets, as on CPUs other than this one,
through their own switches (ISA_LIMITS in transformer/devices.py): oneDNN's ONEDNN_MAX_CPU_ISA,
ATen's ATEN_CPU_CAPABILITY, MKL's MKL_ENABLE_INSTRUCTIONS, FBGEMM's FBGEMM_ENABLE_INSTRUCTIONS and
CTranslate2's CT2_FORCE_CPU_ISA. A limit above what the CPU has changes nothing (the kernels listed
show it). Each setting must prove its limits took effect, library by library (PROOFS): what each one
ran, as the library itself reports it, is at most the setting's limit (tests/test_kernels.py for
oneDNN's kernels, tests/test_isa_limits.py for the others). The proofs compare with the setting's
limits (ISA_MATRIX_SETTING names it to the tests' process), not with the variables they find, so a
variable lost on the way fails its proof. A setting fails when a proof fails or its line is missing;
a library that reports no instruction set here (MKL on a CPU not made by Intel) gets a line saying
"not proven", printed as such, never counted as a proof. Prints each setting's result, time, proofs
and kernels; exits 1 if any setting failed.

    python -m tests.isa_matrix                       # every setting
    python -m tests.isa_matrix settings=avx2 -- -x   # one setting; arguments after -- go to pytest
    python -m tests.isa_matrix settings=avx2 tests=all   # the whole suite, not only the isa tests
    python -m tests.isa_matrix settings=avx2 tests=kernels   # the whole suite but the tests marked isa_free
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from transformer.devices import ISA_LIMITS

ROOT = Path(__file__).resolve().parents[1]

# The settings, in the order they run: ISA_LIMITS's keys, and what CPU each stands for.
SETTINGS = {
    "avx512_core_bf16": "AVX-512 with VNNI and BF16, no AMX, as an AMD Zen 4 or 5",
    "avx512_core": "AVX-512 without VNNI or BF16, as a Skylake-class Xeon",
    "avx2": "AVX2 only, as an AMD Zen 3 or most laptops",
}


# The lines a setting's report must hold, one a library, each saying what the library ran and the limit
# it was held to (tests/test_kernels.py, tests/test_isa_limits.py). A line holding NOT_PROVEN says
# why the library's limit could not be shown on this CPU.
PROOFS = ("oneDNN: ", "ATen: ", "MKL: ", "FBGEMM: ", "CTranslate2: ")
NOT_PROVEN = "not proven"

# The variable naming the setting to the tests' process (set by run_setting).
SETTING_VARIABLE = "ISA_MATRIX_SETTING"


def expected_limit(variable: str) -> str | None:
    """The limit `variable` must hold this process to: the ISA matrix setting's, wherever
    SETTING_VARIABLE names one (None if the setting leaves that library alone), else the
    variable's own value (a limit set by hand or by the benchmarks' isa= option)."""
    setting = os.environ.get(SETTING_VARIABLE)
    if setting:
        return ISA_LIMITS[setting].get(variable)
    return os.environ.get(variable) or None


# tests= -> (the tests' marker expression, what it chooses): the isa tests, every test that runs a
# kernel (all but those marked isa_free, which assert only what no limit changes), or the whole suite.
TESTS = {
    "isa": (["-m", "isa"], "the isa tests"),
    "kernels": (["-m", "not isa_free"], "every test but the isa_free ones"),
    "all": ([], "every test"),
}


def run_setting(name: str, pytest_args: list[str], tests: str = "isa") -> tuple[bool, float, list[str], str]:
    """(passed, seconds, kernel lines, pytest's last line) of the tests chosen by `tests` (TESTS)
    under one setting."""
    limits = ISA_LIMITS[name]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        command = [sys.executable, "-m", "pytest", *TESTS[tests][0], "-p", "no:cacheprovider", f"--junitxml={report}", *pytest_args]  # fmt: skip
        start = time.monotonic()
        env = {**os.environ, **limits, SETTING_VARIABLE: name}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - start
        kernels = []
        if report.exists():
            kernels = [p.get("value") for p in ET.parse(report).iter("property") if p.get("name") == "kernels"]
    output = done.stdout.strip().splitlines()
    if done.returncode != 0:
        print(done.stdout[-20000:], done.stderr[-5000:], sep="\n", file=sys.stderr)
    missing = [p.strip(": ") for p in PROOFS if not any(k.startswith(p) for k in kernels)]
    if missing and done.returncode == 0:
        print(f"{name}: no proof that the limits took effect for {', '.join(missing)} (tests/test_kernels.py or tests/test_isa_limits.py did not run?)", file=sys.stderr)  # fmt: skip
    return done.returncode == 0 and not missing, seconds, sorted(kernels), output[-1] if output else ""


def main(argv: list[str]) -> int:
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    options = dict(a.split("=", 1) for a in (argv[: argv.index("--")] if "--" in argv else argv))
    if set(options) - {"settings", "tests"}:
        print(f"error: {sorted(set(options) - {'settings', 'tests'})[0]}= unknown; the options are settings= and tests=", file=sys.stderr)  # fmt: skip
        return 2
    names = options.get("settings", ",".join(SETTINGS)).split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        print(f"error: settings={','.join(unknown)} unknown; choose from {','.join(SETTINGS)}", file=sys.stderr)
        return 2
    tests = options.get("tests", "isa")
    if tests not in TESTS:
        print(f"error: tests={tests} unknown; choose from {','.join(TESTS)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        what, limits = SETTINGS[name], ISA_LIMITS[name]
        passed, seconds, kernels, summary = run_setting(name, pytest_args, tests)
        print(f"== {name} ({what}), {TESTS[tests][1]}: {' '.join(f'{k}={v}' for k, v in limits.items())}")
        print(f"   {'passed' if passed else 'FAILED'} in {seconds:.0f} s: {summary}")
        for line in sorted(kernels, key=lambda k: not k.startswith(PROOFS)):  # the proofs first
            proof = line.startswith(PROOFS)
            print(f"   {('NOT PROVEN' if NOT_PROVEN in line else 'proof') if proof else 'kernels'}: {line}")
        sys.stdout.flush()
        if not passed:
            failed.append(name)
    if failed:
        print(f"ISA matrix failed under: {', '.join(failed)}")
        return 1
    print(f"ISA matrix passed under: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
