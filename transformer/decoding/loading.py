"""Loading what to decode with: one checkpoint, or several averaged as an `Ensemble`, each with
the speed paths its runtime config asks for and, with decode.precision=int8, int8 linear layers."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import direction, language_pair, load_model, same_direction
from ..devices import pick_device
from ..errors import ConfigError
from ..fast import accelerate
from ..fast.int8 import available as int8_available
from ..fast.int8 import quantize_int8
from ..runtime import RuntimeConfig
from .models import Ensemble


def load_decoder(
    checkpoint: str,
    ensemble: list[str],
    device_name: str,
    runtime: RuntimeConfig | None = None,
    precision: str = "fp32",
):
    """(device, the model to decode with: one checkpoint or an Ensemble, its tokenizer, the first payload).

    `runtime` chooses the speed paths installed on every loaded model (transformer.fast.accelerate);
    precision="int8" (decode.precision) then quantizes their linear layers (CPU only)."""
    device = pick_device(device_name)
    if precision == "int8" and device.type != "cpu":
        raise ConfigError(f"decode.precision=int8 decodes on the CPU only, but device={device.type}")
    if precision == "int8" and not int8_available():
        raise ConfigError("decode.precision=int8 needs torch built with oneDNN's quantized linear; this torch has none")
    model, tokenizer, payload = load_model(Path(checkpoint), device)
    model = prepare(model, runtime, precision)
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
    return device, Ensemble([model] + [prepare(m, runtime, precision) for m, _, _ in others]), tokenizer, payload


def prepare(model, runtime: RuntimeConfig | None, precision: str):
    """The speed paths on `model`, then for int8 its linear layers quantized."""
    runtime = runtime or RuntimeConfig()
    model = accelerate(model, runtime)
    return quantize_int8(model, runtime.fast and runtime.onednn) if precision == "int8" else model
