"""Loading what to decode with: one checkpoint, or several averaged as an `Ensemble`, each with
the speed paths its runtime config asks for."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import direction, language_pair, load_model, same_direction
from ..devices import pick_device
from ..errors import ConfigError
from ..fast import RuntimeConfig, accelerate
from .models import Ensemble


def load_decoder(checkpoint: str, ensemble: list[str], device_name: str, runtime: RuntimeConfig | None = None):
    """(device, the model to decode with: one checkpoint or an Ensemble, its tokenizer, the first payload).

    `runtime` chooses the speed paths installed on every loaded model (transformer.fast.accelerate)."""
    device = pick_device(device_name)
    model, tokenizer, payload = load_model(Path(checkpoint), device)
    model = accelerate(model, runtime)
    if not ensemble:
        return device, model, tokenizer, payload
    others = [load_model(Path(path), device) for path in ensemble]
    pair = language_pair(payload.get("train_config"))
    for path, (_, other_tokenizer, other_payload) in zip(ensemble, others):
        other_pair = language_pair(other_payload.get("train_config"))
        if not same_direction(pair, other_pair):
            raise ConfigError(
                f"ensemble checkpoint {path} translates {direction(other_pair)}, but {checkpoint} translates {direction(pair)}"
            )
        if not other_tokenizer.same_as(tokenizer):
            raise ConfigError(f"ensemble checkpoint {path} has another tokenizer than {checkpoint}")
    return device, Ensemble([model] + [accelerate(m, runtime) for m, _, _ in others]), tokenizer, payload
