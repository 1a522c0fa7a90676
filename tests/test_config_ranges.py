"""Every range check on a config value: an out-of-range number is refused by a message that names
its key, in the config train.py composes, in the scripts' key=value arguments, and through the
real entry points as one `error:` line. The smallest values still allowed (0 where it means
none, off or no limit) compose. That every shipped config composes is tests/test_configs.py's."""

import importlib.util
import sys

import pytest
from omegaconf import OmegaConf

from transformer.config import to_config
from transformer.errors import ConfigError
from transformer.model import ModelConfig

from .conftest import ROOT
from .test_cli import assert_one_line_error, run, train
from .test_configs import compose_config

pytestmark = pytest.mark.isa_free  # no kernel an instruction-set limit changes: `make test-avx2` leaves it out

# (overrides of the composed config, separated by spaces; the key the error must name)
REFUSED = [
    # model (the default experiment's model is small_modern: rotary positions)
    ("model.n_heads=0", "model.n_heads"),
    ("model.n_heads=-2", "model.n_heads"),
    ("model.d_model=0", "model.d_model"),
    ("model.d_model=-256", "model.d_model"),
    ("model.n_encoder_layers=0", "model.n_encoder_layers"),
    ("model.n_decoder_layers=-1", "model.n_decoder_layers"),
    ("model.d_ff=0", "model.d_ff"),
    ("model.n_kv_heads=0", "model.n_kv_heads"),
    ("model.max_positions=1", "model.max_positions"),
    ("model=small model.d_model=255 model.n_heads=1", "model.d_model"),  # sinusoidal positions: even
    ("model.dropout=1.0", "model.dropout"),
    ("model.attention.shared_heads=0", "model.attention.shared_heads"),
    ("model.attention.top_k=0", "model.attention.top_k"),
    ("model.attention.rank=0", "model.attention.rank"),
    ("model.attention.overlap=-1", "model.attention.overlap"),
    ("model.attention.balance_weight=-0.1", "model.attention.balance_weight"),
    ("model.attention.balance_weight=inf", "model.attention.balance_weight"),
    ("model/attention=moh model.attention.shared_heads=5", "model.attention.shared_heads"),
    # data
    ("data.vocab_size=4", "data.vocab_size"),
    ("data.max_tokens=0", "data.max_tokens"),
    ("data.max_len=1", "data.max_len"),
    ("data.spm_sample=-1", "data.spm_sample"),
    ("data.subword_nbest=0", "data.subword_nbest"),
    ("data.subword_alpha=-0.1", "data.subword_alpha"),
    ("data.subword_alpha=nan", "data.subword_alpha"),
    ("data.spm_model_type=wordpiece", "data.spm_model_type"),
    ("data.tgt_lang=de", "data.src_lang"),
    ("data.src_lang=''", "data.src_lang"),
    ("data.valid_split=''", "data.valid_split"),
    ("data.test_splits=[test_2016_flickr,'']", "data.test_splits"),
    ("data.extra_src_langs=['']", "data.extra_src_langs"),
    # trainer
    ("trainer.lr=-1", "trainer.lr"),
    ("trainer.lr=0", "trainer.lr"),
    ("trainer.lr=inf", "trainer.lr"),
    ("trainer.lr=nan", "trainer.lr"),
    ("trainer.warmup_steps=0", "trainer.warmup_steps"),
    ("trainer.threads=-1", "trainer.threads"),
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("trainer.max_epochs=-1", "trainer.max_epochs"),
    ("trainer.max_minutes=-5", "trainer.max_minutes"),
    ("trainer.max_minutes=nan", "trainer.max_minutes"),
    ("trainer.max_tokens_seen=-1", "trainer.max_tokens_seen"),
    ("trainer.warmup_fraction=1", "trainer.warmup_fraction"),
    ("trainer.warmup_fraction=-0.1", "trainer.warmup_fraction"),
    ("trainer.warmup_fraction=nan", "trainer.warmup_fraction"),
    ("trainer.patience=-1", "trainer.patience"),
    ("trainer.keep_last=-1", "trainer.keep_last"),
    ("trainer.average_last=-1", "trainer.average_last"),
    ("trainer.betas=[0.9,1.0]", "trainer.betas"),
    ("trainer.betas=[-0.1,0.98]", "trainer.betas"),
    ("trainer.betas=[0.9]", "trainer.betas"),
    ("trainer.eps=0", "trainer.eps"),
    ("trainer.weight_decay=-0.1", "trainer.weight_decay"),
    ("trainer.label_smoothing=1.0", "trainer.label_smoothing"),
    ("trainer.label_smoothing=-0.1", "trainer.label_smoothing"),
    ("trainer.clip_norm=-1", "trainer.clip_norm"),
    ("trainer.max_bad_steps=0", "trainer.max_bad_steps"),
    ("trainer.rdrop=-0.5", "trainer.rdrop"),
    ("trainer.accumulate=0", "trainer.accumulate"),
    ("trainer.eval_every=0", "trainer.eval_every"),
    ("trainer.log_every=0", "trainer.log_every"),
    ("trainer.members=0", "trainer.members"),
    # decode
    ("decode.beam_size=0", "decode.beam_size"),
    ("decode.beam_size=-1", "decode.beam_size"),
    ("decode.max_tokens=0", "decode.max_tokens"),
    ("decode.max_len_a=-1", "decode.max_len_a"),
    ("decode.max_len_a=inf", "decode.max_len_a"),
    ("decode.max_len_b=-1", "decode.max_len_b"),
    ("decode.max_len_a=0 decode.max_len_b=0", "decode.max_len_b"),
    ("decode.max_len_a=0 decode.max_len_b=1", "decode.max_len_b"),  # room for the EOS only
    ("decode.min_len=-1", "decode.min_len"),
    ("decode.length_penalty=-0.6", "decode.length_penalty"),
    ("decode.temperature=0", "decode.temperature"),
    ("decode.top_p=0", "decode.top_p"),
    ("decode.top_k=-1", "decode.top_k"),
]

# The smallest values allowed, and the zeros that mean none, off, no limit or torch's default.
ALLOWED = [
    "trainer.threads=0",
    "trainer.max_epochs=0",
    "trainer.max_minutes=0",
    "trainer.max_tokens_seen=0",
    "trainer.warmup_fraction=0",
    "trainer.patience=0",
    "trainer.keep_last=0",
    "trainer.clip_norm=0",
    "trainer.weight_decay=0",
    "trainer.rdrop=0",
    "trainer.label_smoothing=0",
    "trainer.betas=[0,0]",
    "trainer.warmup_steps=1 trainer.max_steps=1 trainer.eval_every=1 trainer.log_every=1 trainer.max_bad_steps=1",
    "decode.beam_size=1 decode.max_tokens=1 decode.min_len=0 decode.length_penalty=0 decode.top_k=0",
    "decode.max_len_a=0 decode.max_len_b=2",
    "data.vocab_size=5 data.max_tokens=1 data.max_len=2 data.spm_sample=0 data.subword_nbest=1",
    "data.test_splits=[]",
    "model.n_encoder_layers=1 model.n_decoder_layers=1 model.max_positions=2 model.n_kv_heads=1 model.dropout=0",
    "model=small model.d_model=256 model.n_heads=1 model.positional=learned",
    "model/attention=overlap model.attention.overlap=0 model.attention.balance_weight=0",
]


@pytest.mark.parametrize("overrides, key", REFUSED, ids=[o for o, _ in REFUSED])
def test_out_of_range_value_is_refused_by_name(overrides, key):
    with pytest.raises(ConfigError) as error:
        to_config(compose_config(overrides.split()))
    assert key in str(error.value)


@pytest.mark.parametrize("overrides", ALLOWED)
def test_smallest_allowed_values_compose(overrides):
    to_config(compose_config(overrides.split()))


# The vocabulary keys are no config options: the code sets them from the tokenizer, and a
# checkpoint rebuilds its ModelConfig from a dict.
VOCABULARY = [
    ({"vocab_size": 0}, "model.vocab_size"),
    ({"src_vocab_size": 0}, "model.src_vocab_size"),
    ({"pad_id": -1}, "model.pad_id"),
    ({"pad_id": 40}, "model.pad_id"),
    ({"src_vocab_size": 1, "pad_id": 1}, "model.pad_id"),
]


@pytest.mark.parametrize("fields, key", VOCABULARY, ids=[str(f) for f, _ in VOCABULARY])
def test_vocabulary_out_of_range_is_refused_by_name(fields, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig(**{"vocab_size": 40, "d_model": 32, "n_heads": 4, **fields})


def test_smallest_vocabularies_are_allowed():
    assert ModelConfig(vocab_size=1, src_vocab_size=1, d_model=32, n_heads=4).pad_id == 0


def script(name: str):
    """<name>.py (e.g. scripts/lab/seed_table) as a module (the scripts are files, not a package)."""
    spec = importlib.util.spec_from_file_location(name.replace("/", "_"), ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and OmegaConf look their module up by name
    spec.loader.exec_module(module)
    return module


# (script, its config class, its required arguments, the refused ones, the key the error must name)
SCRIPTS = [
    ("scripts/average_checkpoints", "AverageConfig", "run=RUN", "last=0", "last"),
    ("scripts/average_checkpoints", "AverageConfig", "run=RUN", "last=-1", "last"),
    ("benchmarks/benchmark", "BenchConfig", "", "steps=0", "steps"),
    ("benchmarks/benchmark", "BenchConfig", "", "rounds=0", "rounds"),
    ("benchmarks/benchmark", "BenchConfig", "", "max_tokens=0", "max_tokens"),
    ("benchmarks/benchmark", "BenchConfig", "", "threads=-1", "threads"),
    ("benchmarks/benchmark", "BenchConfig", "", "peak_repeats=0", "peak_repeats"),
    ("benchmarks/benchmark_decoding", "BenchConfig", "", "sentences=0", "sentences"),
    ("benchmarks/benchmark_decoding", "BenchConfig", "", "beam_size=0", "beam_size"),
    ("benchmarks/benchmark_decoding", "BenchConfig", "", "vocab_size=4", "vocab_size"),
    ("benchmarks/benchmark_decoding", "BenchConfig", "", "threads=-1", "threads"),
    ("benchmarks/benchmark_decoding", "BenchConfig", "", "peer_sentences=0", "peer_sentences"),
    ("benchmarks/benchmark_decoding", "BenchConfig", "", "new_tokens=1", "new_tokens"),
    ("benchmarks/benchmark_decoding", "BenchConfig", "", "rounds=0", "rounds"),
    ("scripts/convert_to_gqa", "ConvertConfig", "checkpoint=C", "n_kv_heads=0", "n_kv_heads"),
    ("scripts/convert_to_gqa", "ConvertConfig", "checkpoint=C", "calibration=0", "calibration"),
    ("scripts/convert_to_gqa", "ConvertConfig", "checkpoint=C", "finetune_steps=-1", "finetune_steps"),
    ("scripts/convert_to_gqa", "ConvertConfig", "checkpoint=C", "finetune_lr=0", "finetune_lr"),
    ("scripts/convert_to_gqa", "ConvertConfig", "checkpoint=C", "decode.beam_size=0", "decode.beam_size"),
    ("scripts/lab/evaluate_budgets", "BudgetConfig", "run=RUN", "minutes=[]", "minutes"),
    ("scripts/lab/evaluate_budgets", "BudgetConfig", "run=RUN", "minutes=[30,-1]", "minutes"),
    ("scripts/lab/evaluate_budgets", "BudgetConfig", "run=RUN", "average=0", "average"),
    ("scripts/analyze_heads", "HeadsConfig", "checkpoint=C", "sentences=0", "sentences"),
    ("scripts/analyze_heads", "HeadsConfig", "checkpoint=C", "prune=[2,0]", "prune"),
    ("scripts/lab/attention_lab", "LabConfig", "", "minutes=0", "minutes"),
    ("scripts/lab/attention_lab", "LabConfig", "", "speed_sentences=0", "speed_sentences"),
    ("scripts/lab/attention_lab", "LabConfig", "", "finetune_steps=0", "finetune_steps"),
    ("scripts/lab/attention_lab", "LabConfig", "", "only=[mha,gqa9]", "only"),
    ("scripts/tune_decoding", "TuneConfig", "checkpoint=C", "length_penalties=[0.6,-1.0]", "length_penalties"),
    ("scripts/tune_decoding", "TuneConfig", "checkpoint=C", "decode.max_tokens=0", "decode.max_tokens"),
]


def script_config(name: str, schema: str, args: list[str]):
    """What the script's main() validates before it loads anything."""
    module = script(name)
    cfg = to_config(OmegaConf.from_dotlist(args), getattr(module, schema))
    if name == "scripts/tune_decoding":
        module.check(cfg)
    return cfg


@pytest.mark.parametrize(
    "name, schema, required, refused, key", SCRIPTS, ids=[f"{name}-{bad}" for name, _, _, bad, _ in SCRIPTS]
)
def test_script_argument_out_of_range_is_refused_by_name(name, schema, required, refused, key):
    with pytest.raises(ConfigError) as error:
        script_config(name, schema, [*required.split(), refused])
    assert str(error.value).startswith(f"{key}=") or str(error.value).startswith(f"{key}:")


@pytest.mark.parametrize("name, schema, required", sorted({row[:3] for row in SCRIPTS}))
def test_script_defaults_pass_their_checks(name, schema, required):
    script_config(name, schema, required.split())


CLI = [
    (["model.n_heads=0"], "model.n_heads=0"),
    (["trainer.lr=-1"], "trainer.lr=-1"),
    (["data.max_tokens=0"], "data.max_tokens=0"),
    (["decode.beam_size=0"], "decode.beam_size=0"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("overrides, needle", CLI, ids=[o[0] for o, _ in CLI])
def test_train_refuses_an_out_of_range_value_in_one_line(tmp_path, overrides, needle):
    result = train(tmp_path / "run", *overrides)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "run" / "spm.model").exists()  # refused before any work


@pytest.mark.e2e
def test_average_checkpoints_refuses_last_zero_in_one_line(tmp_path):
    result = run("scripts/average_checkpoints.py", f"run={tmp_path}", "last=0")
    assert_one_line_error(result, "last=0 must be >= 1")
