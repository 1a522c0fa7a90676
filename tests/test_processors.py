"""The step every search shares (decoding/processors.py): one set of rules for the next token's
log-probabilities, with one step for all rows or each row at its own (the engine's), and the one
stopping rule of beam searches."""

from __future__ import annotations

import math

import torch

from transformer.decoding.processors import log_probs, sentence_done
from transformer.decoding.search import Hypothesis

EOS, PAD = 2, 0


def test_each_row_at_its_own_step_gets_what_it_would_get_in_a_batch_at_that_step():
    """The engine's rows stand at different steps: per-row steps must give each row exactly what
    a batch of rows all at that row's step gives (min_len, prefix, length limit)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 9)
    steps = torch.tensor([0, 2, 3, 5])
    max_len = torch.tensor([4, 4, 4, 9])  # row 2 is at its last step; row 3 is past its prefix
    prefix = torch.tensor([[5, 6, 7], [5, 6, 7], [5, -1, -1], [8, 8, 8]])
    min_len = torch.tensor([1, 1, 5, 0])
    together = log_probs(logits, steps, max_len, EOS, PAD, min_len, prefix)
    for row in range(4):
        step = int(steps[row])
        alone = log_probs(logits[row : row + 1], step, max_len[row : row + 1], EOS, PAD, int(min_len[row]), prefix[row : row + 1])  # fmt: skip
        torch.testing.assert_close(together[row : row + 1], alone, rtol=0, atol=0)


def test_the_rules_in_one_place():
    torch.manual_seed(0)
    logits = torch.randn(3, 9)
    plain = torch.log_softmax(logits, -1)
    out = log_probs(logits, 0, torch.tensor([5, 5, 1]), EOS, PAD, min_len=2, prefix=torch.tensor([[-1], [4], [4]]))
    assert out[:, PAD].eq(-math.inf).all()  # padding is never generated
    assert out[0, EOS] == -math.inf and out[0, 3] == plain[0, 3]  # EOS refused before min_len, the rest untouched
    assert (
        out[1].isfinite().sum() == 1 and out[1, 4] == plain[1, 4]
    )  # the prefix's token only, at its own log-probability
    assert (
        out[2].isfinite().sum() == 1 and out[2, EOS] == plain[2, EOS]
    )  # out of room: EOS only, before min_len and prefix too
    blocked = log_probs(logits, 3, torch.tensor([5, 5, 5]), EOS, PAD, may_not_end=torch.tensor([True, False, True]))
    assert blocked[:, EOS].isinf().tolist() == [True, False, True]  # a constraint not yet met


def test_one_stopping_rule():
    finished = [Hypothesis([1], -1.0, -1.0), Hypothesis([1, 1], -3.0, -3.0)]
    assert sentence_done([], -0.5, max_len=4, step=3, n_best=1, alpha=0.0)  # at the length limit
    assert sentence_done(finished, -math.inf, max_len=9, step=1, n_best=5, alpha=0.0)  # no live beam left
    assert not sentence_done(finished[:1], -0.5, max_len=9, step=1, n_best=2, alpha=0.0)  # too few finished
    assert sentence_done(finished, -3.5, max_len=9, step=1, n_best=2, alpha=0.0)  # no live beam can beat the 2nd
    assert not sentence_done(finished, -2.5, max_len=9, step=1, n_best=2, alpha=0.0)
