"""Lexically constrained beam search: translations that contain given target phrases, placed by
the search (Post and Vilar, 2018, "Fast lexically constrained decoding via dynamic beam
allocation for neural machine translation").

Each hypothesis carries its `Progress`: the phrases it contains and the phrase it is in the
middle of. A step's candidates are, per sentence, the k best extensions of all its beams, each
beam's best extension, and each beam's extensions that advance a constraint (the next token of
the phrase in progress, or the first token of a phrase not yet met). The candidates fall into
banks by the number of constraint tokens they have met, and the k beams are shared out among the
banks in turns, from the bank with the most constraint tokens down, each taking its best
remaining candidate (dynamic beam allocation: a bank with too few candidates leaves its turns to
the others). So hypotheses that have placed more constraints survive beside the ones that score
best. A hypothesis may end (EOS) only once it contains every phrase; at the length limit, which
grows by the constraints' length, every hypothesis ends, and the finished ones are ranked first
by the constraint tokens they contain, then by score.

The search runs batched over sentences x beams with the model's key/value cache (`reorder_targets`
moves it with the beams), so it works with `Uncached` and ensembles as every search does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..model import padding_mask
from .processors import length_penalty, log_probs, max_lengths, sentence_done, source_lengths
from .search import Hypothesis

if TYPE_CHECKING:
    from .config import DecodeConfig


@dataclass(frozen=True)
class Progress:
    """Where a hypothesis stands with its sentence's constraints (phrases of token ids)."""

    met: frozenset = frozenset()  # indices of the phrases it contains
    phrase: int = -1  # the phrase it is in the middle of; -1: none
    position: int = 0  # that phrase's tokens generated so far

    def tokens_met(self, phrases: list[list[int]]) -> int:
        """Constraint tokens generated: the bank of the hypothesis."""
        return sum(len(phrases[i]) for i in self.met) + self.position

    def complete(self, phrases: list[list[int]]) -> bool:
        return len(self.met) == len(phrases)

    def wanted(self, phrases: list[list[int]]) -> list[int]:
        """The tokens that advance a constraint."""
        if self.phrase >= 0:
            return [phrases[self.phrase][self.position]]
        return list(dict.fromkeys(p[0] for i, p in enumerate(phrases) if i not in self.met))

    def after(self, token: int, phrases: list[list[int]]) -> Progress:
        """The progress once `token` is generated. A phrase in progress that the token does not
        continue is abandoned (its tokens count no more); the token may start another one."""
        if self.phrase >= 0 and phrases[self.phrase][self.position] == token:
            return self.advanced(self.phrase, self.position + 1, phrases)
        for i, phrase in enumerate(phrases):
            if i not in self.met and phrase[0] == token:
                return self.advanced(i, 1, phrases)
        return Progress(self.met)

    def advanced(self, phrase: int, position: int, phrases: list[list[int]]) -> Progress:
        if position == len(phrases[phrase]):
            return Progress(self.met | {phrase})
        return Progress(self.met, phrase, position)


@dataclass
class Candidate:
    score: float
    beam: int
    token: int
    progress: Progress


def allocate(candidates: list[Candidate], k: int, phrases: list[list[int]]) -> list[Candidate]:
    """Up to k candidates shared out among the banks (constraint tokens met) in turns, the bank
    with the most first, each taking its best remaining candidate."""
    banks: dict[int, list[Candidate]] = {}
    for c in sorted(candidates, key=lambda c: -c.score):
        banks.setdefault(c.progress.tokens_met(phrases), []).append(c)
    queues = [banks[met] for met in sorted(banks, reverse=True)]
    chosen: list[Candidate] = []
    while len(chosen) < k and any(queues):
        for queue in queues:
            if queue and len(chosen) < k:
                chosen.append(queue.pop(0))
    return chosen


def candidates_of(total: Tensor, top: list, progress: list[Progress], phrases) -> list[tuple[int, int]]:
    """The (beam, token) pairs one sentence considers: its 2k top extensions `top`, each live beam's
    best token, and each live beam's tokens that advance a constraint (total: (k, vocab) scores)."""
    pairs = dict.fromkeys(top)
    best = total.argmax(-1).tolist()
    for beam, p in enumerate(progress):
        pairs[(beam, best[beam])] = None
        for token in p.wanted(phrases):
            pairs[(beam, token)] = None
    return list(pairs)


@torch.no_grad()
def constrained_beam_search(
    model, src: Tensor, bos_id: int, eos_id: int, cfg: DecodeConfig, constraints: list[list[list[int]]]
) -> list[list[Hypothesis]]:
    """Beam search whose translations contain each sentence's phrases (see the module docstring).
    constraints: per sentence, its phrases as target token ids (an empty list: unconstrained)."""
    k, batch, pad_id = cfg.beam_size, src.size(0), model.cfg.pad_id
    src_mask = padding_mask(src, pad_id)
    limit = model.cfg.max_positions - 1
    extra = torch.tensor([sum(map(len, c)) for c in constraints], device=src.device)
    max_len = max_lengths(source_lengths(src_mask), cfg, limit, extra=extra)
    host_max_len = max_len.tolist()
    memory, _ = model.encode(src, src_mask)
    state = model.new_state()
    tokens = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=src.device)
    scores = [[0.0] + [-math.inf] * (k - 1) for _ in range(batch)]
    progress = [[Progress()] * k for _ in range(batch)]
    finished: list[list[tuple[int, Hypothesis]]] = [[] for _ in range(batch)]
    done = [False] * batch
    for step in range(max(host_max_len)):
        logits, _ = model.decode(tokens[:, -1:], memory, src_mask, state)
        incomplete = torch.tensor([not p.complete(constraints[s]) for s in range(batch) for p in progress[s]], device=src.device)  # fmt: skip
        lprobs = log_probs(logits[:, -1], step, max_len.repeat_interleave(k), eos_id, pad_id, cfg.min_len, may_not_end=incomplete)  # fmt: skip
        total = (torch.tensor(scores, device=src.device).view(-1, 1) + lprobs).view(batch, k, -1)
        top = total.view(batch, -1).topk(2 * k, dim=1).indices.cpu()
        rows, chosen, scores, progress_before, progress = [], [], [], progress, []
        for s in range(batch):
            live = []
            if not done[s]:
                candidates = step_candidates(total[s], top[s], total.size(-1), progress_before[s], constraints[s])
                for c in ending(candidates, k, constraints[s], eos_id):
                    hyp = Hypothesis(tokens[s * k + c.beam, 1:].tolist(), c.score / length_penalty(tokens.size(1), cfg.length_penalty), c.score)  # fmt: skip
                    finished[s].append((c.progress.tokens_met(constraints[s]), hyp))
                live = allocate([c for c in candidates if c.token != eos_id], k, constraints[s])
                best_live = max((c.score for c in live), default=-math.inf)
                done[s] = sentence_done(
                    [h for _, h in finished[s]], best_live, host_max_len[s], step, k, cfg.length_penalty
                )
            live += [Candidate(-math.inf, 0, eos_id, Progress())] * (k - len(live))  # empty slots
            rows += [s * k + c.beam for c in live]
            chosen += [c.token for c in live]
            scores.append([c.score for c in live])
            progress.append([c.progress for c in live])
        if all(done):
            break
        index = torch.tensor(rows, device=src.device)
        state.reorder_targets(index)  # beams move within their sentence; the cross-attention cache stays
        tokens = torch.cat([tokens[index], torch.tensor(chosen, device=src.device).view(-1, 1)], dim=1)
    return [[h for _, h in sorted(f, key=lambda x: (-x[0], -x[1].score))][: cfg.n_best] for f in finished]


def ending(candidates: list[Candidate], k: int, phrases, eos_id: int) -> list[Candidate]:
    """The candidates that end a hypothesis: those ending in EOS that rank among the k best of
    their bank (without constraints, among the k best: plain beam search's rule)."""
    ranks: dict[int, int] = {}
    out = []
    for c in sorted(candidates, key=lambda c: -c.score):
        bank = c.progress.tokens_met(phrases)
        ranks[bank] = ranks.get(bank, 0) + 1
        if c.token == eos_id and ranks[bank] <= k:
            out.append(c)
    return out


def step_candidates(total: Tensor, top: Tensor, vocab: int, progress, phrases) -> list[Candidate]:
    """One sentence's candidates with their scores and progress (total: (k, vocab))."""
    pairs = candidates_of(total, [(int(i) // vocab, int(i) % vocab) for i in top], progress, phrases)
    beams, tokens = torch.tensor([b for b, _ in pairs]), torch.tensor([t for _, t in pairs])
    values = total[beams.to(total.device), tokens.to(total.device)].tolist()
    return [
        Candidate(value, beam, token, progress[beam].after(token, phrases))
        for (beam, token), value in zip(pairs, values)
        if value > -math.inf
    ]
