"""Every config in configs/ composes and validates; bad keys and values fail clearly."""

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from transformer.config import Config, compose_command, hydra_error_line, register_schema, to_config
from transformer.decoding.config import SchedulerConfig
from transformer.errors import ConfigError
from transformer.model import ModelConfig
from transformer.model.attention_variants import VARIANTS, AttentionConfig

from .test_cli import assert_one_line_error, run

pytestmark = pytest.mark.isa_free  # no kernel an instruction-set limit changes: `make test-avx2` leaves it out

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
COMMAND_GROUPS = {"scheduler"}  # translate.py's and serve.py's settings, not train.py's
GROUP_OPTIONS = [
    (group.name, option.stem)
    for group in sorted(CONFIGS.iterdir())
    if group.is_dir() and group.name not in COMMAND_GROUPS
    for option in sorted(group.glob("*.yaml"))
]


def compose_config(overrides: list[str]):
    register_schema()  # as train.py does: configs/config.yaml composes onto the typed Config
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("group, option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_config_composes_into_the_typed_config(group, option):
    cfg = to_config(compose_config([f"{group}={option}"]))
    assert isinstance(cfg, Config)


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONFIGS / "scheduler").glob("*.yaml")))
def test_every_scheduler_option_composes_into_the_commands_config(option):
    """scheduler=NAME, as translate.py and serve.py take it, and its fields beside it."""

    @dataclasses.dataclass
    class Command:
        scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)

    cfg = compose_command([f"scheduler={option}", "scheduler.pool_mib=64"], Command, "", "scheduler_probe")
    assert cfg.scheduler == SchedulerConfig(kind=option, pool_mib=64)


def test_default_is_the_multi30k_de_en_recipe():
    cfg = to_config(compose_config([]))
    assert (cfg.data.src_lang, cfg.data.tgt_lang) == ("de", "en")
    assert cfg.data.dir == "data/multi30k" and cfg.trainer.max_minutes > 0


def test_a_model_chosen_beside_the_recipe_keeps_its_own_dropout():
    assert to_config(compose_config([])).model.dropout == 0.2  # the recipe's model, small_modern
    assert to_config(compose_config(["experiment=multi30k_en_de"])).model.dropout == 0.2
    assert to_config(compose_config(["model=small"])).model.dropout == 0.3


def test_base_preset_is_the_paper_base_model():
    m = to_config(compose_config(["model=base"])).model
    assert (m.n_encoder_layers, m.n_decoder_layers, m.d_model, m.n_heads, m.d_ff, m.dropout) == (
        6,
        6,
        512,
        8,
        2048,
        0.1,
    )


def test_overrides_from_the_readme_apply():
    cfg = to_config(compose_config(["model=small", "trainer.max_steps=2000", "data.src_lang=en", "data.tgt_lang=de"]))
    assert (cfg.model.n_encoder_layers, cfg.trainer.max_steps, cfg.data.src_lang, cfg.name) == (3, 2000, "en", "en-de")


def test_unknown_key_is_refused_by_hydra():
    with pytest.raises(ConfigCompositionException, match="model.colour"):
        compose_config(["model.colour=blue"])


@pytest.mark.parametrize("override, key", [("+model.colour=blue", "model.colour"), ("+colour=blue", "colour")])
def test_unknown_key_added_with_plus_is_refused_by_name(override, key):
    with pytest.raises(ConfigError, match=f"config key {key}:"):
        to_config(compose_config([override]))


@pytest.mark.parametrize("override, key", [("trainer.lr=fast", "trainer.lr"), ("model.n_heads=abc", "model.n_heads")])
def test_value_of_the_wrong_type_is_refused_while_composing_by_name(override, key):
    with pytest.raises(ConfigCompositionException, match=key):
        compose_config([override])


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.n_heads=3", "model.d_model"),
        ("trainer.precision=fp8", "trainer.precision"),
        ("trainer.schedule=constant", "trainer.schedule"),
        ("trainer.cooldown=2", "trainer.cooldown"),
        ("runtime.precision=fp8", "runtime.precision"),
    ],
)
def test_wrong_value_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        to_config(compose_config([override]))


ATTENTION_KINDS = sorted(p.stem for p in (CONFIGS / "model" / "attention").glob("*.yaml"))


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("model", ["small", "base"])
def test_every_attention_kind_composes_with_every_model(kind, model):
    cfg = to_config(compose_config([f"model={model}", f"model/attention={kind}"]))
    assert cfg.model.attention.kind == kind


def test_block_options_and_attention_keys_are_single_overrides():
    overrides = ["model.attention.kind=moh", "model.attention.top_k=1", "model.positional=rope", "model.norm=rmsnorm", "model.activation=swiglu"]  # fmt: skip
    m = to_config(compose_config(overrides)).model
    assert (m.attention.kind, m.attention.top_k, m.positional, m.norm, m.activation) == ("moh", 1, "rope", "rmsnorm", "swiglu")  # fmt: skip
    assert set(ATTENTION_KINDS) == set(VARIANTS)  # one YAML file per registered attention class


PRESETS = sorted((CONFIGS / "model").rglob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=[str(p.relative_to(CONFIGS)) for p in PRESETS])
def test_model_presets_hold_only_keys_that_differ_from_the_defaults(path):
    schema = AttentionConfig if path.parent.name == "attention" else ModelConfig
    defaults = {f.name: f.default for f in dataclasses.fields(schema)}
    values = OmegaConf.to_container(OmegaConf.load(path)) or {}
    for key, value in values.items():
        assert key == "defaults" or value != defaults[key], f"{key}: {value} is {schema.__name__}'s default"


def test_a_key_no_yaml_file_sets_can_be_overridden():
    m = to_config(compose_config(["model=small", "model.bias=false", "model.attention.rank=1"])).model
    assert (m.d_model, m.bias, m.attention.rank) == (256, False, 1)


def test_runtime_group_chooses_the_speed_paths():
    assert to_config(compose_config([])).runtime.fast
    reference = to_config(compose_config(["runtime=reference"])).runtime
    assert not reference.fast
    assert not to_config(compose_config(["runtime.chunked_loss=false"])).runtime.chunked_loss


@pytest.mark.parametrize("sweep", ["multi30k_de_en", "multi30k_en_de"])
def test_sweep_configs_define_a_multirun_grid(sweep):
    register_schema()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"sweep={sweep}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params and all("," in values for values in params.values())
    assert cfg.data.src_lang + "_" + cfg.data.tgt_lang in sweep  # the sweep trains its own direction
    for key in params:  # every swept key exists in the composed configuration
        assert OmegaConf.select(cfg, key, throw_on_missing=False) is not None, key
    if "model.dropout" in params:  # a long budget's dropout would replace the swept values
        assert cfg.trainer.long_budget_epochs == 0


@pytest.mark.e2e
@pytest.mark.parametrize(
    "body, needle",
    [("model:\n  colour: blue\n", "config key model.colour"), ("trainer:\n  lr: fast\n", "config key trainer.lr")],
)
def test_bad_key_or_value_in_a_yaml_file_is_one_error_line_naming_it(tmp_path, body, needle):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "bad.yaml").write_text("# @package _global_\n" + body)
    result = run("train.py", f"--config-dir={tmp_path}", "experiment=bad", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(result, "In 'experiment/bad'", needle)


def test_a_moved_key_is_refused_with_its_new_name():
    with pytest.raises(ConfigCompositionException) as refused:
        compose_config(["decode.precision=int8"])
    assert "decode.precision is now runtime.precision" in hydra_error_line(refused.value)
    assert to_config(compose_config(["runtime.precision=int8"])).runtime.precision == "int8"
