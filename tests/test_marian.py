"""Import of Hugging Face MarianMT models (scripts/import_marian.py), against Hugging Face itself.

The oracle: a small, randomly initialized MarianMTModel with SentencePiece models trained here on
Multi30k and a vocab.json over both (then trained briefly by Hugging Face, so that its searches end
on their own), saved with save_pretrained and imported, must give the same
logits as Hugging Face's (teacher forcing, fp32) and the same greedy and beam-5 tokens as its
`generate` under the same settings. Needs transformers (the dev extra); no network.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from tests import forked
from tests.conftest import DATA, RemovesAFile
from transformer.checkpoint import load_model
from transformer.decoding import DecodeConfig
from transformer.decoding.strategies import STRATEGIES
from transformer.errors import DataError
from transformer.fast import accelerate
from transformer.interop.marian import read_marian, read_torch

pytestmark = pytest.mark.e2e  # every test uses a MarianMT model trained here by Hugging Face

transformers = pytest.importorskip("transformers")

SENTENCES = 200
MAX_NEW = 32  # the length limit of both searches, EOS included


def train_spm(lines: list[str], vocab_size: int) -> bytes:
    stream = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=stream, vocab_size=vocab_size, character_coverage=1.0,
        minloglevel=2, num_threads=1,
    )  # fmt: skip
    return stream.getvalue()


def multi30k(split: str, lang: str, n: int) -> list[str]:
    with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(n)]


def marian_vocab(*models: bytes) -> dict[str, int]:
    """Marian's layout: </s> 0, <unk> 1, the pieces of both models once each, <pad> last."""
    pieces = ["</s>", "<unk>"]
    for model in models:
        sp = spm.SentencePieceProcessor(model_proto=model)
        pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i))]
    pieces = list(dict.fromkeys(pieces)) + ["<pad>"]
    return {piece: i for i, piece in enumerate(pieces)}


def make_marian_dir(directory, seed: int = 0, steps: int = 300, tags: tuple[str, ...] = (), **config):
    """A small MarianMTModel with a Marian tokenizer, saved as `save_pretrained` saves OPUS-MT:
    randomly initialized, its logits bias random too, then trained for `steps` steps on Multi30k
    by Hugging Face's own loss, so that its searches end with EOS at varied lengths (a random
    model's end at once or run to the length limit). tags: target-language tokens (">>fra<<") in
    the vocabulary, as a multilingual OPUS-MT model has; the training sources start with them in turn."""
    directory.mkdir(parents=True, exist_ok=True)
    de, en = multi30k("train", "de", 4000), multi30k("train", "en", 4000)
    source, target = train_spm(de, 600), train_spm(en, 500)
    (directory / "source.spm").write_bytes(source)
    (directory / "target.spm").write_bytes(target)
    vocab = marian_vocab(source, target)
    vocab = {piece: i for i, piece in enumerate([*list(vocab)[:2], *tags, *list(vocab)[2:]])}  # Marian's: after <unk>
    de = [f"{tags[i % len(tags)]} {text}" if tags else text for i, text in enumerate(de)]
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    tokenizer = transformers.MarianTokenizer(
        str(directory / "source.spm"), str(directory / "target.spm"), str(directory / "vocab.json"),
        source_lang="de", target_lang="en",
    )  # fmt: skip
    tokenizer.save_pretrained(directory)
    pad = vocab["<pad>"]
    options = dict(
        vocab_size=len(vocab), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, activation_function="swish",
        scale_embedding=True, max_position_embeddings=128, pad_token_id=pad, decoder_start_token_id=pad,
        eos_token_id=0, forced_eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(transformers.MarianConfig(**(options | config)))
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)  # a buffer: Hugging Face does not train it
    train_briefly(model, tokenizer, de, en, steps)
    model.save_pretrained(directory)
    return model.eval(), tokenizer


def train_briefly(model, tokenizer, de: list[str], en: list[str], steps: int, batch: int = 32) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        rows = torch.randint(len(de), (batch,), generator=generator).tolist()
        inputs = tokenizer([de[i] for i in rows], text_target=[en[i] for i in rows], return_tensors="pt", padding=True)
        inputs["labels"] = inputs["labels"].masked_fill(inputs["labels"] == tokenizer.pad_token_id, -100)
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


MULTI_TAGS = (">>fra<<", ">>deu<<", ">>spa<<")


@pytest.fixture(scope="module")
def marian_multi(tmp_path_factory):
    """A multilingual one: target tokens >>fra<< >>deu<< >>spa<< in its vocabulary."""
    directory = tmp_path_factory.mktemp("marian") / "opus-mt-tiny-multi"
    hf_model, hf_tokenizer = make_marian_dir(directory, seed=1, steps=150, tags=MULTI_TAGS)
    return directory, hf_model, hf_tokenizer


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    directory = tmp_path_factory.mktemp("marian") / "opus-mt-tiny"
    hf_model, hf_tokenizer = make_marian_dir(directory)
    return directory, hf_model, hf_tokenizer


def batch_of(tokenizer, sources: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sources)
    ids = torch.full((len(sources), width), pad)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, (ids != pad).long()


def test_tokenizer_gives_hugging_face_ids(marian):
    directory, _, hf_tokenizer = marian
    _, tokenizer, _ = read_marian(directory)
    sentences = multi30k("val", "de", SENTENCES)
    ours = [ids + [tokenizer.eos_id] for ids in tokenizer.source.encode(sentences)]
    assert ours == hf_tokenizer(sentences)["input_ids"]
    targets = multi30k("val", "en", SENTENCES)
    ids = tokenizer.encode(targets)
    assert ids == [labels[:-1] for labels in hf_tokenizer(text_target=targets)["input_ids"]]
    assert tokenizer.decode(ids) == hf_tokenizer.batch_decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("runtime", ["reference", "fast"])
def test_logits_match_hugging_face(marian, runtime):
    directory, hf_model, _ = marian
    model, tokenizer, _ = read_marian(directory)
    if runtime == "fast":
        accelerate(model)
    sources = [ids + [tokenizer.eos_id] for ids in tokenizer.source.encode(multi30k("val", "de", 64))]
    targets = [[tokenizer.bos_id] + ids for ids in tokenizer.encode(multi30k("val", "en", 64))]
    src, src_attention = batch_of(tokenizer, sources, tokenizer.pad_id)
    tgt, tgt_attention = batch_of(tokenizer, targets, tokenizer.pad_id)
    tgt[:, 0] = tokenizer.bos_id
    with torch.no_grad():
        ours = model(src, tgt)
        theirs = hf_model(input_ids=src, attention_mask=src_attention, decoder_input_ids=tgt).logits
    kept = tgt_attention.bool()
    kept[:, 0] = True
    difference = (ours - theirs)[kept].abs().max().item()
    print(f"largest logit difference ({runtime}): {difference:.2e}, largest logit {theirs[kept].abs().max():.1f}")
    if runtime == "reference":  # the model as written computes what Hugging Face's does
        assert difference < 1e-4
    else:  # the speed paths sum in other orders (oneDNN products): equal up to rounding, as test_fast.py allows
        torch.testing.assert_close(ours[kept], theirs[kept], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("beam", [1, 5])
def test_search_matches_hugging_face_generate(marian, beam):
    """Both searches stop at MAX_NEW tokens with a forced EOS (Marian's forced_eos_token_id)."""
    directory, hf_model, _ = marian
    model, tokenizer, _ = read_marian(directory)
    accelerate(model)
    sentences = multi30k("test_2016_flickr", "de", SENTENCES)
    sources = tokenizer.source.encode(sentences)
    strategy = "greedy" if beam == 1 else "beam"
    cfg = DecodeConfig(strategy=strategy, beam_size=beam, length_penalty=0.0, max_len_a=0.0, max_len_b=MAX_NEW)
    ours = translate_ids(model, tokenizer, sources, cfg)
    ids, attention = batch_of(tokenizer, [s + [tokenizer.eos_id] for s in sources], tokenizer.pad_id)
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids, attention_mask=attention, num_beams=beam, do_sample=False, max_new_tokens=MAX_NEW,
            length_penalty=0.0, early_stopping=False, bad_words_ids=[[tokenizer.pad_id]], num_return_sequences=1,
        )  # fmt: skip
    theirs = [[t for t in row[1:] if t != tokenizer.pad_id] for row in out.tolist()]
    theirs = [row[: row.index(tokenizer.eos_id)] if tokenizer.eos_id in row else row for row in theirs]
    ended = sum(len(t) < MAX_NEW - 1 for t in theirs)
    print(f"beam {beam}: {ended} of {SENTENCES} translations end before the length limit")
    if beam > 1:  # a briefly trained model's greedy search mostly repeats itself up to the limit
        assert ended > 3 * SENTENCES // 4
    assert ours == theirs


def translate_ids(model, tokenizer, sources: list[list[int]], cfg: DecodeConfig) -> list[list[int]]:
    """Our decoding of token-id sources, as token ids (no BOS/EOS)."""
    out = []
    for start in range(0, len(sources), 50):
        chunk = sources[start : start + 50]
        src, _ = batch_of(tokenizer, [s + [tokenizer.eos_id] for s in chunk], tokenizer.pad_id)
        hypotheses = STRATEGIES[cfg.strategy].search(model, src, tokenizer.bos_id, tokenizer.eos_id, cfg)
        out += [h[0].tokens for h in hypotheses]
    return out


def run(args: list[str]) -> subprocess.CompletedProcess:
    """`python *args`, its own process forked from a warm interpreter (tests/forked.py)."""
    return forked.run(args, timeout=900)


@pytest.fixture(scope="module")
def imported(marian, tmp_path_factory) -> Path:
    directory = marian[0]
    output = tmp_path_factory.mktemp("imported") / "opus-mt-tiny.pt"
    result = run(["scripts/import_marian.py", f"path={directory}", f"output={output}"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "de->en" in result.stdout
    return output


def test_imported_checkpoint_translates_as_hugging_face(marian, imported, tmp_path):
    """The checkpoint through translate.py: text in, the text Hugging Face's greedy search gives out."""
    directory, hf_model, hf_tokenizer = marian
    model, tokenizer, payload = load_model(imported)
    assert payload["imported_from"]["path"] == str(directory)
    assert tokenizer.same_as(read_marian(directory)[1])
    sentences = multi30k("test_2016_flickr", "de", 20)
    (tmp_path / "in.de").write_text("".join(s + "\n" for s in sentences))
    result = run(["translate.py", f"checkpoint={imported}", f"input={tmp_path / 'in.de'}", "decode.strategy=greedy",
                  "decode.max_len_a=0", f"decode.max_len_b={MAX_NEW}"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    batch = hf_tokenizer(sentences, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf_model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=MAX_NEW, bad_words_ids=[[tokenizer.pad_id]])  # fmt: skip
    assert result.stdout.splitlines() == hf_tokenizer.batch_decode(out, skip_special_tokens=True)


def test_pytorch_weights_import_as_safetensors_do(marian, tmp_path):
    directory, hf_model, _ = marian
    copy = tmp_path / "bin"
    shutil.copytree(directory, copy)
    (copy / "model.safetensors").unlink()
    torch.save(hf_model.state_dict(), copy / "pytorch_model.bin")
    a, b = read_marian(directory)[0], read_marian(copy)[0]
    assert all(torch.equal(a.state_dict()[k], t) for k, t in b.state_dict().items())


def edited_dir(directory: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(directory, copy)
    edit(copy)
    return copy


def edit_config(**changes):
    def edit(path: Path):
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | changes))

    return edit


REFUSALS = {
    "separate vocabularies": (edit_config(share_encoder_decoder_embeddings=False), "share_encoder_decoder_embeddings"),
    "unscaled embeddings": (edit_config(scale_embedding=False), "scale_embedding"),
    "another activation": (edit_config(activation_function="tanh"), "activation_function"),
    "not marian": (edit_config(model_type="bart"), "model_type"),
    "no weights": (lambda p: (p / "model.safetensors").unlink(), "has no weights"),
    "no source.spm": (lambda p: (p / "source.spm").unlink(), "source.spm does not exist"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_cannot_be_imported_is_refused_in_one_line(marian, tmp_path, case):
    edit, named = REFUSALS[case]
    directory = edited_dir(marian[0], tmp_path, edit)
    output = tmp_path / "out.pt"
    result = run(["scripts/import_marian.py", f"path={directory}", f"output={output}"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], result.stderr
    assert not output.exists()


def test_an_existing_checkpoint_is_not_overwritten(marian, imported):
    before = imported.read_bytes()
    result = run(["scripts/import_marian.py", f"path={marian[0]}", f"output={imported}"])
    assert result.returncode == 2 and "existing checkpoint" in result.stderr
    assert imported.read_bytes() == before


def test_an_imported_model_finetunes_with_its_tokenizer(imported, shared_corpus, tmp_path):
    """init_from= an imported checkpoint: a few steps on Multi30k (the logits bias trains through
    the chunked loss), the run keeping Marian's tokenizer and vocabulary byte for byte."""
    run_dir = tmp_path / "run"
    result = run(["train.py", f"init_from={imported}", "experiment=smoke", f"data.dir={shared_corpus}",
                  f"hydra.run.dir={run_dir}", "trainer.max_steps=4", "trainer.eval_every=4", "trainer.eval_bleu=false",
                  "data.test_splits=[]", "trainer.freeze=[encoder]"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    _, tokenizer, payload = load_model(run_dir / "checkpoint_last.pt")
    _, original, source = load_model(imported)
    assert tokenizer.same_as(original) and tokenizer.vocabulary is not None
    assert (run_dir / "spm.vocab.json").is_file() and (run_dir / "spm.src.model").is_file()
    assert payload["step"] == 4
    assert not torch.equal(payload["model"]["logits_bias"], source["model"]["logits_bias"])
    assert (
        json.loads((run_dir / "init_from.json").read_text())["imported_from"]["path"] == source["imported_from"]["path"]
    )


def test_an_imported_model_exports_to_ctranslate2_and_decodes_as_ours(imported, tmp_path):
    """Its <pad> start token, SiLU, position table and logits bias carried over: greedy search
    token for token (beam search is compared in test_export.py's marian_block)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transformer.decoding import translate_ids as our_ids
    from transformer.interop.export import translate_ids as ctranslate2_ids

    result = run(["scripts/export_ctranslate2.py", f"checkpoint={imported}", f"output={tmp_path / 'ct2'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert {"spm.model", "spm.src.model"} <= {p.name for p in (tmp_path / "ct2").iterdir()}
    model, tokenizer, _ = load_model(imported)
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    sources = tokenizer.source.encode(multi30k("test_2016_flickr", "de", SENTENCES))
    cfg = DecodeConfig(strategy="greedy", max_len_a=0.0, max_len_b=MAX_NEW)
    ours = [hyps[0].tokens for hyps in our_ids(model, sources, tokenizer, cfg, "cpu")]
    assert ours == ctranslate2_ids(translator, tokenizer, sources, cfg, model.cfg.max_positions)


def test_a_multilingual_model_imports_and_translates_into_each_language_as_hugging_face(marian_multi, tmp_path):
    """Target tokens (>>fra<<) become tags: translate.py tgt_lang=fra gives, token for token, what
    Hugging Face's generate gives for ">>fra<< " + the sentence, for each language; without
    tgt_lang= it refuses, naming the languages."""
    directory, hf_model, hf_tokenizer = marian_multi
    output = tmp_path / "multi.pt"
    result = run(["scripts/import_marian.py", f"path={directory}", f"output={output}"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "de->deu,fra,spa" in result.stdout
    _, tokenizer, payload = load_model(output)
    assert tokenizer.target_tags == {tag[2:-2]: hf_tokenizer.convert_tokens_to_ids(tag) for tag in MULTI_TAGS}
    assert payload["train_config"]["data"]["directions"] == ["de-deu", "de-fra", "de-spa"]
    sentences = multi30k("test_2016_flickr", "de", 12)
    (tmp_path / "in.de").write_text("".join(s + "\n" for s in sentences))
    for tag in MULTI_TAGS:
        result = run(["translate.py", f"checkpoint={output}", f"input={tmp_path / 'in.de'}", f"tgt_lang={tag[2:-2]}",
                      "decode.beam_size=4", "decode.length_penalty=0", "decode.max_len_a=0", f"decode.max_len_b={MAX_NEW}"])  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        batch = hf_tokenizer([f"{tag} {s}" for s in sentences], return_tensors="pt", padding=True)
        assert (batch["input_ids"][:, 0] == tokenizer.target_tags[tag[2:-2]]).all()
        with torch.no_grad():
            out = hf_model.generate(**batch, num_beams=4, do_sample=False, max_new_tokens=MAX_NEW, length_penalty=0.0,
                                    early_stopping=False, bad_words_ids=[[tokenizer.pad_id]])  # fmt: skip
        assert result.stdout.splitlines() == hf_tokenizer.batch_decode(out, skip_special_tokens=True), tag
    result = run(["translate.py", f"checkpoint={output}", f"input={tmp_path / 'in.de'}"])
    assert result.returncode == 2 and "translates into deu, fra, spa: choose one with tgt_lang=" in result.stderr


def test_pytorch_weights_that_run_code_are_refused_without_advice_to_load_them_unsafely(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    torch.save({"model.shared.weight": RemovesAFile(victim)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(DataError) as refused:
        read_torch(tmp_path / "pytorch_model.bin")
    message = str(refused.value)
    assert "was refused as unsafe" in message and "posix.remove" in message and "\n" not in message
    assert "weights_only" not in message and "can still be loaded" not in message
    assert victim.read_text() == "keep me\n"
