"""Paired significance tests between two systems (transformer/significance.py) on tiny systems whose
answer is known: identical systems do not differ, the references beat a damaged copy of themselves;
and the difference's confidence interval agrees with sacreBLEU's own bootstrap."""

import gzip

import pytest

from transformer.significance import bootstrap_differences, compare, metrics, paired_test

from .conftest import DATA

pytestmark = pytest.mark.isa_free  # no kernel an instruction-set limit changes: `make test-avx2` leaves it out


@pytest.fixture(scope="module")
def references() -> list[str]:
    with gzip.open(DATA / "test_2016_flickr.en.gz", "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(40)]


def damaged(sentences: list[str]) -> list[str]:
    """Each sentence without its second half: a clearly worse system."""
    return [" ".join(s.split()[: len(s.split()) // 2]) for s in sentences]


def small(baseline, system, references, seed=7):
    return compare(baseline, system, references, seed=seed, bootstrap_samples=200, randomization_trials=500)


def test_identical_systems_do_not_differ(references):
    """p = 1 is compare's correction for a difference of exactly 0, where sacreBLEU's tests give
    their smallest p-value (they count only resamples strictly above the observed difference); a
    system that differs in one sentence keeps sacreBLEU's own p-values."""
    system = damaged(references[:20]) + references[20:]
    for result in small(system, list(system), references):
        assert result.difference == 0 and result.low == 0 == result.high
        assert result.p_bootstrap == 1.0 and result.p_randomization == 1.0
    sacre = paired_test("bs", system, list(system), references, False, 200, seed=7)
    assert all(pair[1].p_value == pytest.approx(1 / 201) for pair in sacre.values())  # why the correction exists
    one_more = system[:19] + references[19:]
    sacre = paired_test("ar", system, one_more, references, False, 500, seed=7)
    for result, (name, pair) in zip(small(system, one_more, references), sacre.items()):
        assert result.difference != 0 and result.p_randomization == pair[1].p_value < 1.0, name


def test_the_references_are_significantly_better_than_a_damaged_copy(references):
    for result in small(damaged(references), references, references):
        assert result.system > result.baseline and 0 < result.low <= result.difference <= result.high
        assert result.p_bootstrap < 0.05 and result.p_randomization < 0.05


def test_swapping_the_systems_negates_the_difference_and_keeps_the_p_values(references):
    a, b = damaged(references[:25]) + references[25:], references[:10] + damaged(references[10:])
    for forward, backward in zip(small(a, b, references), small(b, a, references)):
        assert forward.difference == pytest.approx(-backward.difference)
        assert (forward.low, forward.high) == pytest.approx((-backward.high, -backward.low), abs=1e-3)
        assert forward.p_randomization == pytest.approx(backward.p_randomization, abs=0.05)


def test_a_seed_repeats_a_comparison_exactly_and_another_seed_resamples(references):
    a, b = damaged(references[:25]) + references[25:], references[:10] + damaged(references[10:])
    assert small(a, b, references, seed=3) == small(a, b, references, seed=3)
    for one, other in zip(small(a, b, references, seed=3), small(a, b, references, seed=4)):
        assert one.difference == other.difference  # the systems' scores do not depend on the seed
        assert (one.low, one.high, one.p_bootstrap, one.p_randomization) != (other.low, other.high, other.p_bootstrap, other.p_randomization)  # fmt: skip


def test_the_difference_interval_comes_from_sacrebleus_own_resamples(references):
    """The mean of the bootstrapped differences is the difference of the means sacreBLEU reports
    for the two systems: the same resamples, scored the same way."""
    a, b = damaged(references[:25]) + references[25:], references[:10] + damaged(references[10:])
    sacre = paired_test("bs", a, b, references, False, 200, seed=5)
    for metric, (name, (base, sys)) in zip(metrics(False).values(), sacre.items()):
        ours = bootstrap_differences(metric, a, b, references, 200, seed=5)
        assert ours.mean() == pytest.approx(sys.mean - base.mean, abs=1e-4), name


def test_a_seed_below_one_and_unequal_lengths_are_refused(references):
    with pytest.raises(ValueError, match="seed=0"):
        compare(references, references, references, seed=0)
    with pytest.raises(ValueError, match="39 and 40 hypotheses for 40 references"):
        compare(references[:-1], references, references)


def fake_run(directory, hypotheses: dict[str, list[str]], decoding: str = "beam5"):
    """A run directory as train.py leaves it, as far as scripts/lab/seed_table.py reads it."""
    (directory / ".hydra").mkdir(parents=True)
    (directory / ".hydra" / "config.yaml").write_text(f"data:\n  dir: {DATA}\n  src_lang: de\n  tgt_lang: en\n")
    for split, lines in hypotheses.items():
        (directory / f"{split}.{decoding}.en").write_text("".join(line + "\n" for line in lines))
    return directory


@pytest.mark.e2e
def test_seed_table_gives_each_seed_and_their_mean_and_spread(tmp_path, monkeypatch, capsys):
    from .test_bad_inputs import run_main

    refs = {split: [line.strip() for line in gzip.open(DATA / f"{split}.en.gz", "rt", encoding="utf-8")] for split in ("val", "test_2016_flickr")}  # fmt: skip
    perfect = fake_run(tmp_path / "perfect", refs)
    worse = fake_run(tmp_path / "worse", {split: damaged(lines) for split, lines in refs.items()})
    args = [f"runs=[{perfect},{worse}]", "splits=[val,test_2016_flickr]", f"baseline={worse}", "seed=3"]
    assert run_main("scripts/lab/seed_table.py", args, b"", monkeypatch) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(f"| {perfect} |"))
    assert row.split(" | ")[1:4] == ["100.00", "100.00", "100.00"]
    worse_bleu = float(next(line for line in out.splitlines() if line.startswith(f"| {worse} |")).split(" | ")[1])
    mean_row = next(line for line in out.splitlines() if line.startswith("| mean ± sd over 2 |"))
    mean, sd = mean_row.split(" | ")[1].split(" ± ")
    assert float(mean) == pytest.approx((100 + worse_bleu) / 2, abs=0.01)
    assert float(sd) == pytest.approx((100 - worse_bleu) / 2**0.5, abs=0.01)
    worse_test = float(next(line for line in out.splitlines() if line.startswith(f"| {worse} |")).split(" | ")[4])
    assert f"test_2016_flickr {perfect}: BLEU: baseline {worse_test:.2f}, system 100.00" in out
    assert f"val {perfect}:" not in out  # the validation split chose the recipe: only test splits are compared


@pytest.mark.e2e
def test_seed_table_compares_with_a_baseline_decoded_otherwise(tmp_path, monkeypatch, capsys):
    """An ensemble's seeds against one member's averaged checkpoint: the files are named apart."""
    from .test_bad_inputs import run_main

    refs = [line.strip() for line in gzip.open(DATA / "test_2016_flickr.en.gz", "rt", encoding="utf-8")]
    run = fake_run(tmp_path / "run", {"test_2016_flickr": refs}, decoding="ensemble.beam5")
    member = fake_run(tmp_path / "member0", {"test_2016_flickr": damaged(refs)}, decoding="avg5.beam5")
    args = [f"runs=[{run}]", "splits=[test_2016_flickr]", "decoding=ensemble.beam5", f"baseline={member}"]
    assert run_main("scripts/lab/seed_table.py", args, b"", monkeypatch) == 2
    assert f"{member}/test_2016_flickr.ensemble.beam5.en does not exist" in capsys.readouterr().err
    assert run_main("scripts/lab/seed_table.py", [*args, "baseline_decoding=avg5.beam5"], b"", monkeypatch) == 0
    out = capsys.readouterr().out
    assert f"paired tests against baseline={member}, avg5.beam5" in out
    assert f"test_2016_flickr {run}: BLEU: baseline" in out and "system 100.00" in out


def test_seed_table_names_the_missing_hypotheses_and_how_to_write_them(tmp_path, monkeypatch, capsys):
    from .test_bad_inputs import run_main

    run = fake_run(tmp_path / "run", {})
    assert run_main("scripts/lab/seed_table.py", [f"runs=[{run}]", "splits=[val]"], b"", monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"{run}/val.beam5.en does not exist; write it with: python evaluate.py checkpoint={run}/checkpoint_best.pt split=val" in err  # fmt: skip


def test_seed_table_refuses_a_baseline_with_other_line_counts(tmp_path, monkeypatch, capsys):
    from .test_bad_inputs import run_main

    refs = [line.strip() for line in gzip.open(DATA / "test_2016_flickr.en.gz", "rt", encoding="utf-8")]
    run = fake_run(tmp_path / "run", {"test_2016_flickr": refs})
    short = fake_run(tmp_path / "short", {"test_2016_flickr": refs[:10]})
    args = [f"runs=[{run}]", "splits=[test_2016_flickr]", f"baseline={short}"]
    assert run_main("scripts/lab/seed_table.py", args, b"", monkeypatch) == 2
    assert f"{short}/test_2016_flickr.beam5.en has 10 lines, its references {len(refs)}" in capsys.readouterr().err
