"""A reward model with its own tokenizer and chat template: the rl recipe's reward_model role
scores each sample re-rendered and re-tokenized for it, equal to plain transformers on the text
rendered by hand; a reward model sharing the actor's tokenizer keeps scoring the token ids."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from trellis.batch import Batch, position_ids
from trellis.config import ConfigError
from trellis.interfaces.rollout import SamplingParams, rollout_batch
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis.runtime.worker import build_worker
from trellis_demo.tiny import make_tiny_model
from trellis_judges.reward_inputs import RewardInputs, retokenize_reason
from trellis_judges.reward_model import ModelReward

# another rendering than the actor's ChatML: "role: content" turns, no newlines
OTHER_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + ': ' + message['content'] + '<|im_end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant: ' }}{%- endif %}"
)
CONTEXT = 40  # the reward model's max_position_embeddings: the long answer below is cut to it


@pytest.fixture(scope="module")
def other_rm(tmp_path_factory):
    """A one-label sequence-classification folder on a tokenizer trained on other text with a
    smaller vocabulary, and another chat template."""
    texts = [f"{a} plus {b} is {a + b}" for a in range(30) for b in range(0, 30, 3)]
    base = make_tiny_model(tmp_path_factory.mktemp("models") / "other", texts, hidden_size=32, num_layers=1, vocab_size=290, seed=3)
    folder = tmp_path_factory.mktemp("other-rm") / "rm"
    config = AutoConfig.from_pretrained(base, num_labels=1, max_position_embeddings=CONTEXT)
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores well apart from 0
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = OTHER_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_same_means_one_vocabulary_and_one_chat_template(tiny_model_path, other_rm):
    policy = AutoTokenizer.from_pretrained(tiny_model_path)
    assert retokenize_reason(policy, AutoTokenizer.from_pretrained(tiny_model_path)) == ""
    assert "vocabularies" in retokenize_reason(policy, AutoTokenizer.from_pretrained(other_rm))
    templated = AutoTokenizer.from_pretrained(tiny_model_path)
    templated.chat_template = OTHER_TEMPLATE
    assert retokenize_reason(policy, templated) == "chat templates"


def rollout(tokenizer, answers: list[list[int]]) -> Batch:
    """Two prompts' rollout batch (n=2) with chat messages in ``raw_prompt``, as the rl recipe holds it."""
    messages = [[{"role": "user", "content": "3+4="}], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+30="}]]
    rendered = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in rendered]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    prompts = Batch(
        {"input_ids": torch.tensor([[pad] * (width - len(x)) + x for x in ids]), "attention_mask": mask, "position_ids": position_ids(mask)},
        {"raw_prompt": messages},
    )
    width = max(map(len, answers))
    responses = torch.tensor([a + [pad] * (width - len(a)) for a in answers])
    response_mask = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers])
    return rollout_batch(prompts, SamplingParams(n=2), responses, response_mask, torch.zeros(response_mask.shape))


def test_retokenizing_for_the_policys_own_tokenizer_gives_the_rollouts_ids(tiny_model_path):
    # the layout the rm recipe trains on is the one the policy generates: re-rendering with the
    # policy's own tokenizer and template gives back each sample's token ids exactly
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    eos = tokenizer.eos_token_id
    answers = [tokenizer.encode("#### 7") + [eos], tokenizer.encode("#### 9"), tokenizer.encode("42") + [eos], []]
    batch = rollout(tokenizer, answers)
    again = RewardInputs(tokenizer, tokenizer, 512)(batch)
    for i in range(len(batch)):
        assert again["input_ids"][i][again["attention_mask"][i].bool()].tolist() == batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
    # without the rows' chat messages there is nothing to re-render: refused, naming the field
    with pytest.raises(ValueError, match="'raw_prompt'"):
        RewardInputs(tokenizer, tokenizer, 512)(batch.select(*[k for k in batch.keys() if k != "raw_prompt"]))


def test_own_tokenizer_scores_equal_transformers_on_the_texts_rendered_by_hand(tiny_model_path, other_rm, caplog):
    policy = AutoTokenizer.from_pretrained(tiny_model_path)
    eos = policy.eos_token_id
    long = "#### " + "1234567890" * 3
    answers = [policy.encode("#### 7") + [eos], policy.encode("#### 9"), policy.encode(long) + [eos], []]
    batch = rollout(policy, answers)
    reward_tok = AutoTokenizer.from_pretrained(other_rm)
    role = build_worker(load_plugins().registry, "fsdp", "reward_model", other_rm, None, head="reward")
    with caplog.at_level(logging.WARNING, logger="trellis"):
        scored = ModelReward(role, 1.0, "reward_model", None, RewardInputs(policy, reward_tok, CONTEXT)).score(batch)
    assert "1 of 4 samples are longer than the reward model's 40 tokens" in caplog.text

    # by hand: the reward model's template over the messages, the answer's text, and its eos
    # (the policy's eos ended the answer) or nothing (the answer was cut by the length limit)
    def render(messages):
        return reward_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    first = [{"role": "user", "content": "3+4="}]
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+30="}]
    texts = [render(first) + "#### 7<|im_end|>", render(first) + "#### 9", render(second) + long + "<|im_end|>", render(second)]
    model = AutoModelForSequenceClassification.from_pretrained(other_rm)
    direct = []
    for text in texts:
        ids = reward_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, -CONTEXT:]  # the long one keeps its end
        with torch.no_grad():
            direct.append(float(model(input_ids=ids).logits[0, 0]))
    direct = torch.tensor(direct)
    assert len(reward_tok(texts[2], add_special_tokens=False)["input_ids"]) > CONTEXT
    torch.testing.assert_close(scored.components["reward_model"], direct, atol=1e-5, rtol=0)
    assert direct.std() > 0.1  # the four scores differ: no sample scored as another


def test_rl_run_with_a_reward_model_of_its_own_tokenizer(other_rm, run_rl, monkeypatch):
    seen = []  # the batches the reward model was given: its re-tokenized inputs, not the policy's ids
    real = RewardInputs.__call__
    monkeypatch.setattr(RewardInputs, "__call__", lambda self, batch: seen.append(real(self, batch)) or seen[-1])
    summary, rows = run_rl(f"reward.model.path={other_rm}")
    reward_vocab = len(AutoTokenizer.from_pretrained(other_rm))
    assert len(seen) >= 2 and all(int(b["input_ids"].max()) < reward_vocab for b in seen)
    steps = [r for r in rows if "reward/reward_model" in r]
    assert len(steps) == 2 and all(r["reward/mean"] == pytest.approx(r["reward/reward_model"]) for r in steps)
    assert all(r["reward/max"] > r["reward/min"] for r in steps)
    assert set(summary["val_after"]) == {"greedy_reward_mean", "reward_mean"}


def test_a_reward_model_of_another_tokenizer_without_a_chat_template_is_refused(tiny_model_path, other_rm, data_files, tmp_path):
    folder = tmp_path / "no-template"
    AutoModelForSequenceClassification.from_pretrained(other_rm).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(other_rm)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    base = [f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", f"reward.model.path={folder}"]
    with pytest.raises(ConfigError) as caught:
        train(None, ["recipe=rl", *base], dry_run=True)
    message = str(caught.value)
    assert "'reward.model.path'" in message and str(folder) in message and "vocabularies" in message and "chat template" in message


def test_conversation_layout_scores_the_whole_rendered_conversation_as_verl_does(tiny_model_path, other_rm):
    """``reward.model.layout: conversation`` (what from-verl sets): the messages and the answer as
    an assistant message, rendered by the reward model's template without a generation prompt and
    scored at its last token, as verl's reward loop sends them to its reward model; with the
    policy's own ChatML that is the newline after <|im_end|>, one token past where ``sampled`` reads."""
    policy = AutoTokenizer.from_pretrained(tiny_model_path)
    eos = policy.eos_token_id
    answers = [policy.encode("#### 7") + [eos], policy.encode("#### 9"), policy.encode("42") + [eos], []]
    batch = rollout(policy, answers)
    own = RewardInputs(policy, policy, 512, conversation=True)(batch)
    for i in range(len(batch)):
        ids = own["input_ids"][i][own["attention_mask"][i].bool()].tolist()
        assert policy.decode(ids[-2:]) == "<|im_end|>\n"  # the template's end, not the sample's eos
    reward_tok = AutoTokenizer.from_pretrained(other_rm)
    role = build_worker(load_plugins().registry, "fsdp", "reward_model", other_rm, None, head="reward")
    scored = ModelReward(role, 1.0, "reward_model", None, RewardInputs(policy, reward_tok, CONTEXT, conversation=True)).score(batch)
    first = [{"role": "user", "content": "3+4="}]
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+30="}]
    model = AutoModelForSequenceClassification.from_pretrained(other_rm)
    direct = []
    for messages, answer in zip([first, first, second, second], ["#### 7", "#### 9", "42", ""]):
        text = reward_tok.apply_chat_template([*messages, {"role": "assistant", "content": answer}], tokenize=False, add_generation_prompt=False)
        ids = reward_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, -CONTEXT:]
        with torch.no_grad():
            direct.append(float(model(input_ids=ids).logits[0, 0]))
    torch.testing.assert_close(scored.components["reward_model"], torch.tensor(direct), atol=1e-5, rtol=0)
