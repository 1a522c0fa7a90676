"""train.py, killed (os._exit, as by SIGKILL: no cleanup, no flush) at one moment of a checkpoint write
or of a validation, for the crash-injection tests:

    python tests/crash_driver.py WHAT STEP PHASE [train.py overrides...]

WHAT: checkpoint_last.pt, checkpoint_best.pt, numbered (checkpoint_<STEP>.pt) or validation.
PHASE, for a file: before (nothing of it written), during (half of its temporary file written),
unrenamed (its temporary file complete, not yet renamed into place) or after (renamed into place).
For validation: during (after the validation's metrics are logged, before any file is written).
The process exits with 137 when it crashed as asked; a run that never reached the moment finishes.
"""

import io
import os
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer import checkpoint, training  # noqa: E402


def crash() -> None:
    sys.stdout.flush()
    os._exit(137)


def inject(what: str, step: int, phase: str) -> None:
    if what == "validation":
        original_validate = training.Trainer.validate

        def validate(self):
            value = original_validate(self)
            if self.state.step == step:
                crash()
            return value

        training.Trainer.validate = validate
        return
    original_write = checkpoint.write
    name = f"checkpoint_{step}.pt" if what == "numbered" else what

    def write(path, payload):
        path = Path(path)
        if path.name != name or payload.get("step") != step:
            return original_write(path, payload)
        if phase == "before":
            crash()
        if phase in ("during", "unrenamed"):
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            data = buffer.getvalue()
            path.with_name(f".{path.name}.tmp").write_bytes(data if phase == "unrenamed" else data[: len(data) // 2])
            crash()
        original_write(path, payload)
        crash()

    checkpoint.write = write


if __name__ == "__main__":
    what, step, phase, *overrides = sys.argv[1:]
    inject(what, int(step), phase)
    sys.argv = [str(ROOT / "train.py"), *overrides]
    os.chdir(ROOT)
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
