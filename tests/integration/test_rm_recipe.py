"""Reward models end to end on the tiny model: the rm recipe raises held-out pair accuracy, its
export scores in plain transformers as in the trainer, the rl recipe's reward_model role scores
as a direct forward does, and a bad reward.model is refused before anything is built."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from trellis.batch import Batch
from trellis.config import ConfigError, compose
from trellis.data import load_rows
from trellis.export import export_checkpoint
from trellis.interfaces.rollout import SamplingParams, rollout_batch
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis.runtime.worker import build_worker
from trellis_algos.pairs import PairDataset
from trellis_algos.rewards import RewardConfig, RewardManager
from trellis_demo.tasks import make_arithmetic_pairs, make_arithmetic_split, write_rows
from trellis_judges.reward_model import ModelReward


def separable(rows):
    """Right answers against a refusal: pairs a tiny model tells apart in a few steps."""
    return [{**p, "rejected": [{"role": "assistant", "content": "no idea"}]} for p in make_arithmetic_pairs(rows, 0)]


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    return {
        "train": str(write_rows(separable(make_arithmetic_split(64, 0, max_value=50)), folder / "train.jsonl")),
        "val": str(write_rows(separable(make_arithmetic_split(12, 0, split="test", max_value=50)), folder / "val.parquet")),
    }


@pytest.fixture(scope="module")
def rm_run(tiny_model_path, pair_files, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rm") / "run"
    summary = train(
        None,
        [
            "recipe=rm",
            f"model.path={tiny_model_path}",
            f"data.train_path={pair_files['train']}",
            f"data.val_path={pair_files['val']}",
            "data.batch_pairs=16",
            "train.optim.lr=3e-3",
            "trainer.total_steps=8",
            "trainer.trackers=[jsonl]",
            f"trainer.run_dir={run_dir}",
            "trainer.save_hf_model=true",
        ],
    )
    return summary, run_dir


def test_training_raises_held_out_accuracy(rm_run):
    summary, _ = rm_run
    before, after = summary["val_before"], summary["val_after"]
    assert before["val/accuracy"] < 0.5 and after["val/accuracy"] == 1.0, (before, after)
    assert after["val/loss"] < 0.5 * before["val/loss"] and after["val/margin"] > 1.0
    assert {"rm/loss", "rm/accuracy", "rm/margin"} <= set(summary["final"])


def hf_scores(model, sequences: list[list[int]], pad: int) -> torch.Tensor:
    """Scores of a right-padded batch through the folder's own pooling (its last non-pad token)."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def test_export_loads_in_transformers_with_the_trainers_scores(rm_run, pair_files, tmp_path):
    summary, run_dir = rm_run
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "hf_model")
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    pairs = PairDataset(load_rows(pair_files["val"], required=("chosen", "rejected")), tokenizer, 256).items
    chosen = hf_scores(model, [p["chosen"] for p in pairs], tokenizer.pad_token_id)
    rejected = hf_scores(model, [p["rejected"] for p in pairs], tokenizer.pad_token_id)
    diff = (chosen - rejected).double()
    # the trainer's held-out figures at its final weights, from transformers' scores
    after = summary["val_after"]
    assert float(-torch.nn.functional.logsigmoid(diff).mean()) == pytest.approx(after["val/loss"], abs=1e-5)
    assert float(diff.mean()) == pytest.approx(after["val/margin"], abs=1e-5)
    assert float((diff > 0).double().mean()) == after["val/accuracy"]

    exported = export_checkpoint(run_dir, tmp_path / "exported")  # trellis export of the checkpoint: the same folder
    final, again = load_file(run_dir / "hf_model" / "model.safetensors"), load_file(exported / "model.safetensors")
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)


def test_rl_reward_model_scores_equal_a_direct_forward(rm_run, tiny_model_path, make_prompts):
    _, run_dir = rm_run
    folder = str(run_dir / "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    registry = load_plugins().registry
    role = build_worker(registry, "fsdp", "reward_model", folder, None, head="reward")
    prompts = make_prompts(tokenizer, ["3+4=", "12+30="])
    prompts = Batch(prompts.tensors, {"data_source": ["arithmetic"] * 2, "ground_truth": ["7", "42"]})
    eos = tokenizer.eos_token_id
    answers = [tokenizer.encode("#### 7") + [eos], tokenizer.encode("#### 9"), tokenizer.encode("no") + [eos], []]
    width = max(map(len, answers))
    responses = torch.tensor([a + [tokenizer.pad_token_id] * (width - len(a)) for a in answers])
    mask = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers])
    batch = rollout_batch(prompts, SamplingParams(n=2), responses, mask, torch.zeros(mask.shape))
    gsm8k = RewardManager(RewardConfig(terms=[{"name": "gsm8k", "weight": 0.5}]), registry, tokenizer)
    scored = ModelReward(role, 2.0, "reward_model", gsm8k).score(batch)

    model = AutoModelForSequenceClassification.from_pretrained(folder)
    direct = []
    for i in range(len(answers)):  # each sample alone, no padding: its last token is the sample's own
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        with torch.no_grad():
            direct.append(float(model(input_ids=ids[None]).logits[0, 0]))
    direct = torch.tensor(direct)
    torch.testing.assert_close(scored.components["reward_model"], direct, atol=1e-5, rtol=0)
    right = torch.tensor([1.0, 0.0, 0.0, 0.0])  # gsm8k: only "#### 7" answers 3+4 right ("#### 9" is sample 2 of the same prompt)
    torch.testing.assert_close(scored.scores, 2.0 * direct + 0.5 * right, atol=1e-5, rtol=0)
    # the score sits on each response's last token; the empty response gets none
    assert scored.token_scores[0, len(answers[0]) - 1] == pytest.approx(float(scored.scores[0]), abs=1e-6)
    assert scored.token_scores[3].abs().sum() == 0 and scored.token_scores[:3].count_nonzero() == 3
    assert scored.metrics["reward/gsm8k"] == pytest.approx(0.25) and scored.metrics["reward/reward_model"] == pytest.approx(float(direct.mean()))


def test_rl_run_with_a_reward_model(rm_run, run_rl):
    _, run_dir = rm_run
    summary, rows = run_rl(f"reward.model.path={run_dir / 'hf_model'}", "trainer.total_steps=1")
    step = next(r for r in rows if "reward/reward_model" in r)
    assert step["reward/mean"] == pytest.approx(step["reward/reward_model"]) and step["reward/max"] > step["reward/min"]
    assert set(summary["val_after"]) == {"greedy_reward_mean", "reward_mean"}


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        train(None, ["recipe=rl", *overrides], dry_run=True)
    return str(caught.value)


def test_bad_reward_models_are_refused_before_any_model_is_built(rm_run, tiny_model_path, data_files):
    _, run_dir = rm_run
    base = [f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}"]
    assert "reward.model.pth" in refused(*base, f"reward.model.pth={run_dir / 'hf_model'}")
    message = refused(*base, f"reward.model.path={tiny_model_path}")  # a causal LM has no reward head
    assert "'reward.model.path'" in message and "Qwen2ForCausalLM" in message and "one label" in message
    message = refused(*base, f"reward.model.path={run_dir / 'hf_model'}", "reward.name=math")
    assert "reward.model.path" in message and "reward.terms" in message
    message = refused(*base, "trainer.separate_pools=[reward_model]")
    assert "'trainer.separate_pools'" in message and "reward.model.path" in message
    with pytest.raises(ConfigError, match="reward.model.path"):
        train(None, ["recipe=spin", *base, f"reward.model.path={run_dir / 'hf_model'}"], dry_run=True)


def test_a_reward_name_beside_a_reward_model_is_refused_and_the_rl_starter_leaves_it_unset(rm_run, tiny_model_path, data_files, tmp_path):
    """reward.model.path alone is the reward: a reward.name given too would be ignored, so it is
    refused naming the spelling that unsets it; the rl starter leaves reward.name unset (null: gsm8k
    without a reward model), so adding reward.model.path to it just works."""
    _, run_dir = rm_run
    out = subprocess.run([sys.executable, "-m", "trellis.cli", "config", "init", "rl"], cwd=tmp_path, capture_output=True, text=True)
    (tmp_path / "rl.yaml").write_text(out.stdout)
    given = [f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", f"reward.model.path={run_dir / 'hf_model'}"]
    with pytest.raises(ConfigError, match=r"'reward.model.path' is set together with reward.name='gsm8k'.*unset those \(reward.name=null\)"):
        train(str(tmp_path / "rl.yaml"), [*given, "reward.name=gsm8k"], dry_run=True)
    assert train(str(tmp_path / "rl.yaml"), given, dry_run=True)["data"].startswith("64 training prompts")
    assert train(None, ["recipe=rl", *given], dry_run=True)["data"].startswith("64 training prompts")


def test_starter_holds_the_defaults_and_passes_the_dry_run(tiny_model_path, pair_files, tmp_path):
    out = subprocess.run([sys.executable, "-m", "trellis.cli", "config", "init", "rm"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("# A starter config for the rm recipe"), out.stderr
    (tmp_path / "rm.yaml").write_text(out.stdout)
    paths = [f"model.path={tiny_model_path}", f"data.train_path={pair_files['train']}", f"data.val_path={pair_files['val']}"]
    registry = load_plugins().registry
    starter, defaults = compose(tmp_path / "rm.yaml", paths, registry), compose(None, ["recipe=rm", *paths], registry)
    assert OmegaConf.to_container(starter) == OmegaConf.to_container(defaults)
    assert train(str(tmp_path / "rm.yaml"), paths, dry_run=True)["data"] == "64 training pairs, 12 held-out"


def test_prompt_data_given_to_the_rm_recipe_is_refused_naming_the_pair_columns(tiny_model_path, data_files, tmp_path):
    """RL prompts (verl's schema) given as the rm recipe's data stop the dry run naming the pair
    columns the recipe reads (the error recommended the RL schema, which it had been given)."""
    from trellis.data import DataError

    overrides = ["recipe=rm", f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", f"trainer.run_dir={tmp_path / 'run'}"]
    with pytest.raises(DataError) as refused:
        train(None, overrides, dry_run=True)
    assert str(refused.value) == (
        f"data file {data_files['train']!r}: row 0 has no column 'chosen' (columns: ['ability', 'data_source', 'extra_info', 'prompt', "
        "'reward_model']); add it to every row (the rm recipe's preference pairs: chosen and rejected, each chat messages or an answer "
        "string after a shared prompt column; optional margin)"
    )


@pytest.mark.parametrize("key", ["reward.model.path", "teacher.path"])
def test_a_run_folder_as_a_reward_model_or_teacher_says_export_it_first(rm_run, tiny_model_path, data_files, key):
    """A trellis run folder where a model folder goes stops the dry run naming the run's own
    hf_model and the export that writes one (the reward model got 'not a Hugging Face model folder
    (no config.json)', the teacher a tokenizer library's 'Couldn't instantiate the backend tokenizer')."""
    _, run_dir = rm_run
    teacher = ["actor.distill.coef=1.0"] if key == "teacher.path" else []
    message = refused(f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", f"{key}={run_dir}", *teacher)
    assert message == (
        f"config key {key!r}: {str(run_dir)!r} is a trellis run folder, not a Hugging Face model folder; export it first: "
        f"trellis export {run_dir} {run_dir}-hf, then set {key}={run_dir}-hf (or set {key}={run_dir / 'hf_model'}, the model the "
        "run saved at its end)"
    )
