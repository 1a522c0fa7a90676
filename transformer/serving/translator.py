"""The loaded model (one checkpoint or an ensemble) as the server uses it: a request's settings
turned into a DecodeConfig, token ids in and n-best lists out, and the cross-attention of one
sentence pair for the web page's heatmap."""

from __future__ import annotations

import dataclasses
import math
import threading

import torch

from ..decoding import STRATEGIES, DecodeConfig, Ensemble, Hypothesis, encode_sources, translate_ids


class Translator:
    """One model, used by one thread at a time (`lock`): the batcher's worker, or an alignment."""

    def __init__(self, model, tokenizer, device, decode: DecodeConfig, language_pair: str | None = None):
        self.model, self.tokenizer, self.device, self.decode = model.eval(), tokenizer, torch.device(device), decode
        self.language_pair = language_pair
        self.lock = threading.Lock()

    @property
    def max_source_tokens(self) -> int:
        return self.model.cfg.max_positions - 1  # the EOS takes one position

    def settings(self, beam_size: int | None = None, n_best: int | None = None, length_penalty: float | None = None):
        """The server's decode settings with a request's changes; a ValueError names a bad combination.
        Asking for a beam or an n-best list asks for beam search."""
        changes = {"beam_size": beam_size, "n_best": n_best, "length_penalty": length_penalty}
        changes = {key: value for key, value in changes.items() if value is not None}
        if "beam_size" in changes or changes.get("n_best", 1) > 1:
            changes["strategy"] = "beam"
        if "n_best" in changes and "beam_size" not in changes:
            changes["beam_size"] = max(self.decode.beam_size, changes["n_best"])
        return dataclasses.replace(self.decode, **changes)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Source token ids; an over-long text is truncated to what the model's positions allow (with a warning)."""
        return encode_sources(texts, self.tokenizer, self.max_source_tokens, "request")

    def translate(self, sources: list[list[int]], settings: DecodeConfig) -> list[list[Hypothesis]]:
        """n-best lists in input order; an empty source gets empty hypotheses, as in translate.py."""
        todo = [i for i, ids in enumerate(sources) if ids]
        empty = [Hypothesis([], 0.0, 0.0)] * STRATEGIES[settings.strategy].hypotheses_per_sentence(settings)
        out = [empty for _ in sources]
        with self.lock:
            n_best = translate_ids(self.model, [sources[i] for i in todo], self.tokenizer, settings, self.device)
        for i, hyps in zip(todo, n_best):
            out[i] = hyps
        return out

    def check(self) -> None:
        """Decode one short sentence as a request is decoded, with the server's settings; raises
        when the model cannot: an error, no hypothesis (a model with NaN weights ends none), or a
        log-probability that is not a finite number."""
        sources = self.encode(["Hello."])
        if not sources[0]:
            raise RuntimeError("the tokenizer encodes the check sentence 'Hello.' to no tokens")
        log_probs = [h.log_prob for h in self.translate(sources, self.decode)[0]]
        if not log_probs or not all(math.isfinite(p) for p in log_probs):
            raise RuntimeError(f"the check sentence 'Hello.' decoded to {len(log_probs)} hypotheses, log-probabilities {log_probs}")  # fmt: skip

    def texts(self, hypotheses: list[Hypothesis]) -> list[str]:
        return self.tokenizer.decode([h.tokens for h in hypotheses])

    @property
    def n_layers(self) -> int:
        return self.first_model.cfg.n_decoder_layers

    @property
    def first_model(self):
        """The model whose attention the page shows: the first member of an ensemble."""
        return self.model.models[0] if isinstance(self.model, Ensemble) else self.model

    @torch.no_grad()
    def cross_attention(self, source: str, translation: str, layer: int) -> dict:
        """Decoder layer `layer`'s cross-attention for the pair, averaged over heads: weights[i][j] is
        how much the step that wrote target token i looked at source token j (both end in </s>)."""
        if not -self.n_layers <= layer < self.n_layers:
            raise ValueError(
                f"layer={layer} is not a decoder layer: the model has {self.n_layers} (0..{self.n_layers - 1})"
            )
        src_ids = self.encode([source])[0]
        tgt_ids = self.tokenizer.encode([translation])[0][: self.first_model.cfg.max_positions - 1]
        src = torch.tensor([src_ids + [self.tokenizer.eos_id]], device=self.device)
        tgt = torch.tensor([[self.tokenizer.bos_id] + tgt_ids], device=self.device)  # row i predicts token i
        with self.lock:
            weights = self.first_model.attention_weights(src, tgt)["cross"][layer]  # (1, heads, tgt_len, src_len)
        source_piece, target_piece = self.tokenizer.source.id_to_piece, self.tokenizer.id_to_piece
        return {
            "layer": layer % self.n_layers,
            "layers": self.n_layers,
            "source_tokens": [source_piece(i) for i in src_ids] + ["</s>"],
            "target_tokens": [target_piece(i) for i in tgt_ids] + ["</s>"],
            "weights": weights[0].float().mean(0).cpu().tolist(),  # (tgt_len, src_len)
        }
