"""DAPO's pieces in the rl recipe: dynamic sampling trains only on prompt groups whose rewards
vary and fills the batch exactly; the overlong penalty and ``actor.mask_truncated`` reach the
update; ``trellis config init dapo`` is DAPO's settings and passes the dry run."""

from __future__ import annotations

from trellis.runtime.worker import RoleWorker
from trellis_demo.tasks import make_arithmetic_split, write_rows

HALF_REWARD = '''
def half(data_source, solution_str, ground_truth, extra_info=None):
    """Constant (0) on prompts with an even answer; on odd ones, the response length's parity."""
    acc = 0.0 if int(ground_truth) % 2 == 0 else float(len(solution_str) % 2)
    return {"score": acc, "acc": acc}
'''


def test_dynamic_sampling_trains_only_on_varying_groups_and_fills_the_batch(run_rl, tmp_path, monkeypatch, step_batches):
    reward = tmp_path / "half.py"
    reward.write_text(HALF_REWARD)
    updates, train = [], RoleWorker.train  # what the actor's update got (step_batches: the recipe's batch, uids and rewards)

    def recording(self, verb, batch):
        if verb == "update" and self.spec.role == "actor":
            updates.append(batch)
        return train(self, verb, batch)

    monkeypatch.setattr(RoleWorker, "train", recording)
    _, rows = run_rl(
        f"reward.path={reward}", "reward.name=half", "algorithm.dynamic_sampling.enable=true", "actor.mask_truncated=true",
    )  # fmt: skip
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(updates) == len(steps) == 2
    for row, batch, update in zip(steps, step_batches, updates):
        assert row["dynamic_sampling/kept_groups"] == 4.0 and len(batch) == 16  # data.train_batch_prompts x sampling.n, exactly
        assert row["dynamic_sampling/rounds"] >= 1
        groups = batch.group_index("uid")
        assert groups.bincount().tolist() == [4, 4, 4, 4]
        scores = batch["token_scores"].sum(-1)
        assert all(scores[groups == g].unique().numel() > 1 for g in range(4))  # never a zero-variance group
        assert row["response/masked_truncated"] == int((update["response_mask"].sum(-1) == 0).sum())
    # about half the prompts have an even answer: their groups are dropped, so some steps need a second round
    assert sum(r["dynamic_sampling/dropped_groups"] for r in steps) > 0


def test_rounds_of_other_prompt_widths_train_on_the_sampled_tokens(run_rl, tmp_path, step_batches):
    """The merged rounds keep every response where the trainer reads it: with the HF engine sharing
    the actor's module, the trainer's log-probs equal the engine's to float noise at steps of
    several rounds whose prompts differ in width (a right-padded merge put them 0.24 nats apart)."""
    reward = tmp_path / "half.py"
    reward.write_text(HALF_REWARD)
    rows = make_arithmetic_split(64, 0, max_value=50)
    for i, row in enumerate(rows):  # the question asked 1 to 3 times: prompts of other widths in every round
        row["prompt"][0]["content"] *= 1 + i % 3
    data = write_rows(rows, tmp_path / "widths.parquet")
    _, rows = run_rl(
        f"reward.path={reward}", "reward.name=half", "algorithm.dynamic_sampling.enable=true", "trainer.total_steps=3",
        f"data.train_path={data}", "actor.policy_loss.log_metrics=true",
    )  # fmt: skip
    steps = [r for r in rows if "actor/pg_loss" in r]
    several = [(r, b) for r, b in zip(steps, step_batches) if r["dynamic_sampling/rounds"] > 1]
    assert several, "no step took more than one round"
    for row, batch in several:
        prompt_lengths = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1)
        assert prompt_lengths.unique().numel() == 3
        assert abs(row["actor/rollout_corr/kl"]) < 1e-6 and row["sync/batch_gap"] < 1e-5, row


def test_generating_ahead_carries_kept_groups_over_and_filters_plug_in(run_rl, tmp_path):
    """Two rounds of 4 prompts can keep more groups than a step needs: generating ahead of training,
    they are carried to the next step (never older than the staleness bound) instead of dropped.
    The example plugin's filter ``example_some_right`` (a sample above 0) adds to zero_variance."""
    reward = tmp_path / "half.py"
    reward.write_text(HALF_REWARD)
    _, rows = run_rl(
        f"reward.path={reward}", "reward.name=half", "algorithm.dynamic_sampling.enable=true", "trainer.total_steps=4",
        "algorithm.dynamic_sampling.filters=[zero_variance,example_some_right]", "trainer.async_mode=one_step", "data.train_batch_prompts=3",
    )  # fmt: skip
    steps = [r for r in rows if "dynamic_sampling/kept_groups" in r]
    assert [r["dynamic_sampling/kept_groups"] for r in steps] == [3.0] * 4
    assert sum(r["dynamic_sampling/carried_groups"] for r in steps) > 0  # some step began with groups an earlier one kept
    assert all(r["rollout/staleness_max"] <= 1.0 for r in steps)


ZERO_REWARD = '''
def nothing(data_source, solution_str, ground_truth, extra_info=None):
    """A reward that cannot score this data: 0 on every sample."""
    return 0.0
'''


def test_a_reward_that_scores_nothing_under_the_overlong_penalty_is_named(run_rl, tmp_path, caplog):
    """The DAPO starter's gsm8k reward on data it cannot score gives 0 everywhere; with the
    overlong penalty on, only the response's length then varies within a group and the model
    learns length alone. After three all-zero rounds the run says so once, naming the reward and
    the data; a reward that scores something says nothing."""
    reward = tmp_path / "zero.py"
    reward.write_text(ZERO_REWARD)
    shaping = ["reward.overlong.buffer_len=4", "reward.overlong.penalty=1.0", "trainer.total_steps=3"]
    with caplog.at_level("WARNING", logger="trellis_algos.rl.samples"):
        run_rl(f"reward.path={reward}", "reward.name=nothing", *shaping, run_dir=tmp_path / "zero")
    said = [r.getMessage() for r in caplog.records if "scored 0 on every sample" in r.getMessage()]
    assert said == [
        f"reward '{reward}:nothing' scored 0 on every sample of the first 3 generation rounds (data_source: arithmetic): within each "
        "group only reward.overlong's length penalty differs, so the model learns response length alone; check that reward.name "
        "scores your data's answers"
    ]
    caplog.clear()
    half = tmp_path / "half.py"
    half.write_text(HALF_REWARD)
    with caplog.at_level("WARNING", logger="trellis_algos.rl.samples"):
        run_rl(f"reward.path={half}", "reward.name=half", *shaping, run_dir=tmp_path / "half")
    assert not [r for r in caplog.records if "scored 0 on every sample" in r.getMessage()]
