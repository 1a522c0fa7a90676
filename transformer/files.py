"""Writing an output file without losing data: never over one of the command's inputs or over a
checkpoint, and never half-written (a temporary file beside it, fsynced, then renamed into place)."""

from __future__ import annotations

import os
import pickle
import secrets
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .errors import ConfigError, WriteError

# torch.save writes a zip archive whose first record is <name>/data.pkl; its legacy format starts
# with this pickled magic number.
ZIP_MAGIC = b"PK\x03\x04"
LEGACY_TORCH_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[:-1]


def check_output(path: str | Path, inputs: Iterable = (), key: str | None = "output") -> Path:
    """`path` as a Path if writing it loses nothing, else a ConfigError naming `key` and the path:
    an existing checkpoint, one of `inputs` (None entries are skipped; symlinks are followed),
    a directory, or a path whose directory does not exist."""
    path = Path(path)
    name = f"{key}={path}" if key else str(path)
    if path.is_dir():
        raise ConfigError(f"{name} is a directory; give a file path")
    parent = path.parent
    if not parent.is_dir():
        problem = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"{name}: the directory {parent} {problem}")
    if is_checkpoint(path):
        raise ConfigError(f"{name} is an existing checkpoint; choose another path")
    for other in inputs:
        if other is not None and same_file(path, Path(other)):
            raise ConfigError(f"{name} is one of the inputs ({other}); choose another path")
    return path


def same_file(a: Path, b: Path) -> bool:
    """True when a and b name the same file (after symlinks; hard links too, when both exist)."""
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def is_checkpoint(path: Path) -> bool:
    """True for a file torch.save wrote (judged by its content, whatever its name), even a damaged one."""
    if not path.is_file():  # reading a pipe or device to find out could block or consume it
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:  # missing or unreadable: nothing to protect that we could recognise
        return False
    if head.startswith(LEGACY_TORCH_MAGIC):
        return True
    if not head.startswith(ZIP_MAGIC):
        return False
    if b"data.pkl" in head:
        return True
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Report an OSError raised in the block as a WriteError naming `path`."""
    try:
        yield
    except WriteError:
        raise
    except OSError as e:
        raise WriteError(e.errno, e.strerror or str(e), str(path)) from None


@contextmanager
def atomic_open(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: a temporary file of its own in the same directory
    (.NAME.PID-RANDOM.tmp), fsynced and renamed over `path` (over a symlink's target) when the
    block ends; removed if it raises.
    A device or pipe (/dev/null, /dev/stdout) is written directly: it cannot be replaced."""
    if Path(path).exists() and not Path(path).is_file():
        with writing(path), open(path, "wb") as f:
            yield f
        return
    target = Path(os.path.realpath(path))
    # A name of its own ("x": made anew): two writers of `path` (processes, threads) never share one.
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with writing(path):
            with open(tmp, "xb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # left only when something failed


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path) as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """`text` as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_texts(directory: str | Path, texts: dict[str, str]) -> None:
    """{file name: text} written into `directory` (made if missing), each atomically."""
    if texts:
        Path(directory).mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        atomic_write_text(Path(directory) / name, text)
