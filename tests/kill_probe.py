"""Kill a training run with SIGKILL at random moments, resuming after each, and compare how it ends
with an uninterrupted run of the same command (weights, best and numbered checkpoints, metrics.jsonl
line for line, timing fields aside). Half of the kills land at a random moment, half a few
milliseconds after a validation is logged, while its checkpoints are being written.

    python -m tests.kill_probe kills=10 seed=0 out=/tmp/probe experiment=smoke trainer.max_steps=300 ...

Prints one line per kill and the verdict; exits 1 when the runs differ, and when no kill landed (the
run ended before the first one: nothing was tested). Too slow for the test suite.
"""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conftest import ROOT
from .test_crash_recovery import assert_same, outcome


def command(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-u", "train.py", *overrides, f"hydra.run.dir={run_dir}"]


def killed_once(run_dir: Path, overrides: list[str], delay: float | None, rng: random.Random) -> str | None:
    """Start (or resume) the run and kill it `delay` seconds later, or with delay=None just after its
    next validation line. Returns the last line it printed, or None when it finished first."""
    log = run_dir.with_name("attempt.log")
    with open(log, "w") as stdout:
        proc = subprocess.Popen(command(run_dir, overrides), cwd=ROOT, stdout=stdout, stderr=subprocess.DEVNULL)
    try:
        if delay is not None:
            proc.wait(timeout=delay)
            return None
        while proc.poll() is None:
            if "validation step" in log.read_text():
                time.sleep(rng.uniform(0.0, 0.05))
                break
            time.sleep(0.005)
        if proc.poll() is not None:
            return None
    except subprocess.TimeoutExpired:
        pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lines = log.read_text().strip().splitlines()
    return lines[-1] if lines else ""


def main(argv: list[str]) -> int:
    options = dict(a.split("=", 1) for a in argv if a.split("=", 1)[0] in ("kills", "seed", "out"))
    overrides = [a for a in argv if a.split("=", 1)[0] not in options]
    kills, rng, out = int(options.get("kills", 10)), random.Random(int(options.get("seed", 0))), Path(options["out"])
    if kills < 1:
        print(f"kills={kills} must be >= 1")
        return 2
    started = time.monotonic()
    subprocess.run(command(out / "uninterrupted", overrides), cwd=ROOT, check=True, capture_output=True)
    seconds = time.monotonic() - started
    print(f"uninterrupted run: {seconds:.0f}s")
    run_dir, done = out / "killed", 0
    run_dir.mkdir(parents=True)
    while done < kills:
        delay = rng.uniform(5.0, max(6.0, 2 * seconds / kills)) if done % 2 == 0 else None
        last = killed_once(run_dir, overrides, delay, rng)
        if last is None:
            break
        done += 1
        when = f"at {delay:.1f}s" if delay else "after a validation"
        print(f"kill {done}: {when}, last line: {last[:100]}")
    if done == 0:
        print(f"NO KILL LANDED: the run ended before the first kill (it takes {seconds:.0f}s; the first kill "
              "comes 5 s or more after its start), so nothing was tested; give it a longer run (trainer.max_steps)")  # fmt: skip
        return 1
    result = subprocess.run(command(run_dir, overrides), cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr[-2000:])
        return 1
    try:
        assert_same(outcome(run_dir), outcome(out / "uninterrupted"))
    except AssertionError as e:
        print(f"DIFFERENT after {done} kills: {e}")
        return 1
    fewer = f" (of {kills}: the run ended before the rest)" if done < kills else ""
    print(f"identical after {done} kills{fewer}: weights, best and numbered checkpoints, metrics.jsonl line for line")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
