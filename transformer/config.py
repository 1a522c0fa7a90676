"""Typed configuration, and the one path by which every command gets its own: Hydra composes it
from configs/ and `to_config` checks it against the dataclasses. The only module that imports Hydra.

train.py composes with @hydra.main (configs/config.yaml); every other command (translate.py,
evaluate.py, serve.py, the scripts) with Hydra's compose API through `compose_command`, from its
own dataclass and the config groups of its typed fields: a DecodeConfig field is the `decode`
group (decode=greedy), a RuntimeConfig field the `runtime` group (runtime=reference). So a group
works in every command that has the setting, with the same error messages, --help and --cfg job.
Library code receives the dataclasses and never imports Hydra. The YAML files in configs/ hold
only what differs from the dataclass defaults: the dataclasses are the base every config composes
onto, so a key a YAML file leaves out can still be overridden by name.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .data import DataConfig
from .decoding import DecodeConfig
from .decoding.config import SchedulerConfig
from .errors import ConfigError
from .model import ModelConfig
from .runtime import RuntimeConfig
from .training.config import DistillConfig, TrainerConfig


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

    def __post_init__(self) -> None:
        if self.decode.shortlist:  # built from a trained run (scripts/build_shortlist.py), so not while training
            raise ValueError("decode.shortlist=true is for decoding with a trained checkpoint (translate.py, evaluate.py, serve.py), not for train.py")  # fmt: skip


@dataclass
class DistillRun(Config):
    """distill.py's config: the student's run (every key of Config, as train.py takes them), its
    teacher, and the stages' settings."""

    teacher: str = "???"  # the teacher's checkpoint
    ensemble: list[str] = field(default_factory=list)  # more teacher checkpoints, ensembled with it
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.distill.n_best > self.decode.beam_size:
            raise ValueError(f"distill.n_best={self.distill.n_best} needs decode.beam_size >= it, not {self.decode.beam_size}")  # fmt: skip
        if self.distill.n_best > 1 and not self.decode.ranks:
            raise ValueError(f"distill.n_best={self.distill.n_best} needs beam search (decode.strategy=beam)")

    def student(self, corpus: Path) -> Config:
        """The student's training config: every key of Config as given, data.dir the distilled corpus."""
        values = {f.name: getattr(self, f.name) for f in fields(Config)}
        values["data"] = dataclasses.replace(self.data, dir=str(corpus.resolve()))
        return Config(**values)


def register_schema() -> None:
    """Store Config in Hydra's ConfigStore as `schema`, the first entry of configs/config.yaml's
    defaults list, and DistillRun as `distill_schema`, configs/distill.yaml's. Call it before
    composing (train.py and distill.py do; so do the tests)."""
    ConfigStore.instance().store(name="schema", node=Config)
    ConfigStore.instance().store(name="distill_schema", node=DistillRun)


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


# Keys that moved, and where to: an override of the old name is refused with the new one named.
MOVED_KEYS = {"decode.precision": "runtime.precision (chosen when the model loads)"}


def hydra_error_line(e: HydraException) -> str:
    """One line for Hydra's own errors: an unknown config group or key, a malformed override, a
    value of the wrong type, a bad key or value in a YAML file (naming the file and key)."""
    lines = str(e).strip().splitlines()
    first = lines[0]
    if first.endswith("raised while composing config:") and len(lines) > 1:  # a bad key or value in a YAML file
        where = first.split(":")[0]  # In 'experiment/NAME'
        key = next((line.split("full_key:")[1].strip() for line in lines if "full_key:" in line), None)
        first = f"{where}: " + (f"config key {key}: " if key else "") + lines[1].strip()
    options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
    detail = f" ({str(e.__cause__).strip().splitlines()[0]})" if e.__cause__ else ""
    detail += f"; available: {', '.join(options)}" if options else ""
    detail += "".join(f"; {old} is now {new}" for old, new in MOVED_KEYS.items() if f"'{old}'" in first)
    return first + detail


# --- every command but train.py -----------------------------------------------------------------

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
GROUPS = {
    DecodeConfig: "decode",
    RuntimeConfig: "runtime",
    SchedulerConfig: "scheduler",
}  # the config group of a typed field


def group_defaults(schema: type) -> list[dict[str, str]]:
    """The defaults list entries of `schema`'s fields that have a config group: [{"decode": None}, ...].
    None selects no option until the command line does (decode=greedy), so that the dataclass's own
    default (e.g. a script's greedy search) stays the base; configs/decode/beam.yaml and
    configs/runtime/fast.yaml hold the dataclasses' defaults, so choosing them changes nothing."""
    hints = typing.get_type_hints(schema)
    return [{f.name: None} for f in fields(schema) if GROUPS.get(hints[f.name]) == f.name]


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def command_help(schema: type, doc: str) -> str:
    """A command's --help: its docstring, then its config groups and options (as train.py's lists them)."""
    groups = [next(iter(entry)) for entry in group_defaults(schema)]
    lines = [f"{g}: {', '.join(group_options(g))}" for g in groups]
    tail = (
        "\n".join(["Config groups (group=option, from configs/GROUP/OPTION.yaml):", *lines, "", ""]) if groups else ""
    )
    return f"{doc.strip()}\n\n{tail}--cfg job prints the composed config; --help this text.\n"


def quoted_if_needed(override: str, parser: OverridesParser) -> str:
    """`override` as Hydra parses it, or, where its grammar cannot (a sentence with non-ASCII
    letters, a path holding '='), with the value quoted: these commands take text and paths as
    values, which train.py's overrides do not."""
    try:
        parser.parse_override(override)
        return override
    except HydraException:
        key, value = override.split("=", 1)
        return f"{key}='{value}'" if "'" not in value else override


def compose_command(argv: list[str], schema: type, doc: str, name: str):
    """`argv` (key=value overrides and config groups, as train.py takes them) composed by Hydra
    onto `schema` and the config groups of its typed fields, checked -> a `schema` instance.
    --help prints `doc` and the groups; --cfg job prints the composed config; both exit 0.
    Errors raise ConfigError with one line naming the key, the group or the value."""
    if argv and argv[0] in ("-h", "--help"):
        print(command_help(schema, doc), end="")
        sys.exit(0)
    show = None
    if len(argv) >= 2 and argv[0] in ("--cfg", "-c"):
        show, argv = argv[1], argv[2:]
        if show != "job":
            raise ConfigError(f"--cfg {show}: this command prints only its own config, --cfg job")
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise ConfigError(f"expected key=value arguments, got {bad[0]!r} (see --help)")
    parser = OverridesParser.create()
    argv = [quoted_if_needed(arg, parser) for arg in argv]
    store = ConfigStore.instance()
    store.store(name=f"{name}_schema", node=schema)
    store.store(name=name, node={"defaults": [f"{name}_schema", *group_defaults(schema), "_self_"]})
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors instead of printing them
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3", job_name=name):
            cfg = compose(config_name=name, overrides=argv)
    except HydraException as e:
        raise ConfigError(hydra_error_line(e)) from None
    if show:
        print(OmegaConf.to_yaml(cfg), end="")
        sys.exit(0)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing {missing[0]}=... (see --help)")
    return to_config(cfg, schema)
