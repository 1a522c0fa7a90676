"""Continuous batching: a decoding loop that works one step at a time over every sentence being
translated, whatever its request, its length or how far along it is.

A sentence joins at the next step after its encoder pass; one that ends leaves at once, and its
n-best list goes back then. Each step runs the decoder once over the rows of every sentence (one
row per sentence for greedy search, one per beam for beam search) on the paged key/value cache
of fast/paged.py. The search of each sentence follows decoding/search.py (greedy) and
decoding/beam.py (beam), step by step, with the same functions where they apply, so a sentence
gets the translation translate.py gives it.

Memory: a sentence takes blocks as it grows. It joins when the free blocks hold its encoder keys
and values and its first tokens; when a step finds too few free blocks for every row's next token,
the sentences that joined last give theirs back and start again later (preemption by
recomputation), so a full pool makes sentences wait and never fails one. `Engine.step` is not thread-safe: one thread drives it
(serve.py's, serving/continuous.py; translate.py's, stream.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data.batching import pad
from ..devices import autocast_dtype
from ..fast import paged
from ..fast.cache import cross_dtype
from ..fast.paged import BlockPool, PagedMemory, PagedState
from ..model import padding_mask
from .beam import best_extensions, survivors
from .config import DecodeConfig
from .processors import length_penalty, log_probs, max_lengths, sentence_done
from .search import Hypothesis, argmax, strip_special

JOIN_STEPS = 3  # the most steps a waiting sentence waits for others to join with it, while a batch runs
JOIN_TOKENS = 256  # or until the waiting sentences hold this many source tokens


class AdmissionFailed(RuntimeError):
    """Sentences could not join the batch (their encoder pass raised `error`): they have left the
    engine and hold no blocks; the running batch is untouched and the engine goes on."""

    def __init__(self, sentences: list[Sentence], error: Exception):
        super().__init__(f"{len(sentences)} sentences could not join the batch: {type(error).__name__}: {error}")
        self.sentences, self.error = sentences, error


@dataclass
class Row:
    """One sequence of the decoding batch: a greedy sentence, or one beam."""

    table: list[int]  # its blocks in the pool
    tokens: list[int]  # generated so far, without BOS
    score: float = 0.0  # log-probability


@dataclass
class Sentence:
    """One source sentence being translated, and where its answer goes."""

    ids: list[int]  # source token ids, EOS included
    settings: DecodeConfig
    done: Callable[[list[Hypothesis]], None]  # called with its n-best list when it ends
    cancelled: Callable[[], bool] = lambda: False
    request: object = None  # the caller's, for its own bookkeeping
    arrived: int = 0  # the engine's step count when it was added
    serial: int = 0  # the engine's number for it, unique while the engine runs
    max_len: int = 0
    cross: list[int] = field(default_factory=list)  # the blocks of its encoder keys and values
    rows: list[Row] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    step: int = 0
    preempted: int = 0  # times it gave its blocks back to make room, and started again later

    @property
    def beam(self) -> bool:
        return self.settings.strategy == "beam"

    @property
    def width(self) -> int:
        return self.settings.beam_size if self.beam else 1


class Engine:
    """The running batch, the sentences waiting to join it and the pool they share."""

    def __init__(self, model, tokenizer, decode: DecodeConfig, device, pool_bytes: int, block_size: int = 16, precision: str = "fp32"):  # fmt: skip
        reason = paged.supports(model) or unsupported_settings(decode)
        if reason:
            raise ValueError(reason)
        self.model, self.tokenizer, self.device, self.settings = model, tokenizer, torch.device(device), decode
        self.amp = autocast_dtype(precision, self.device)  # the model's precision (runtime.precision)
        layers, kv_heads, head_size = paged.pool_shape(model)
        dtype = next(model.parameters()).dtype
        per_block = BlockPool.bytes_per_block(block_size, layers, kv_heads, head_size, dtype)
        n_blocks = max(pool_bytes // per_block, 1)
        self.pool = BlockPool(n_blocks, block_size, layers, kv_heads, head_size, dtype, self.device)
        # The dtype cross-attention reads the encoder's keys and values in: the step's, or fp32
        # under bf16 on a CPU with runtime.fp32_cross, as the model's own caches keep them.
        self.cross_dtype = cross_dtype(getattr(model, "fp32_cross", False), self.amp or dtype, self.device)
        self.memory: tuple[tuple, PagedMemory | None] = ((), None)  # the running sentences' (serials, memory)
        self.waiting: list[Sentence] = []
        self.running: list[Sentence] = []
        self.limit = model.cfg.max_positions - 1
        self.steps = self.added = self.preemptions = self.most_running = 0

    def need(self, sentence: Sentence) -> int:
        """Blocks a sentence may hold at most at once: its encoder keys and values, and every row
        at its longest (the pool must hold this much for the sentence to run alone)."""
        return self.pool.blocks_for(len(sentence.ids)) + sentence.width * self.pool.blocks_for(sentence.max_len)

    def mib(self, blocks: int) -> float:
        """The memory `blocks` blocks of the pool take, in MiB."""
        return blocks * (self.pool.keys.nbytes + self.pool.values.nbytes) / self.pool.n_blocks / 2**20

    def most_needed(self, source_tokens: int, beam_size: int) -> int:
        """Blocks one sentence of `source_tokens` tokens (EOS included) can need at `beam_size`."""
        settings = dataclasses.replace(self.settings, beam_size=beam_size, n_best=1)
        probe = Sentence([self.model.cfg.pad_id + 1] * source_tokens, settings, lambda n_best: None)
        probe.max_len = self.length_limit(source_tokens, settings)
        return self.need(probe)

    def pool_too_small(self, source_tokens: int, beam_size: int, beam_key: str, pool_key: str, pool_mib: float) -> str | None:  # fmt: skip
        """None when the pool holds one sentence of `source_tokens` tokens (EOS included) at
        `beam_size`; otherwise why not, in the words of the settings that size them."""
        need = self.most_needed(source_tokens, beam_size)
        if need <= self.pool.n_blocks:
            return None
        return (
            f"{pool_key}={pool_mib:g} holds {self.pool.n_blocks} blocks of {self.pool.block_size} positions, but one "
            f"sentence of {source_tokens} tokens at {beam_key}={beam_size} can need {need}: "
            f"raise {pool_key} to {math.ceil(self.mib(need) * 10) / 10:g} or more"
        )

    def length_limit(self, source_tokens: int, settings: DecodeConfig) -> int:
        """processors.max_lengths for one source of `source_tokens` tokens (EOS included)."""
        return int(max_lengths(torch.tensor([source_tokens]), settings, self.limit)[0])

    def add(self, sentence: Sentence) -> None:
        """Queue a sentence; ValueError when it could not fit in the pool even alone."""
        sentence.max_len = self.length_limit(len(sentence.ids), sentence.settings)
        need = self.need(sentence)
        if need > self.pool.n_blocks:
            raise ValueError(
                f"a sentence of {len(sentence.ids)} tokens needs {need} blocks at beam size "
                f"{sentence.width}; the pool has {self.pool.n_blocks} (raise scheduler.pool_mib)"
            )
        sentence.arrived = self.steps
        self.added += 1
        sentence.serial = self.added
        self.waiting.append(sentence)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self, join_tokens: int) -> int:
        """Admit the waiting sentences that fit (at most join_tokens source tokens), then run
        one decoding step over the whole batch. Returns the number of sentences it ran; raises
        AdmissionFailed, without running the step, when the joining sentences' encoder pass fails."""
        self.drop_cancelled()
        with torch.no_grad(), torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
            if self.joining_pays():
                self.admit(join_tokens)
            if not self.running:
                return 0
            logits = self.decode()
            self.search(logits)
        self.steps += 1
        return len(self.running)

    # --- Joining and leaving -------------------------------------------------------------------

    def joining_pays(self) -> bool:
        """Whether the waiting sentences join at this step. One encoder pass over a few sentences
        uses the CPU poorly, so while a batch runs they gather for up to JOIN_STEPS steps (or
        until they hold JOIN_TOKENS source tokens); an idle engine takes them at once."""
        if not self.waiting:
            return False
        if not self.running or self.steps - self.waiting[0].arrived >= JOIN_STEPS:
            return True
        return sum(len(s.ids) for s in self.waiting) >= JOIN_TOKENS

    def admit(self, join_tokens: int) -> None:
        """The waiting sentences that fit join, in order: at most join_tokens source tokens, and
        while the free blocks hold their encoder keys and values and first tokens and leave the
        running rows room for their next token. Blocks are taken as sentences grow, not reserved
        for their longest: when a step finds the pool dry, `make_room` preempts."""
        joining, tokens = [], 0
        headroom = sum(len(s.rows) for s in self.running)  # each running row may take a block next step
        while self.waiting:
            sentence = self.waiting[0]
            if joining and tokens + len(sentence.ids) > join_tokens:
                break
            takes = self.pool.blocks_for(len(sentence.ids)) + self.first_rows(sentence)
            if takes + headroom > len(self.pool.free):
                break  # the pool is full: wait for running sentences to end
            headroom += takes
            joining.append(self.waiting.pop(0))
            tokens += len(sentence.ids)
        if not joining:
            return
        try:
            self.encode(joining)
        except Exception as e:  # the batch runs on; these sentences give their blocks back and fail
            for sentence in joining:
                self.leave(sentence)
            raise AdmissionFailed(joining, e) from e
        self.running.extend(joining)
        self.most_running = max(self.most_running, len(self.running))

    def first_rows(self, sentence: Sentence) -> int:
        """The rows a sentence starts with: as in beam.py, one expands at the first step, unless
        the vocabulary is too small to give 2k candidates from one."""
        return 1 if not sentence.beam or self.model.cfg.vocab_size >= 2 * sentence.width else sentence.width

    def make_room(self) -> None:
        """Before a step: when the free blocks cannot take every row's next token, the sentences
        that joined last give their blocks back and wait at the front of the queue, to start
        again from their source when there is room (preemption by recomputation; their
        translations are the same). The first running sentence always fits: `add` checked it."""
        if sum(len(s.rows) for s in self.running) <= len(self.pool.free):
            return  # a row takes at most one block a step
        while len(self.running) > 1:
            takes = sum(self.pool.takes(row.table, len(row.tokens)) for s in self.running for row in s.rows)
            if takes <= len(self.pool.free):
                return
            victim = max(self.running, key=lambda s: s.serial)
            self.leave(victim)
            self.running.remove(victim)
            victim.finished, victim.step, victim.arrived = [], 0, self.steps - JOIN_STEPS  # rejoins at once
            victim.preempted += 1
            self.preemptions += 1
            self.waiting.insert(0, victim)

    def encode(self, joining: list[Sentence]) -> None:
        """The joining sentences' encoder pass, their cross-attention keys and values in the pool
        and their first rows."""
        self.memory = ((), None)  # a sentence that starts again keeps its serial but not its blocks
        src = pad([s.ids for s in joining], self.model.cfg.pad_id).to(self.device)
        memory, _ = self.model.encode(src, padding_mask(src, self.model.cfg.pad_id))
        for sentence in joining:
            for _ in range(self.pool.blocks_for(len(sentence.ids))):  # one by one: `leave` returns what was taken
                sentence.cross.append(self.pool.allocate())
            sentence.rows = [Row([], [], 0.0 if i == 0 else -math.inf) for i in range(self.first_rows(sentence))]
        paged.store_memory(self.model, self.pool, memory, [len(s.ids) for s in joining], [s.cross for s in joining])

    def leave(self, sentence: Sentence) -> None:
        """Return a sentence's blocks to the pool."""
        for row in sentence.rows:
            self.pool.release(row.table)
        self.pool.release(sentence.cross)
        sentence.rows, sentence.cross = [], []

    def drop_cancelled(self) -> None:
        for sentence in [s for s in self.running if s.cancelled()]:
            self.leave(sentence)
            self.running.remove(sentence)
        self.waiting = [s for s in self.waiting if not s.cancelled()]

    def end(self, sentence: Sentence, n_best: list[Hypothesis]) -> None:
        self.leave(sentence)
        self.running.remove(sentence)
        sentence.done(n_best)

    # --- The decoder step ----------------------------------------------------------------------

    def decode(self) -> torch.Tensor:
        """Logits (rows, vocab) for every row of the running sentences, in order: the model's own
        decoder on a PagedState, each row at its own position."""
        self.make_room()
        rows = [row for s in self.running for row in s.rows]
        positions = [len(row.tokens) for row in rows]
        write = [self.pool.writable(row.table, p)[0] for row, p in zip(rows, positions)]
        width = max(len(s.rows) for s in self.running)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        state = PagedState(
            self.pool,
            positions=as_tensor(positions),
            write_slots=as_tensor(write),
            self_slots=self.pool.slots([row.table for row in rows], max(positions) + 1),
            self_lengths=as_tensor([p + 1 for p in positions]),
            memory=self.running_memory(),
            fold=as_tensor([i * width + j for i, s in enumerate(self.running) for j in range(len(s.rows))]),
            width=width,
        )
        bos = self.tokenizer.bos_id
        tokens = as_tensor([row.tokens[-1] if row.tokens else bos for row in rows])[:, None]
        logits, _ = self.model.decode(tokens, None, state.memory.mask, state)
        return logits[:, 0]

    def running_memory(self) -> PagedMemory:
        """The running sentences' encoder keys and values, read from the pool again only when the
        sentences have changed."""
        serials = tuple(s.serial for s in self.running)
        if self.memory[0] != serials:
            lengths = [len(s.ids) for s in self.running]
            slots = self.pool.slots([s.cross for s in self.running], max(lengths))
            self.memory = (serials, PagedMemory(self.pool, slots, lengths, self.cross_dtype))
        return self.memory[1]

    # --- The search ----------------------------------------------------------------------------

    def search(self, logits: torch.Tensor) -> None:
        """Each sentence's next step of greedy or beam search, in groups that share the settings
        and the number of rows (so that each group is a few tensor operations)."""
        groups: dict[tuple, list[tuple[Sentence, int]]] = {}
        start = 0
        for sentence in self.running:
            key = (sentence.beam, len(sentence.rows), sentence.settings.beam_size)
            groups.setdefault(key, []).append((sentence, start))
            start += len(sentence.rows)
        for (beam, width, _), members in groups.items():
            sentences = [s for s, _ in members]
            if len(groups) == 1:  # every row, in order
                lprobs = self.log_probs(logits, sentences, width)
            else:
                index = torch.cat([torch.arange(start, start + width) for _, start in members]).to(logits.device)
                lprobs = self.log_probs(logits.index_select(0, index), sentences, width)
            (self.beam_step if beam else self.greedy_step)(sentences, lprobs, width)
        for sentence in self.running:
            sentence.step += 1

    def log_probs(self, logits: torch.Tensor, sentences: list[Sentence], width: int) -> torch.Tensor:
        """processors.log_probs, the step every search shares, with each sentence at its own step."""
        per_row = lambda values: torch.tensor(values, device=logits.device).repeat_interleave(width)  # noqa: E731
        step, max_len = per_row([s.step for s in sentences]), per_row([s.max_len for s in sentences])
        min_len = per_row([s.settings.min_len for s in sentences])
        return log_probs(logits, step, max_len, self.tokenizer.eos_id, self.model.cfg.pad_id, min_len)

    def greedy_step(self, sentences: list[Sentence], lprobs: torch.Tensor, width: int) -> None:
        """decoding/search.py's `generate` with `argmax`, one step."""
        eos = self.tokenizer.eos_id
        token = argmax(lprobs)  # EOS where a sentence is out of room: log_probs left it nothing else
        gained = lprobs.gather(1, token[:, None]).squeeze(1)
        for sentence, t, lp in zip(sentences, token.tolist(), gained.tolist()):
            row = sentence.rows[0]
            row.score = float(np.float32(row.score) + np.float32(lp))  # summed in fp32, as generate does
            row.tokens.append(t)
            if t == eos:
                log_prob = row.score
                self.end(sentence, [Hypothesis(strip_special(row.tokens, eos), log_prob, log_prob)])

    def beam_step(self, sentences: list[Sentence], lprobs: torch.Tensor, width: int) -> None:
        """decoding/beam.py's `beam_search`, one step for sentences that each have `width` rows."""
        eos, k = self.tokenizer.eos_id, sentences[0].settings.beam_size
        scores = torch.tensor([[row.score for row in s.rows] for s in sentences], device=lprobs.device)
        vocab = lprobs.size(-1)
        top, index = best_extensions(scores, lprobs, 2 * k)
        beam, token = index // vocab, index % vocab
        ends = (token == eos) & top.isfinite()
        kept, parent, next_token = survivors(top, beam, token, ends, k)
        host = [t.tolist() for t in (top[:, :k], beam[:, :k], ends[:, :k], kept, parent, next_token)]
        for i, sentence in enumerate(sentences):
            s_top, s_beam, s_ends, s_kept, s_parent, s_token = (h[i] for h in host)
            penalty = length_penalty(sentence.step + 1, sentence.settings.length_penalty)
            for rank in range(k):
                if s_ends[rank]:
                    tokens = list(sentence.rows[s_beam[rank]].tokens)
                    sentence.finished.append(Hypothesis(tokens, s_top[rank] / penalty, s_top[rank]))
            if self.beam_done(sentence, s_kept):
                n_best = sorted(sentence.finished, key=lambda h: -h.score)[: sentence.settings.n_best]
                self.end(sentence, n_best)
                continue
            parents = sentence.rows
            sentence.rows = [
                Row(self.pool.share(parents[p].table), parents[p].tokens + [t], score)
                for p, t, score in zip(s_parent, s_token, s_kept)
            ]
            for row in parents:
                self.pool.release(row.table)

    def beam_done(self, sentence: Sentence, live_scores: list[float]) -> bool:
        """decoding/beam.py's stopping rule for one sentence."""
        settings = sentence.settings
        return sentence_done(sentence.finished, max(live_scores), sentence.max_len, sentence.step, settings.n_best, settings.length_penalty)  # fmt: skip


def unsupported_settings(decode: DecodeConfig) -> str | None:
    """None when continuous batching can decode with these settings; otherwise why not."""
    if decode.strategy not in ("beam", "greedy"):
        return f"decode.strategy={decode.strategy}: continuous batching runs greedy and beam search"
    if decode.mbr != "none":
        return f"decode.mbr={decode.mbr} reranks whole n-best lists"
    if decode.shortlist:
        return "decode.shortlist=true narrows the output layer per batch, and the engine's batch changes every step"
    return None
