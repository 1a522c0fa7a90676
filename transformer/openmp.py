"""How long idle OpenMP threads spin before they sleep: set before torch loads its OpenMP runtime.

torch's Linux wheels run their parallel loops on GNU OpenMP (libgomp). A thread that finishes its
share of a loop waits for the others, spinning for GOMP_SPINCOUNT rounds (300,000 by libgomp's
default) before it sleeps. torch starts one thread per core, so when any other process keeps a core
busy (a browser, an editor's indexer, a second run), a descheduled thread's partners spin on the
cores it needs, and every loop waits for it: training on a 2-core machine then runs several times
slower, not the two times that losing a core would explain (docs/PERFORMANCE.md). A short spin
(SPIN_COUNT) gives the core back soon and costs little on an idle machine.

`set_default` sets GOMP_SPINCOUNT to SPIN_COUNT unless the environment already chooses the spin or
the wait policy (GOMP_SPINCOUNT, OMP_WAIT_POLICY). It only has an effect before torch is first
imported, so the package's `__init__` calls it: every entry point imports this package before torch.
Other OpenMP runtimes (LLVM's, Intel's) read other variables and are left as they are.
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"
CHOICES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # either one, set by the user, is kept as it is
applied = False  # whether set_default set GOMP_SPINCOUNT in this process's environment


def set_default(environ=None) -> bool:
    """Set GOMP_SPINCOUNT=SPIN_COUNT in `environ` (this process's by default) unless it sets one
    of CHOICES; True if it did."""
    global applied
    target = os.environ if environ is None else environ
    if any(name in target for name in CHOICES):
        return False
    target["GOMP_SPINCOUNT"] = SPIN_COUNT
    applied = applied or environ is None
    return True


def without_default(environ: dict) -> dict:
    """A copy of `environ` without the GOMP_SPINCOUNT that set_default put in this process's
    environment, for a child process that should run with libgomp's own default; a user's own
    setting stays."""
    out = dict(environ)
    if applied and out.get("GOMP_SPINCOUNT") == SPIN_COUNT:
        del out["GOMP_SPINCOUNT"]
    return out
