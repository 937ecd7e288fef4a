"""The parity table (``trellis config from-verl --parity``): every key of the config verl 0.9.1 would
run for a launch script (verl's installed ``_generated_ppo_trainer.yaml``, the entry point's own
config, the script's settings) is SAME, DIFF with the difference stated, or NOT CONVERTED with its
reason; none is SILENT (left without any)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runs import run_cli as trellis

SCRIPTS = Path(__file__).parent / "launch"


def parity(script: str, cwd: Path = SCRIPTS) -> dict[str, tuple[str, str]]:
    out = trellis("config", "from-verl", "--parity", script, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| `")]
    assert out.stdout.splitlines()[-1].startswith("RESULT same=") and out.stdout.splitlines()[-1].endswith(" silent=0")
    return {cells[0].strip("|` "): (cells[2], cells[3].rstrip(" |")) for cells in rows}


SCRIPT_NAMES = [
    "lora.sh",
    "dapo.sh",
    "fully_async.sh",
    "one_step_off.sh",
    "distill.sh",
    "ppo_gae.sh",
    "rollout_corr.sh",
    "gspo.sh",
    "genrm_remote.sh",
    "reinforce_pp.sh",
    "sapo.sh",
    "geo3k.sh",
    "moe_r3.sh",
    "multiturn/run.sh",
    "fapo/run.sh",
    "sft.sh",
    "megatron.sh",
]


@pytest.mark.parametrize("script", SCRIPT_NAMES)
def test_every_key_of_verls_resolved_config_is_accounted_for(script):
    table = parity(Path(script).name, cwd=SCRIPTS / Path(script).parent)
    assert len(table) > (180 if script == "sft.sh" else 850)  # the whole resolved config, not the script's keys alone
    assert not [k for k, (status, _) in table.items() if status == "SILENT"]


def test_the_table_says_what_converts_and_how_runs_differ():
    table = parity("fully_async.sh")
    assert table["async_training.staleness_threshold"][0] == "DIFF" and "ceil(0.1) = 1" in table["async_training.staleness_threshold"][1]
    assert table["actor_rollout_ref.actor.clip_ratio"] == ("SAME", "actor.policy_loss.clip_ratio")
    assert table["algorithm.rollout_correction.loss_type"] == ("SAME", "actor.policy_loss.loss_type")  # verl's bypass mode
    assert table["actor_rollout_ref.rollout.enable_chunked_prefill"][0] == "NOT CONVERTED"  # a speed knob, said so
    lora = parity("lora.sh")
    assert lora["actor_rollout_ref.model.lora_rank"] == ("SAME", "actor.adapter.rank")
    assert lora["trainer.max_actor_ckpt_to_keep"] == ("SAME", "trainer.keep_checkpoints")
    geo3k = parity("geo3k.sh")
    assert geo3k["data.image_key"] == ("SAME", "data.image_key")
    assert geo3k["actor_rollout_ref.actor.freeze_vision_tower"] == ("SAME", "backend.freeze_vision_tower")
