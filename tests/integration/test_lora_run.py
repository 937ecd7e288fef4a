"""An rl run that trains a LoRA adapter (``actor.adapter``): the KL loss's reference is the actor
with its adapter off (no ``ref`` role), and the run's final policy and ``trellis export`` are the
same plain Hugging Face model; the checkpoint holds the adapter alone."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from trellis.export import export_checkpoint

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
