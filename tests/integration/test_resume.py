"""Runs that survive: killed with SIGKILL mid-step or mid-checkpoint, ``resume=auto`` continues from
the last complete checkpoint and the steps after it equal those of an uninterrupted run; a resume at
an epoch boundary trains the next epoch; a finished run says so; a changed config is refused; a
checkpoint exports to a Hugging Face folder that loads without Trellis and gives the actor's logits."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_runs import run_cli as run_in_process

from trellis.cli import main as cli_main
from trellis.config import ConfigError
from trellis.hookspecs import hookimpl
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis.runtime.checkpoint import damaged_files, read_manifest
from trellis_demo.tasks import make_arithmetic_split, write_rows

KILLABLE = Path(__file__).with_name("killable.py")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    """Same steps, same metric names, same values to 1e-6 (wall times aside)."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        keys = {k for k in w if not k.startswith("timing/")}
        assert keys == {k for k in g if not k.startswith("timing/")}
        for k in keys:
            assert g[k] == pytest.approx(w[k], abs=1e-6, rel=0), f"step {w['step']}: {k}"


@pytest.fixture(scope="module")
def rl_overrides(tiny_model_path, tmp_path_factory):
    """4 steps over 8 prompts (2 steps an epoch), with everything a resume must restore: actor and
    critic (GAE) with their optimizers and a cosine LR, shuffled mini-batches, clip_cov's random
    token choice, an adaptive in-reward KL coefficient, the data order. Checkpoints at steps 2 and 4."""
    train_file = write_rows(make_arithmetic_split(8, 0, max_value=50), tmp_path_factory.mktemp("data") / "train.parquet")
    return [
        "recipe=rl",
        f"model.path={tiny_model_path}",
        f"data.train_path={train_file}",
        "data.train_batch_prompts=4",
        "sampling.n=4",
        "sampling.max_new_tokens=6",
        "actor.micro_batch_samples=8",
        "actor.mini_batch_samples=8",
        "actor.shuffle=true",
        "actor.optim.lr=1e-3",
        "actor.optim.lr_schedule=cosine",
        "actor.optim.warmup_steps=1",
        "actor.policy_loss.name=clip_cov",
        "algorithm.advantage.name=gae",
        "critic.micro_batch_samples=8",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl_type=adaptive",
        "trainer.total_steps=4",
        "trainer.save_every_steps=2",
        "trainer.trackers=[jsonl]",
        "trainer.threads=1",
    ]


class SavedCheckpoints:
    """A plugin that records ``trellis_checkpoint_saved`` calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Path]] = []

    @hookimpl
    def trellis_checkpoint_saved(self, step, path):
        self.calls.append((step, Path(path)))


@pytest.fixture(scope="module")
def reference(rl_overrides, tmp_path_factory):
    """The uninterrupted run: its folder, its metrics and the checkpoint hook's calls."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    saved = SavedCheckpoints()
    train(None, [*rl_overrides, f"trainer.run_dir={run_dir}"], plugins=load_plugins(extra=[("saved", saved)]))
    return run_dir, rows(run_dir), saved.calls


def test_uninterrupted_run_keeps_its_checkpoints_and_fires_the_hook(reference):
    run_dir, metrics, calls = reference
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert calls == [(2, run_dir / "checkpoint-2"), (4, run_dir / "checkpoint-4")]
    manifest = read_manifest(run_dir / "checkpoint-4")
    assert manifest["step"] == 4 and manifest["roles"] == ["actor", "critic"]
    assert {"actor/.metadata", "critic/.metadata", "trainer_state.pt", "config.yaml"} <= set(manifest["files"])


def killed_run(overrides: list[str], point: str, step: int, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(KILLABLE), point, str(step), *overrides], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("point", "step", "logged_before_kill", "checkpoints", "leftover"),
    [
        ("update", 2, [1], [], None),  # inside step 2, before any checkpoint: the relaunch starts fresh, step 1 not repeated
        ("update", 3, [1, 2], ["checkpoint-2"], None),  # inside step 3: steps 1-2 are checkpointed, step 3 is lost
        ("checkpoint", 4, [1, 2, 3, 4], ["checkpoint-2"], ".checkpoint-4.tmp"),  # steps 3-4 ran, but their checkpoint never completed
    ],
    ids=["before-the-first-checkpoint", "during-a-step", "during-a-checkpoint-write"],
)
def test_killed_run_resumes_to_the_metrics_of_an_uninterrupted_run(
    rl_overrides, reference, tmp_path, point, step, logged_before_kill, checkpoints, leftover
):
    run_dir = tmp_path / "run"
    overrides = [*rl_overrides, f"trainer.run_dir={run_dir}"]
    killed_run(overrides, point, step, tmp_path)
    assert [r["step"] for r in rows(run_dir)] == logged_before_kill
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == checkpoints
    assert all(read_manifest(run_dir / name) is not None for name in checkpoints)  # the previous checkpoint is intact
    if leftover:
        assert read_manifest(run_dir / leftover) is None and (run_dir / leftover / "actor").is_dir()

    train(None, overrides)  # trainer.resume=auto is the default

    assert_same_metrics(rows(run_dir), reference[1])
    assert sorted(p.name for p in run_dir.iterdir() if "checkpoint" in p.name) == ["checkpoint-2", "checkpoint-4"]


def test_killed_after_the_last_checkpoint_runs_the_end_tasks_on_relaunch(rl_overrides, reference, tmp_path):
    """The final checkpoint is complete but validation and the HF export never ran: the relaunch
    does them (no step again), and only then is the run finished."""
    run_dir = tmp_path / "run"
    overrides = [*rl_overrides, f"trainer.run_dir={run_dir}", "trainer.save_hf_model=true"]
    killed_run(overrides, "saved", 4, tmp_path)
    assert read_manifest(run_dir / "checkpoint-4") is not None and not (run_dir / "hf_model").exists()

    assert "finished_at_step" not in train(None, overrides)
    assert (run_dir / "hf_model" / "config.json").is_file()
    assert_same_metrics(rows(run_dir), reference[1])
    assert train(None, overrides) == {"finished_at_step": 4}


def test_kills_while_pruning_and_writing_the_hf_model_leave_nothing_behind(rl_overrides, reference, tmp_path):
    """Killed once checkpoint 4 is complete while checkpoint 2 is deleted (keep 1), then killed
    while the end's hf_model is written: each relaunch finishes the end tasks, and afterwards the run
    folder holds the last checkpoint, hf_model and the run's files, no half-deleted checkpoint or
    temporary folder (no later save would ever have removed them); a folder of a name trellis does
    not write is left alone."""
    run_dir = tmp_path / "run"
    overrides = [*rl_overrides, f"trainer.run_dir={run_dir}", "trainer.save_hf_model=true", "trainer.keep_checkpoints=1"]
    killed_run(overrides, "prune", 4, tmp_path)
    assert (run_dir / ".checkpoint-2.deleting").is_dir() and read_manifest(run_dir / "checkpoint-4") is not None
    killed_run(overrides, "hf_model", 0, tmp_path)
    assert not (run_dir / ".checkpoint-2.deleting").exists()
    assert [p.name for p in run_dir.glob(".hf_model.tmp-*")] and not (run_dir / "hf_model").exists()

    (run_dir / ".hf_model.tmp-mine").mkdir()  # not a name trellis writes: kept
    assert "finished_at_step" not in train(None, overrides)
    hidden = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("."))
    assert hidden == [".hf_model.tmp-mine"] and (run_dir / "hf_model" / "config.json").is_file()
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-4"]
    assert_same_metrics(rows(run_dir), reference[1])


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Damage ``path`` in place, keeping its size."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    ("file", "where"),
    [
        ("actor/__0_0.distcp", lambda data: len(data) // 2),  # 16 bytes inside the weights
        ("actor/rank0.pt", lambda data: data.index(b"PK\x01\x02")),  # the zip's central directory
    ],
    ids=["bytes-inside-a-shard", "broken-zip"],
)
def test_a_damaged_checkpoint_is_named_and_the_run_resumes_from_the_previous_one(rl_overrides, reference, tmp_path, file, where):
    """A finished run whose last checkpoint was damaged in place (same size) and relaunched through
    the CLI: the warning names the file, steps 3-4 run again from checkpoint-2 and give the values
    of the undisturbed run, and the damaged checkpoint is replaced by an intact one."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    damaged = run_dir / "checkpoint-4" / file
    size = damaged.stat().st_size
    overwrite(damaged, where(damaged.read_bytes()), b"\xff" * 16)
    assert damaged.stat().st_size == size
    if file.endswith(".pt"):  # the damage a bare torch.load reports without naming the file
        with pytest.raises(RuntimeError, match="PytorchStreamReader failed reading zip archive"):
            torch.load(damaged, weights_only=True)

    config = tmp_path / "run.yaml"
    config.write_text("recipe: rl\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "trellis.cli", "train", str(config), *rl_overrides, f"trainer.run_dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {run_dir / 'checkpoint-4'} is damaged: {damaged} changed after it was written" in proc.stderr
    assert "falling back to the previous complete checkpoint" in proc.stderr
    assert f"resumed from {run_dir / 'checkpoint-2'}: next step 3 of 4" in proc.stderr
    assert_same_metrics(rows(run_dir), reference[1])
    assert not damaged_files(run_dir / "checkpoint-4")
    assert read_manifest(run_dir / "checkpoint-4")["sha256"] != read_manifest(reference[0] / "checkpoint-4")["sha256"]


@pytest.fixture
def run_sft(tiny_model_path, data_files, tmp_path):
    """``run_sft(run_dir, total_steps, *overrides)``: 2 steps an epoch over the 64 training rows."""

    def run(run_dir: Path, total_steps: int, *overrides: str):
        base = [
            "recipe=sft",
            f"model.path={tiny_model_path}",
            f"data.train_path={data_files['train']}",
            "data.batch_samples=32",
            "train.optim.lr=1e-2",
            "trainer.trackers=[jsonl]",
            "trainer.threads=1",
            f"trainer.total_steps={total_steps}",
            f"trainer.run_dir={run_dir}",
        ]
        return train(None, [*base, *overrides])

    return run


def test_resume_at_an_epoch_boundary_trains_the_next_epoch(run_sft, tmp_path, caplog):
    run_sft(tmp_path / "straight", 3)
    run_sft(tmp_path / "stopped", 2)  # ends exactly at the end of epoch 0, with checkpoint-2
    with caplog.at_level(logging.INFO, logger="trellis"):
        assert run_sft(tmp_path / "stopped", 2) == {"finished_at_step": 2}
    assert "run already finished" in caplog.text
    run_sft(tmp_path / "stopped", 3)  # extended by one step: resumes after step 2

    resumed = rows(tmp_path / "stopped")
    assert [(r["step"], r["sft/epoch"]) for r in resumed] == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert_same_metrics(resumed, rows(tmp_path / "straight"))


@pytest.fixture
def no_model_building(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr("trellis.runtime.harness.spawn_worker", refuse)


def test_changed_config_is_refused_with_the_differing_keys(rl_overrides, reference, no_model_building):
    run_dir = reference[0]
    config_before = (run_dir / "config.yaml").read_text()
    overrides = [*rl_overrides, f"trainer.run_dir={run_dir}", "trainer.total_steps=6"]
    changed = ["data.train_batch_prompts=2", "actor.optim.lr=0.01"]
    with pytest.raises(ConfigError) as err:
        train(None, [*overrides, *changed])
    message = str(err.value)
    assert "actor.optim.lr: 0.001 -> 0.01" in message and "data.train_batch_prompts: 4 -> 2" in message
    assert "trainer.resume_allow_changes=[actor.optim.lr,data.train_batch_prompts]" in message
    assert "total_steps" not in message  # extending a run is not a change of meaning
    with pytest.raises(ConfigError) as err:
        train(None, [*overrides, *changed, "trainer.resume_allow_changes=[actor.optim]"])
    assert "data.train_batch_prompts" in str(err.value) and "actor.optim.lr" not in str(err.value)
    assert (run_dir / "config.yaml").read_text() == config_before  # a refused resume leaves the run folder as it was


def test_finished_run_exits_cleanly_without_building_models(rl_overrides, reference, no_model_building):
    assert train(None, [*rl_overrides, f"trainer.run_dir={reference[0]}"]) == {"finished_at_step": 4}


NO_TRELLIS_LOGITS = """
import sys
sys.modules.update(dict.fromkeys(["trellis", "trellis_fsdp", "trellis_algos", "trellis_hf"]))  # import trellis fails
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
out, dest = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(out)
GenerationConfig.from_pretrained(out)
ids = tokenizer("12+7=19 #### 19", return_tensors="pt")["input_ids"]
model = AutoModelForCausalLM.from_pretrained(out)
with torch.no_grad():
    torch.save({"ids": ids, "logits": model(ids).logits}, dest)
"""


def test_export_loads_without_trellis_and_gives_the_actors_logits(reference, tmp_path, capsys):
    from omegaconf import OmegaConf

    from trellis.config import validate
    from trellis.runtime.worker import build_worker
    from trellis_algos import ActorConfig

    checkpoint = reference[0] / "checkpoint-4"
    out = tmp_path / "hf"
    assert cli_main(["export", str(checkpoint), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert cli_main(["export", str(checkpoint), str(out)]) == 0  # an earlier export is replaced

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", NO_TRELLIS_LOGITS, str(out), str(tmp_path / "logits.pt")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = torch.load(tmp_path / "logits.pt")

    cfg = OmegaConf.load(checkpoint / "config.yaml")
    registry = load_plugins().registry
    actor = build_worker(registry, "fsdp", "actor", cfg.model.path, validate(cfg.actor, ActorConfig, registry), {"update": "policy"})
    actor.load(checkpoint / "actor")
    with torch.no_grad():
        logits = actor.backend.model(input_ids=exported["ids"]).logits
    torch.testing.assert_close(exported["logits"], logits, atol=1e-6, rtol=0)
    untrained = build_worker(registry, "fsdp", "ref", cfg.model.path)
    with torch.no_grad():
        assert not torch.allclose(untrained.backend.model(input_ids=exported["ids"]).logits, logits, atol=1e-3)  # training moved it


def run_cli(*args: str):
    return run_in_process(*args, cwd=".")


def test_a_run_trained_from_a_relative_model_path_exports_from_any_folder(tiny_model_path, rl_overrides, tmp_path, monkeypatch):
    """``model.path: tiny`` (as the README's config has it) is relative to the folder the run was
    started in, which the checkpoint records: ``trellis export`` from another folder finds it."""
    import shutil

    started, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    shutil.copytree(tiny_model_path, started / "tiny")
    elsewhere.mkdir()
    monkeypatch.chdir(started)
    overrides = [o for o in rl_overrides if not o.startswith(("model.path=", "trainer.total_steps=", "trainer.save_every_steps="))]
    train(None, [*overrides, "model.path=tiny", "trainer.total_steps=1", "trainer.run_dir=run"])
    monkeypatch.chdir(elsewhere)
    assert cli_main(["export", str(started / "run"), "hf"]) == 0
    assert (elsewhere / "hf" / "model.safetensors").is_file() and (elsewhere / "hf" / "tokenizer.json").is_file()


def test_export_never_deletes_the_run_nor_a_folder_it_did_not_write(reference, tmp_path):
    run_dir = reference[0]
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    for out in (run_dir, run_dir / "hf", run_dir / "checkpoint-4" / "hf", run_dir.parent):
        proc = run_cli("export", str(run_dir), str(out))
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "an export never writes there: give a folder outside the run" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = run_cli("export", str(run_dir), str(mine))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"trellis: error: trellis export: {str(mine)!r} exists and was not made by trellis export (no trellis_export.json); "
        "choose another folder or delete it"
    )
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"


def test_ctrl_c_prints_one_line_with_the_command_that_resumes(rl_overrides, tmp_path):
    config, run_dir = tmp_path / "run.yaml", tmp_path / "run"
    config.write_text("recipe: rl\n")
    args = [*rl_overrides[1:], "trainer.total_steps=40", "trainer.save_every_steps=1", f"trainer.run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "trellis.cli", "train", str(config), *args]
    # SIGINT's default action in the child: a suite started in the background (`... &` without job control)
    # runs with SIGINT ignored, which Python inherits and then never turns into KeyboardInterrupt
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        while not (run_dir / "metrics.jsonl").exists() or len(rows(run_dir)) < 2:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends the terminal's foreground process group
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == f"trellis: interrupted; resume with: {shlex.join(['trellis', 'train', str(config), *args])}"

    last = max(read_manifest(p)["step"] for p in run_dir.glob("checkpoint-*") if read_manifest(p))
    command = shlex.split(err.splitlines()[-1].split("resume with: ", 1)[1])
    cmd = [sys.executable, "-m", "trellis.cli", *command[1:], f"trainer.total_steps={last + 1}"]
    resumed = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir / f'checkpoint-{last}'}: next step {last + 1} of {last + 1}" in resumed.stderr
    assert rows(run_dir)[-1]["step"] == last + 1


def test_a_run_or_checkpoint_as_model_path_says_export_it_first(reference, rl_overrides, tmp_path):
    run_dir = reference[0]
    config = tmp_path / "run.yaml"
    config.write_text("recipe: rl\n")
    for given, what in ((run_dir, "run folder"), (run_dir / "checkpoint-4", "checkpoint")):
        cmd = [sys.executable, "-m", "trellis.cli", "train", str(config), *rl_overrides[1:], f"model.path={given}", "--dry-run"]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.splitlines()[-1] == (
            f"trellis: error: config key 'model.path': {str(given)!r} is a trellis {what}, not a Hugging Face model folder; "
            f"export it first: trellis export {given} {run_dir}-hf, then set model.path={run_dir}-hf"
        )


def test_dynamic_sampling_resumes_exactly(tiny_model_path, tmp_path):
    """Refill rounds draw extra prompts from the loader; killed inside step 3, the relaunch from
    checkpoint-2 repeats steps 3-4 as the uninterrupted run did (same prompts, same rounds)."""
    from test_dapo import HALF_REWARD  # beside this file

    reward = tmp_path / "half.py"
    reward.write_text(HALF_REWARD)
    train_file = write_rows(make_arithmetic_split(16, 0, max_value=50), tmp_path / "train.parquet")
    overrides = [
        "recipe=rl", f"model.path={tiny_model_path}", f"data.train_path={train_file}", "data.train_batch_prompts=2", "sampling.n=4",
        "sampling.max_new_tokens=6", f"reward.path={reward}", "reward.name=half", "algorithm.dynamic_sampling.enable=true",
        "reward.overlong.buffer_len=2", "actor.mask_truncated=true", "actor.optim.lr=1e-3", "trainer.total_steps=4",
        "trainer.save_every_steps=2", "trainer.trackers=[jsonl]", "trainer.threads=1",
    ]  # fmt: skip
    reference = tmp_path / "reference"
    train(None, [*overrides, f"trainer.run_dir={reference}"])
    run_dir = tmp_path / "run"
    killed_run([*overrides, f"trainer.run_dir={run_dir}"], "update", 3, tmp_path)
    train(None, [*overrides, f"trainer.run_dir={run_dir}"])
    assert sum(r["dynamic_sampling/rounds"] for r in rows(reference)) > 4  # some steps did refill
    assert_same_metrics(rows(run_dir), rows(reference))
