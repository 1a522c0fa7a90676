import gzip
import os
import tempfile
from pathlib import Path

import pytest
import torch

from transformer.fast import accelerate
from transformer.model import ModelConfig, Transformer
from transformer.model.attention_variants import AttentionConfig
from transformer.runtime import RuntimeConfig

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "multi30k"


def usable_cpus() -> int:
    """The CPUs this process may run on (a container or taskset may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (the default, see pyproject.toml): one test worker per usable CPU."""
    return usable_cpus()


# Timings the int8 start-up check keeps (fast/int8.py: plan_cache_path) go to a directory of this
# test process, inherited by the commands it starts, never to the user's cache.
os.environ["TRANSFORMER_CACHE_DIR"] = tempfile.mkdtemp(prefix="transformer-cache-")

# Under pytest-xdist the workers share the CPUs: each gets its share of torch threads, and so do
# the train.py and translate.py commands the tests start (their torch reads OMP_NUM_THREADS), so
# that two workers on two cores do not run four busy threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, usable_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


def write_corpus(directory: Path, split: str, pairs: dict[str, list[str]], gz: bool = True) -> None:
    """Write one split as {split}.{lang}[.gz] files, one sentence per line."""
    directory.mkdir(parents=True, exist_ok=True)
    for lang, lines in pairs.items():
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        if gz:
            (directory / f"{split}.{lang}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / f"{split}.{lang}").write_bytes(data)


def make_tiny_corpus(out: Path) -> Path:
    for split, n in (("train", 400), ("val", 40), ("test_2016_flickr", 40)):
        pairs = {}
        for lang in ("de", "en"):
            with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                pairs[lang] = [next(f).strip() for _ in range(n)]
        write_corpus(out, split, pairs)
    return out


@pytest.fixture
def tiny_corpus(tmp_path) -> Path:
    """A small real slice of Multi30k (de, en) in the shipped layout; tests may change it."""
    return make_tiny_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def shared_corpus(tmp_path_factory) -> Path:
    """The same slice, shared by the tests that only read it."""
    return make_tiny_corpus(tmp_path_factory.mktemp("shared") / "corpus")


class RemovesAFile:
    """Unpickled, this calls os.remove(victim): a checkpoint that runs code when loaded."""

    def __init__(self, victim):
        self.victim = victim

    def __reduce__(self):
        return os.remove, (str(self.victim),)


# --- Tiny models and the variants the property tests run over (test_model.py, test_fast.py, ...) ---

PAD, BOS, EOS = 0, 2, 3
RUNTIMES = ["reference", "fast"]


# Noise added to the parameters of attention variants that start at a neutral point (zero or
# identity), by parameter name: MoH's router and stage, DCMHA's dynamic weights and static mixing.
# At 0.3 DCMHA's query- and key-wise compositions (products of two dynamic weights) scale the
# scores 40-85 times, against 1.2-3.8 in a trained model (docs/lab/2026-12-01-every-cpu-green.md):
# a harder case than training reaches, and the property tests hold for it.
VARIANT_NOISE = {"router": 0.3, "stage": 0.3, "query_weights": 0.3, "key_weights": 0.3, ".static": 0.3}
# For tests that compare fp32 gradients (test_fast.py's training step): at 0.3 the reference's own
# fp32 gradients of DCMHA rank 2 are off by 0.5-1% of their norm (against float64; measured natively
# and under AVX2), as much as the errors such a test must catch; at 0.1 (scores scaled 3-5 times,
# as in a trained model) by 1e-5.
CONDITIONED_NOISE = {**VARIANT_NOISE, "query_weights": 0.1, "key_weights": 0.1, ".static": 0.1}


def make_model(runtime: str = "reference", noise: dict[str, float] = VARIANT_NOISE, **overrides) -> Transformer:
    """A tiny model. The parameters of attention variants (MoH router, DCMHA mixing) are moved
    away from their zero/identity initialization by `noise` (by parameter name), so no variant
    sits at its neutral point."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, n_encoder_layers=2, n_decoder_layers=2, d_model=32, n_heads=4, d_ff=64, dropout=0.0)
    model = Transformer(ModelConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = next((scale for part, scale in noise.items() if part in name), 0.0)
            p.add_(scale * torch.randn_like(p))
    return accelerate(model, RuntimeConfig(fast=runtime == "fast"))


def random_tokens(batch: int, length: int) -> torch.Tensor:
    return torch.randint(4, 40, (batch, length))


VARIANTS = [
    {},
    {"norm_first": True},
    {"n_kv_heads": 2},
    {"n_kv_heads": 1},
    {"positional": "learned"},
    {"bias": False, "tie_output": False},
    # The attention variants and block options of attention_variants.py and docs/ATTENTION.md:
    {"attention": AttentionConfig(kind="moh", shared_heads=1, top_k=2)},
    {"attention": AttentionConfig(kind="moh", shared_heads=2, top_k=1), "n_kv_heads": 2},
    {"attention": AttentionConfig(kind="dcmha", rank=2)},
    {"attention": AttentionConfig(kind="dcmha", rank=1), "n_kv_heads": 1},
    {"attention": AttentionConfig(kind="overlap", overlap=2)},
    {"positional": "rope"},
    {"norm": "rmsnorm", "norm_first": True},
    {"activation": "gelu"},
    {"positional": "rope", "norm": "rmsnorm", "activation": "swiglu", "norm_first": True},
    {"positional": "rope", "attention": AttentionConfig(kind="overlap", overlap=2)},
    {"activation": "silu", "sinusoidal_layout": "halves", "output_bias": True},  # Marian's block (marian.py)
]


def variant_id(variant: dict) -> str:
    return ",".join(f"{k}={getattr(v, 'kind', v)}" for k, v in variant.items()) or "standard"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that talked to serve.py shows the server's log beside the traceback (its
    stderr is otherwise kept only in the Server object), ending with its threads' stacks if it still
    runs: a hang or a 500 says what the server was doing."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        from .servers import Server

        for name, value in getattr(item, "funcargs", {}).items():
            if isinstance(value, Server):
                value.dump_threads()
                report.sections.append((f"serve.py log ({name})", "".join(value.log[-200:])))


def pytest_terminal_summary(terminalreporter) -> None:
    """The oneDNN kernels the CPU-dependent fast paths ran (tests/test_kernels.py), and the CPU."""
    lines = [value for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("skipped", [])
             for name, value in getattr(report, "user_properties", []) if name == "kernels"]  # fmt: skip
    if lines:
        from transformer.devices import describe_cpu

        terminalreporter.write_sep("-", f"kernels ({describe_cpu()})")
        for line in sorted(lines):
            terminalreporter.write_line(line)
