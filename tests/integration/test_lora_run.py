"""Runs that train a LoRA adapter: the KL loss's reference is the actor with its adapter off (no
``ref`` role); the run's final policy and ``trellis export`` are the same plain Hugging Face model;
the checkpoint holds the adapter alone, with the fingerprint of its base; ``--adapter-only``
writes a folder PEFT loads; the sft recipe takes an adapter too."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_runs import run_cli
from safetensors.torch import load_file, save_file

from trellis import export
from trellis.config import ConfigError
from trellis.export import export_checkpoint
from trellis.runtime.checkpoint import base_fingerprint

# a reward with signal on an untrained model: the response's length
LENGTH_REWARD = """
def length(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 20
"""


def test_an_adapter_run_uses_the_adapter_off_as_its_reference_and_exports_a_plain_model(run_rl, tmp_path, tiny_model_path):
    run_dir = tmp_path / "lora"
    reward = tmp_path / "length.py"
    reward.write_text(LENGTH_REWARD)
    _, rows = run_rl(
        "actor.adapter.rank=4", "actor.use_kl_loss=true", "actor.optim.lr=1e-2", "trainer.save_hf_model=true",
        f"reward.path={reward}", "reward.name=length", run_dir=run_dir,
    )  # fmt: skip
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # step 1: B = 0, so the adapted actor is the base model and the KL to it is exactly 0;
    # step 2: the adapter has moved the actor away from it
    assert steps[0]["actor/kl_loss"] == 0.0 and "timing/ref_s" in steps[0]
    assert steps[1]["actor/kl_loss"] > 0.0
    saved = dcp.FileSystemReader(str(run_dir / "checkpoint-2" / "actor")).read_metadata().state_dict_metadata
    assert all(".lora_A." in k or ".lora_B." in k for k in saved if k.startswith("model."))  # the adapter only

    final = load_file(str(run_dir / "hf_model" / "model.safetensors"))
    base = load_file(f"{tiny_model_path}/model.safetensors")
    assert set(final) == set(base)  # plain names: no base_layer / lora_A / lora_B
    assert torch.equal(final["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted
    assert not torch.equal(final["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])

    exported = export_checkpoint(run_dir, tmp_path / "exported")
    again = load_file(str(exported / "model.safetensors"))
    assert all(torch.equal(again[k], final[k]) for k in final)


def _trellis(*args: str):
    """The ``trellis`` command as a user types it."""
    return run_cli(*args, cwd=".")


def _loads_no_model(monkeypatch) -> None:
    """From here on ``trellis export`` fails the test if it builds a role (and so loads a model)."""

    def spawn(*args, **kwargs):
        raise AssertionError("trellis export built a model")

    monkeypatch.setattr(export, "spawn_worker", spawn)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_adapter_alone_exports_as_a_peft_folder_that_loads_onto_the_base(run_rl, tmp_path, tiny_model_path, monkeypatch):
    """``trellis export RUN OUT --adapter-only``: PEFT's own loader puts it on the base model, and
    the result computes what the merged export computes; a full-weights run has no adapter to
    export, which is refused before any model is loaded (it loaded the whole model first)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reward = tmp_path / "length.py"
    reward.write_text(LENGTH_REWARD)
    run_dir = tmp_path / "lora"
    run_rl("actor.adapter.rank=4", "actor.adapter.target_modules=[q_proj,v_proj]", "actor.optim.lr=1e-2",
           f"reward.path={reward}", "reward.name=length", run_dir=run_dir)  # fmt: skip
    out = _trellis("export", str(run_dir), str(tmp_path / "adapter"), "--adapter-only")
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == ["q_proj", "v_proj"] and config["base_model_name_or_path"] == tiny_model_path
    assert (folder / "tokenizer_config.json").is_file() and (folder / "trellis_export.json").is_file()

    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), str(folder)).eval()
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(run_dir, tmp_path / "merged")).eval()
    ids = torch.tensor([[5, 9, 17, 30, 41, 2, 7]])
    assert (_logits(adapted, ids) - _logits(merged, ids)).abs().max() < 1e-5
    assert (_logits(adapted, ids) - _logits(AutoModelForCausalLM.from_pretrained(tiny_model_path), ids)).abs().max() > 1e-4  # it trained

    full = tmp_path / "full"
    run_rl(run_dir=full)
    _loads_no_model(monkeypatch)
    refused = _trellis("export", str(full), str(tmp_path / "none"), "--adapter-only")
    assert refused.returncode == 2 and refused.stderr.splitlines()[-1] == (
        f"trellis: error: trellis export --adapter-only: the actor of checkpoint {full / 'checkpoint-2'} trains full weights: there is "
        "no adapter to export alone; export the merged model (without --adapter-only)"
    )


def _change_weights(model: Path) -> str:
    """Other weights in the model folder ``model`` (its final norm moved); returns their fingerprint's SHA-256."""
    weights = load_file(str(model / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1.0
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    return base_fingerprint(model)["sha256"]


def test_an_adapter_checkpoint_refuses_a_base_model_with_other_weights(run_rl, tmp_path, tiny_model_path, monkeypatch):
    """The checkpoint records the base model's weights' SHA-256: resuming onto another base model
    stops at the config check, before any model is built (it was a traceback at load), and
    replacing the base (another download, another revision) stops the export before it loads a
    model (it loaded the whole model first), naming both."""
    base, other = tmp_path / "base", tmp_path / "other"
    shutil.copytree(tiny_model_path, base)
    run_dir = tmp_path / "lora"
    run_rl(f"model.path={base}", "actor.adapter.rank=4", run_dir=run_dir)
    recorded = json.loads((run_dir / "checkpoint-2" / "actor" / "base_model.json").read_text())
    assert recorded == base_fingerprint(base) and recorded["path"] == str(base) and len(recorded["sha256"]) == 64
    trained_on = (
        f"the adapter in {run_dir / 'checkpoint-2' / 'actor'} was trained on the base model {str(base)!r} "
        f"(weights sha256 {recorded['sha256'][:12]}...)"
    )

    shutil.copytree(base, other)
    other_sha = _change_weights(other)
    with pytest.raises(ConfigError) as refused:
        run_rl(f"model.path={other}", "actor.adapter.rank=4", "trainer.resume_allow_changes=[model.path]", "trainer.total_steps=3", run_dir=run_dir)
    assert str(refused.value) == (
        f"config key 'model.path'={str(other)!r}: {trained_on}, but {str(other)!r} holds other weights (sha256 {other_sha[:12]}...); "
        "an adapter fits only its own base: set model.path to that model, or start a new run (another trainer.run_dir)"
    )

    changed_sha = _change_weights(base)
    _loads_no_model(monkeypatch)
    with pytest.raises(ConfigError) as refused:
        export_checkpoint(run_dir, tmp_path / "merged")
    assert str(refused.value) == (
        f"trellis export: {trained_on}, but {str(base)!r} holds other weights (sha256 {changed_sha[:12]}...); an adapter fits only "
        "its own base, which the export reads from the run's model.path: put that model back there"
    )


def test_sft_trains_an_adapter_and_exports_it_merged(tmp_path, tiny_model_path, data_files):
    """The sft recipe's ``train.adapter``: only the adapter is checkpointed, and the export merges it."""
    from trellis.recipes.train import train

    run_dir = tmp_path / "sft"
    train(None, [
        "recipe=sft", f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", "data.batch_samples=8",
        "train.adapter.rank=4", "train.optim.lr=1e-2", "trainer.total_steps=2", "trainer.trackers=[jsonl]", f"trainer.run_dir={run_dir}",
    ])  # fmt: skip
    saved = dcp.FileSystemReader(str(run_dir / "checkpoint-2" / "actor")).read_metadata().state_dict_metadata
    assert all(".lora_A." in k or ".lora_B." in k for k in saved if k.startswith("model."))
    merged = load_file(str(export_checkpoint(run_dir, tmp_path / "merged") / "model.safetensors"))
    base = load_file(f"{tiny_model_path}/model.safetensors")
    assert set(merged) == set(base) and not torch.equal(merged["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize(
    ("more", "message"),
    [
        ((), r"^config key 'actor.adapter.rank'=8 needs peft: pip install 'trellis-backend-fsdp\[lora\]', or set it to 0$"),
        (("backend.name=plain",), r"^config key 'actor.adapter.rank'=8: backend 'plain' trains full weights only; set it to 0, or use backend.name="),
    ],
    ids=["peft-missing", "backend-without-adapters"],
)
def test_an_adapter_the_backend_cannot_train_stops_the_dry_run(tiny_model_path, tmp_path, monkeypatch, more, message):
    """A LoRA actor with peft not installed, or on a backend that trains no adapter, stops at the
    config check (``--dry-run`` included) naming what to install or set, before any model is built;
    without the adapter the same dry run passes."""
    from trellis.config import ConfigError
    from trellis.recipes.train import train
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    data = write_rows(make_arithmetic_split(8, 0, max_value=30), tmp_path / "train.parquet")
    overrides = ["recipe=rl", f"model.path={tiny_model_path}", f"data.train_path={data}", "data.train_batch_prompts=2", *more]
    if not more:
        monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ConfigError, match=message):
        train(None, [*overrides, "actor.adapter.rank=8", f"trainer.run_dir={tmp_path / 'run'}"], dry_run=True)
    assert train(None, [*overrides, f"trainer.run_dir={tmp_path / 'run'}"], dry_run=True)["recipe"] == "rl"


@pytest.mark.parametrize(
    ("targets", "given", "unmatched"),
    [("[qproj,v_proj]", "['qproj', 'v_proj']", "'qproj'"), ("[self_attn]", "['self_attn']", "'self_attn'")],
    ids=["a-typo-beside-a-match", "not-a-linear-layer"],
)
def test_target_modules_naming_no_linear_layer_stop_the_dry_run(tiny_model_path, data_files, tmp_path, targets, given, unmatched):
    """A ``target_modules`` name matching no linear layer of the model stops the config check
    (``--dry-run`` included), naming the layers the model has: alone it stopped the run at build
    with PEFT's traceback, and beside a name that matched it was silently ignored."""
    from trellis.config import ConfigError
    from trellis.recipes.train import train

    overrides = [
        "recipe=rl", f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", "data.train_batch_prompts=2",
        "actor.adapter.rank=4", f"actor.adapter.target_modules={targets}", f"trainer.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        train(None, overrides, dry_run=True)
    assert str(refused.value) == (
        f"config key 'actor.adapter.target_modules'={given}: the model in model.path {tiny_model_path!r} has no linear layer named "
        f"{unmatched}; its linear layers are named down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj: choose among "
        "them, or use [all-linear]"
    )
