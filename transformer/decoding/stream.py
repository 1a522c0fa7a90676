"""Translating a stream with continuous batching (translate.py scheduler=continuous): each input
line joins the running batch of the step-level engine (engine.py) at the next decoding step, as
soon as it has been read, and its translation is written as soon as it and every line before it
have ended. A line typed into a pipe or terminal starts at once instead of waiting for a chunk to
fill, and a long line does not hold back the lines decoded beside it (only their writing, which
keeps the input's order).

A reader thread reads ahead into a bounded queue, so decoding never waits for input while it has
work, and reading stops when `ahead` lines are waiting: memory stays bounded whatever the input's
length, as with translate.py's chunks. All torch work stays on the calling thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

from .config import DecodeConfig
from .engine import Engine, Sentence
from .search import Hypothesis
from .strategies import empty_n_best

_END = object()  # the reader's last item


class LineReader(threading.Thread):
    """Puts the lines of `lines` into a queue of at most `ahead` items, then _END; an exception
    raised while reading (a line that is not UTF-8, a file that cannot be read) goes into the
    queue in its place, to be raised on the decoding thread."""

    def __init__(self, lines: Iterable[str], ahead: int):
        super().__init__(name="line-reader", daemon=True)
        self.lines, self.queue = lines, queue.Queue(maxsize=ahead)

    def run(self) -> None:
        try:
            for line in self.lines:
                self.queue.put(line)
            self.queue.put(_END)
        except BaseException as e:  # handed to the decoding thread, which raises it
            self.queue.put(e)


def translate_stream(
    engine: Engine,
    lines: Iterable[str],
    encode: Callable[[str, int], list[int]],
    write: Callable[[int, list[Hypothesis]], None],
    settings: DecodeConfig,
    eos_id: int,
    ahead: int = 256,
) -> int:
    """Translate each line of `lines` on `engine`; `encode(text, index)` gives a line's source ids
    (without EOS; index counts from 0), `write(index, n_best)` is called in input order (an empty
    line's n-best list holds empty hypotheses). Returns the number of lines."""
    reader = LineReader(lines, ahead)
    reader.start()
    ended: dict[int, list[Hypothesis]] = {}
    read = written = 0
    at_end = False

    def done_callback(index: int) -> Callable[[list[Hypothesis]], None]:
        return lambda n_best: ended.__setitem__(index, n_best)

    while not at_end or engine.busy:
        # New lines: an idle engine waits for the next one; a busy one takes what has arrived.
        while not at_end and len(engine.waiting) < ahead:
            try:
                item = reader.queue.get(block=not engine.busy)
            except queue.Empty:
                break
            if item is _END:
                at_end = True
            elif isinstance(item, BaseException):
                raise item
            else:
                ids = encode(item, read)
                if ids:
                    engine.add(Sentence(ids + [eos_id], settings, done_callback(read)))
                else:
                    ended[read] = empty_n_best(settings)
                read += 1
            if not engine.busy:
                break  # an empty line (or the end) with nothing running: write what is ready first
        if engine.busy:
            engine.step(settings.max_tokens)
        while written in ended:
            write(written, ended.pop(written))
            written += 1
    return read
