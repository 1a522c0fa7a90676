"""Typed run configuration. The only module that knows the shape of the Hydra config in configs/.

Entry points compose a DictConfig with Hydra and call `to_config`; library code receives these
dataclasses and never imports Hydra. The YAML files in configs/ hold only what differs from the
dataclass defaults: `register_schema` gives Hydra the dataclasses as the base every config
composes onto, so a key a YAML file leaves out can still be overridden by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .data import DataConfig
from .decoding import DecodeConfig
from .errors import ConfigError
from .model import ModelConfig
from .runtime import RuntimeConfig
from .training.config import TrainerConfig


@dataclass
class Config:
    name: str = "run"
    seed: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # speed paths: runtime=fast|reference
    init_from: Optional[str] = None  # a checkpoint to fine-tune: its weights, architecture and tokenizer


def register_schema() -> None:
    """Store Config in Hydra's ConfigStore as `schema`, the first entry of configs/config.yaml's
    defaults list. Call it before composing (train.py does; so do the tests)."""
    ConfigStore.instance().store(name="schema", node=Config)


def to_config(cfg: DictConfig, schema: type = Config):
    """Validate a composed config against the dataclasses (unknown keys, types, ranges)."""
    try:
        # As plain containers: a key added to a typed node with Hydra's `+key=value` is refused here.
        plain = OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else cfg
        merged = OmegaConf.merge(OmegaConf.structured(schema), plain)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(one_line(e)) from None
    except ValueError as e:  # raised by a dataclass's __post_init__ check
        raise ConfigError(str(e)) from None


def one_line(error: OmegaConfBaseException) -> str:
    message = str(error).strip().splitlines()[0]
    key = getattr(error, "full_key", None)
    return f"config key {key}: {message}" if key else message
