"""Tiny local models: deterministic by seed, cached, atomic, and both tokenizer load paths agree."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trellis.cli import main
from trellis_demo import tiny
from trellis_demo.tasks import task_texts
from trellis_demo.tiny import make_tiny_model

TEXTS = task_texts(300, seed=0)
SMALL = {"hidden_size": 32, "num_layers": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", TEXTS, **SMALL, seed=0)


def test_same_seed_same_weights_and_tokenizer(model_dir, tmp_path):
    again = make_tiny_model(tmp_path / "again", TEXTS, **SMALL, seed=0)
    a, b = load_file(model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (model_dir / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()

    other = load_file(make_tiny_model(tmp_path / "seed1", TEXTS, **SMALL, seed=1) / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_cache_hit_returns_without_building_and_new_inputs_rebuild(model_dir, monkeypatch):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("cache miss: the folder was rebuilt")

    monkeypatch.setattr(tiny, "_build", no_build)
    assert make_tiny_model(model_dir, TEXTS, **SMALL, seed=0) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(AssertionError, match="cache miss"):
        make_tiny_model(model_dir, TEXTS, **SMALL, seed=5)
    with pytest.raises(AssertionError, match="cache miss"):
        make_tiny_model(model_dir, TEXTS + ["9*9=81"], **SMALL, seed=0)


def test_rebuild_replaces_an_older_model(tmp_path):
    out = tmp_path / "m"
    make_tiny_model(out, TEXTS, **SMALL, seed=0)
    make_tiny_model(out, TEXTS, **SMALL, seed=2)
    assert json.loads((out / tiny.FINGERPRINT_FILE).read_text())["args"]["seed"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp or old folders left


def test_a_crash_leaves_no_half_folder(tmp_path, monkeypatch):
    def crash(folder, texts, args):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tiny, "_build", crash)
    with pytest.raises(RuntimeError, match="mid-build"):
        make_tiny_model(tmp_path / "m", TEXTS, **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_a_foreign_folder_and_bad_sizes(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not made by make_tiny_model"):
        make_tiny_model(tmp_path / "mine", TEXTS, **SMALL)
    with pytest.raises(ValueError, match="hidden_size=30 must divide by num_heads=4"):
        make_tiny_model(tmp_path / "x", TEXTS, hidden_size=30)
    with pytest.raises(ValueError, match="texts is empty"):
        make_tiny_model(tmp_path / "x", [])


def test_both_tokenizer_load_paths_tokenize_identically(model_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    auto = AutoTokenizer.from_pretrained(model_dir)
    plain = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    chat = auto.apply_chat_template([{"role": "user", "content": "12+345="}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n12+345=<|im_end|>\n<|im_start|>assistant\n"
    samples = ["12+34=", "#### 1234567", "987-12=975", "-5 * 10,000 = -50000", chat + "#### 357<|im_end|>", "Hello, wörld!\n\t 3.14"]
    for text in samples:
        a = auto(text, add_special_tokens=False)["input_ids"]
        b = plain(text, add_special_tokens=False)["input_ids"]
        assert a == b, text
        assert auto.decode(a) == text
    digits = auto.convert_ids_to_tokens(auto("#### 1234567", add_special_tokens=False)["input_ids"])
    assert digits == ["####", "Ġ", "1", "2", "3", "4", "5", "6", "7"]  # one token per digit
    assert (auto.eos_token, auto.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (auto.pad_token_id, auto.convert_tokens_to_ids("<|im_start|>"), auto.eos_token_id) == (0, 1, 2)


def test_model_loads_and_generates(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert model.config.vocab_size == len(tok) and model.config.tie_word_embeddings
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (2, 0)
    ids = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    enc = tok(ids, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and enc["input_ids"].shape[1] < out.shape[1] <= enc["input_ids"].shape[1] + 5


def test_untied_and_explicit_vocab(tmp_path):
    out = make_tiny_model(tmp_path / "u", TEXTS, **SMALL, tie_word_embeddings=False, vocab_size=300, intermediate_size=48)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["tie_word_embeddings"], cfg["vocab_size"], cfg["intermediate_size"]) == (False, 300, 48)
    assert "lm_head.weight" in load_file(out / "model.safetensors")


def test_cli_make_tiny_model(tmp_path, capsys):
    text = tmp_path / "texts.txt"
    text.write_text("\n".join(TEXTS[:100]) + "\n")
    out = tmp_path / "cli"
    assert main(["make-tiny-model", str(out), "--text-file", str(text), "--hidden-size", "32", "--layers", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    fp = json.loads((out / tiny.FINGERPRINT_FILE).read_text())
    assert (fp["args"]["hidden_size"], fp["args"]["num_layers"], fp["args"]["seed"], fp["num_texts"]) == (32, 1, 3, 100)
    assert main(["make-tiny-model", str(tmp_path / "y"), "--text-file", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
