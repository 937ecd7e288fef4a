"""``trellis config init rl|sft`` prints a commented starter that holds the recipe's defaults and
passes the dry run once the model and data paths are filled in."""

from __future__ import annotations

import pytest
from cli_runs import run_cli as trellis
from omegaconf import OmegaConf

from trellis.config import ConfigError, compose
from trellis.plugins import load_plugins


@pytest.mark.parametrize("recipe", ["rl", "sft"])
def test_starter_shows_the_defaults_and_passes_the_dry_run(recipe, tmp_path, tiny_model_path, data_files):
    out = trellis("config", "init", recipe, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"# A starter config for the {recipe} recipe") and "  path: ???" in out.stdout
    starter = tmp_path / "my_run.yaml"
    starter.write_text(out.stdout)
    paths = [f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}"]
    registry = load_plugins().registry
    from_starter = compose(starter, paths, registry)
    defaults = compose(None, [f"recipe={recipe}", *paths], registry)
    assert OmegaConf.to_container(from_starter) == OmegaConf.to_container(defaults)

    checked = trellis("train", str(starter), "--dry-run", *paths, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "every check that needs no model passed" in checked.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_run.yaml"]


def test_other_recipes_print_their_defaults(tmp_path):
    out = trellis("config", "init", "spin", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.recipe == "spin" and OmegaConf.is_missing(cfg.model, "path") and cfg.ref_update_every == 1


def test_unknown_recipe_is_named(tmp_path):
    out = trellis("config", "init", "rll", cwd=tmp_path)
    assert out.returncode == 2 and "recipe 'rll' is not installed" in out.stderr and "did you mean 'rl'?" in out.stderr


def written_preset(name: str, heading: str, folder):
    """``trellis config init NAME`` saved as ``NAME.yaml`` in ``folder``, after checking it ran and
    opens with its heading."""
    out = trellis("config", "init", name, cwd=folder)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"# A starter config for {heading}")
    starter = folder / f"{name}.yaml"
    starter.write_text(out.stdout)
    return starter


def test_opo_preset_is_on_policy_and_off_policy_settings_are_named(tmp_path, tiny_model_path, data_files):
    starter = written_preset("opo", "OPO", tmp_path)
    paths = [f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}"]
    cfg = compose(starter, paths, load_plugins().registry)
    assert (cfg.algorithm.advantage.name, cfg.actor.ppo_epochs, cfg.actor.mini_batch_samples, cfg.actor.use_kl_loss) == ("opo", 1, 0, False)
    assert trellis("train", str(starter), "--dry-run", *paths, cwd=tmp_path).returncode == 0

    bad = trellis("train", str(starter), "--dry-run", *paths, "actor.ppo_epochs=2", "actor.mini_batch_samples=16", cwd=tmp_path)
    assert bad.returncode != 0
    assert "actor.ppo_epochs=2 (use 1) and actor.mini_batch_samples=16 (use 0: the step's 64 samples at once)" in bad.stderr
    # the whole step as one mini-batch, written out, is on-policy too
    assert trellis("train", str(starter), "--dry-run", *paths, "actor.mini_batch_samples=64", cwd=tmp_path).returncode == 0


def test_dapo_preset_holds_the_papers_settings_and_passes_the_dry_run(tmp_path, tiny_model_path, data_files):
    starter = written_preset("dapo", "DAPO", tmp_path)
    paths = [f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}"]
    cfg = compose(starter, paths, load_plugins().registry)
    loss = cfg.actor.policy_loss
    assert (loss.clip_ratio_low, loss.clip_ratio_high, cfg.actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert not cfg.actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward
    assert cfg.algorithm.dynamic_sampling.enable and cfg.reward.overlong.buffer_len == 12
    assert trellis("train", str(starter), "--dry-run", *paths, cwd=tmp_path).returncode == 0
    # a buffer longer than the response budget is named with the fix
    bad = trellis("train", str(starter), "--dry-run", *paths, "sampling.max_new_tokens=8", cwd=tmp_path)
    assert "config key 'reward.overlong.buffer_len' is 12, longer than sampling.max_new_tokens=8" in bad.stderr


def test_distill_preset_needs_a_teacher_with_the_students_tokenizer(tmp_path, tiny_model_path, tiny_untied_model_path, data_files):
    starter = written_preset("distill", "on-policy distillation", tmp_path)
    paths = [f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}"]
    cfg = compose(starter, [*paths, f"teacher.path={tiny_untied_model_path}"], load_plugins().registry)
    distill = cfg.actor.distill
    assert (distill.coef, distill.loss.name, distill.loss.beta, distill.top_k, distill.use_policy_loss) == (1.0, "jsd", 0.5, 128, False)
    assert (cfg.sampling.n, cfg.data.train_batch_prompts) == (1, 64)
    assert trellis("train", str(starter), "--dry-run", *paths, f"teacher.path={tiny_untied_model_path}", cwd=tmp_path).returncode == 0
    missing = trellis("train", str(starter), "--dry-run", *paths, cwd=tmp_path)
    assert missing.returncode != 0 and "teacher.path" in missing.stderr


RL = ["recipe=rl", "model.path=/models/tiny", "data.train_path=/data/train.parquet"]


@pytest.mark.parametrize(
    "given, message",
    [
        (
            ["actor.adapter.alpha=32", "actor.adapter.target_modules=[q_proj]"],
            "config key 'actor.adapter.alpha' is set (32.0) but actor.adapter.rank is 0, so it would be ignored; "
            "set actor.adapter.rank above 0 (e.g. 8) to train a LoRA adapter, or drop actor.adapter.alpha",
        ),
        (
            ["algorithm.dynamic_sampling.max_rounds=3"],
            "config key 'algorithm.dynamic_sampling.max_rounds' is set (3) but algorithm.dynamic_sampling.enable is false, so it "
            "would be ignored; set algorithm.dynamic_sampling.enable to true to filter groups, or drop algorithm.dynamic_sampling.max_rounds",
        ),
        (
            ["reward.overlong.penalty=0.5"],
            "config key 'reward.overlong.penalty' is set (0.5) but reward.overlong.buffer_len is 0, so it would be ignored; set "
            "reward.overlong.buffer_len to the buffer's length in tokens (e.g. 4) to penalize long responses, or drop reward.overlong.penalty",
        ),
    ],
    ids=["adapter-rank-0", "dynamic-sampling-off", "overlong-buffer-0"],
)
def test_an_option_of_a_section_switched_off_is_refused(given, message):
    """A section whose switch is off (``trellis.config.switch``) with another option set away from
    its default: that option would be ignored (a LoRA rank forgotten trained every weight at the
    adapter's learning rate), so the config stops, naming the option, its value and the switch.
    The same options with the switch on, or set to their defaults, compose."""
    registry = load_plugins().registry
    with pytest.raises(ConfigError) as error:
        compose(None, [*RL, *given], registry)
    assert str(error.value) == message
    switch_on = {"actor": "actor.adapter.rank=8", "algorithm": "algorithm.dynamic_sampling.enable=true", "reward": "reward.overlong.buffer_len=4"}
    compose(None, [*RL, *given, switch_on[given[0].split(".")[0]]], registry)
    compose(None, [*RL, "actor.adapter.alpha=16", "reward.overlong.penalty=1.0", "algorithm.dynamic_sampling.max_rounds=10"], registry)


def test_a_run_given_by_overrides_alone_needs_no_file(tmp_path):
    """``trellis train recipe=rl model.path=... k=v`` (as docs/lora.md writes it): the first
    ``key=value`` is an override, not a missing YAML file."""
    overrides = ["recipe=rl", "model.path=/models/tiny", "data.train_path=/data/train.parquet", "actor.adapter.rank=8"]
    done = trellis("config", "show", *overrides, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("recipe: rl\n") and "path: /models/tiny" in done.stdout and "rank: 8" in done.stdout
    done = trellis("train", "recipe=rl", "--dry-run", cwd=tmp_path)
    assert done.returncode == 2 and "config key 'data.train_path' is required" in done.stderr
