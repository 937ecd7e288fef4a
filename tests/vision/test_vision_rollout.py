"""Image prompts through the HF engine and the FSDP backend: the trainer's log-probs equal the
engine's token for token (the images are read: without them they differ), a placeholder sampled in a
response ends it and trains exactly, and an engine or backend that takes no images is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from images import image_row, squares
from transformers import AutoTokenizer
from trellis_vision.prompts import ImagePrompts

from trellis.batch import Batch
from trellis.interfaces.backend import IMAGE_INPUTS, MODEL_INPUTS
from trellis.interfaces.dispatch import DP_SPLIT, Mesh, Route
from trellis.interfaces.rollout import RolloutSpec, SamplingParams
from trellis.runtime.controller import RolloutGroup, WorkerGroup
from trellis_algos import PromptDataset

sys.path.insert(0, str(Path(__file__).parents[1] / "fsdp"))
from test_fsdp_worker import OBJECTIVES, actor_options, make_worker  # noqa: E402


def prompts(path: str) -> Batch:
    """Mixed prompt widths: one image, two images of other sizes, a text-only row."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [
        image_row("<image>how many squares?", [squares("red", 2)], "2"),
        image_row("red <image> green <image>?", [squares("blue", 1, (112, 56)), squares("green", 3, (56, 84))], "4", 1),
        {**image_row("how many squares?", [], "1", 2), "images": None},
    ]
    encoder = ImagePrompts(path, tokenizer, type("Data", (), {"image_key": "images"}))
    return PromptDataset(rows, tokenizer, 256, encoder=encoder).as_batch()


@pytest.fixture(scope="module")
def sampled(tiny_vision_model_path, registry):
    engine = registry.get("rollout", "hf").obj(
        RolloutSpec(tiny_vision_model_path, None, AutoTokenizer.from_pretrained(tiny_vision_model_path), seed=0)
    )
    batch = prompts(tiny_vision_model_path)
    return engine.generate(batch.select(*engine.model_inputs), SamplingParams(n=2, temperature=1.0, max_new_tokens=8))


def test_trainer_log_probs_equal_the_engines_on_image_prompts(tiny_vision_model_path, registry, sampled):
    worker = make_worker(
        registry, tiny_vision_model_path, "actor", actor_options(registry), OBJECTIVES["actor"]
    )  # micro-batches of 2 samples: rows with 1, 2 and 0 images mixed
    assert IMAGE_INPUTS in sampled.keys() and len(sampled) == 6
    mask = sampled["response_mask"].bool()
    trainer = worker.forward(sampled, ("log_probs",))["log_probs"]
    assert float((trainer - sampled["rollout_log_probs"])[mask].abs().max()) < 1e-5
    # the images are read: the image rows' log-probs move without them, the text row's do not
    blind = worker.forward(sampled.select(*MODEL_INPUTS, "responses", "response_mask"), ("log_probs",))["log_probs"]
    gaps = ((blind - trainer).abs() * mask).amax(-1)
    assert (gaps[:4] > 1e-3).all() and float(gaps[4:].max()) < 1e-5


def test_a_placeholder_sampled_in_a_response_ends_it_and_its_log_probs_stay_exact(tiny_vision_model_path, registry, sampled):
    worker = make_worker(registry, tiny_vision_model_path, "actor", actor_options(registry), OBJECTIVES["actor"])
    pad = AutoTokenizer.from_pretrained(tiny_vision_model_path).convert_tokens_to_ids("<|image_pad|>")
    batch = sampled[[0, 2]]
    last = batch["response_mask"].sum(-1) - 1
    ended = batch["responses"].clone()
    ended[torch.arange(2), last] = pad  # each response ends at a sampled image placeholder
    batch["responses"] = ended
    batch["input_ids"] = torch.cat([batch["prompts"], ended], 1)
    log_probs = worker.forward(batch, ("log_probs",))["log_probs"]
    # equal, at every response position, to the log-probs of the same tokens with an ordinary last token
    # (no output read comes after it), and the placeholder's own log-prob is the model's
    ordinary = batch[torch.arange(2)]
    ordinary["input_ids"] = torch.cat([batch["prompts"], sampled[[0, 2]]["responses"]], 1)
    reference = worker.forward(ordinary, ("log_probs",))["log_probs"]
    before = torch.arange(ended.shape[1])[None] < last[:, None]
    torch.testing.assert_close(log_probs[before], reference[before])
    assert torch.isfinite(log_probs).all() and (log_probs[torch.arange(2), last] < 0).all()


def test_a_backend_that_takes_no_images_is_refused_before_its_forward(sampled):
    class Ranks(WorkerGroup):
        def _execute(self, method, per_rank_args, kwargs):
            raise AssertionError("a forward without the images ran")

    text_only = Ranks("actor", Mesh.data_parallel(1), {"log_prob": Route(DP_SPLIT, (*MODEL_INPUTS, "responses"))})
    with pytest.raises(ValueError, match="the backend of role 'actor' takes no images .multi_modal_inputs is not among its model_inputs."):
        text_only.log_prob(sampled)


def test_an_engine_that_takes_no_images_is_refused_before_it_generates(tiny_vision_model_path):
    class TextOnly(RolloutGroup):
        def _generate(self, prompts, params):
            raise AssertionError("generated from image prompts without the images")

    group = TextOnly()
    group.described_by((torch.float32, "TextOnlyEngine", MODEL_INPUTS))
    with pytest.raises(ValueError, match="rollout engine TextOnlyEngine takes no images"):
        group.generate(prompts(tiny_vision_model_path), SamplingParams(n=1))


def update_batch(sampled: Batch) -> Batch:
    """The samples with random sequence advantages and the engine's log-probs as the old ones."""
    batch = sampled[torch.arange(len(sampled))]
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0])[:, None]
    batch["advantages"] = signs * batch["response_mask"]
    batch["old_log_probs"] = batch["rollout_log_probs"]
    return batch


def weights_moved_by_one_update(registry, path, sampled, role_options=None, **backend_options) -> dict[str, bool]:
    """Exported tensor name -> whether one policy update on image samples changed it."""
    worker = make_worker(registry, path, "actor", role_options or actor_options(registry), OBJECTIVES["actor"], **backend_options)
    before = {name: t.clone() for bucket in worker.export_weights() for name, t in bucket}
    worker.train("update", update_batch(sampled))
    return {name: not torch.equal(t, before[name]) for bucket in worker.export_weights() for name, t in bucket}


def test_the_vision_tower_trains_with_the_images_unless_frozen(tiny_vision_model_path, registry, sampled):
    moved = weights_moved_by_one_update(registry, tiny_vision_model_path, sampled)
    assert all(moved[name] for name in moved if ".visual." in name and name.endswith("weight") and "norm" not in name)
    frozen = weights_moved_by_one_update(registry, tiny_vision_model_path, sampled, freeze_vision_tower=True)
    assert not any(frozen[name] for name in frozen if ".visual." in name)
    assert frozen["model.language_model.layers.0.self_attn.q_proj.weight"] and frozen["model.language_model.embed_tokens.weight"]


def test_lora_on_the_language_model_leaves_the_frozen_vision_tower_out(tiny_vision_model_path, registry, sampled):
    lora = actor_options(registry, adapter={"rank": 4, "alpha": 8, "target_modules": ["all-linear"]})
    worker = make_worker(registry, tiny_vision_model_path, "actor", lora, OBJECTIVES["actor"], freeze_vision_tower=True)
    assert worker.backend.layers and not [name for name in worker.backend.layers if ".visual" in name]
    moved = weights_moved_by_one_update(registry, tiny_vision_model_path, sampled, lora, freeze_vision_tower=True)
    assert not any(moved[name] for name in moved if ".visual." in name)
    assert moved["model.language_model.layers.0.self_attn.q_proj.weight"]  # the adapter, merged on export
    config, _ = worker.export_adapter()
    assert config["exclude_modules"] == r"model\.visual(\..*)?"


def test_freezing_the_vision_tower_of_a_text_model_is_refused(tiny_model_path, registry):
    with pytest.raises(ValueError, match="'backend.freeze_vision_tower' is true, but .* has no vision tower; set it to false"):
        make_worker(registry, tiny_model_path, "actor", actor_options(registry), OBJECTIVES["actor"], freeze_vision_tower=True)


def test_padding_free_forwards_lay_out_each_samples_image_positions(tiny_vision_model_path, registry, sampled):
    """verl's use_remove_padding: the packed row's log-probs, entropies and gradients equal the padded forward's."""
    padded = make_worker(registry, tiny_vision_model_path, "actor", actor_options(registry), OBJECTIVES["actor"])
    packed = make_worker(registry, tiny_vision_model_path, "actor", actor_options(registry), OBJECTIVES["actor"], padding_free=True)
    mask = sampled["response_mask"].bool()
    a, b = (w.forward(sampled, ("log_probs", "entropy")) for w in (padded, packed))
    for name in ("log_probs", "entropy"):
        torch.testing.assert_close(b[name][mask], a[name][mask], atol=1e-5, rtol=1e-5)
    assert float((b["log_probs"] - sampled["rollout_log_probs"])[mask].abs().max()) < 1e-5
    moved = {}
    for name, worker in (("padded", padded), ("packed", packed)):
        worker.train("update", update_batch(sampled))
        moved[name] = {n: t.clone() for bucket in worker.export_weights() for n, t in bucket}
    for name, tensor in moved["padded"].items():
        torch.testing.assert_close(moved["packed"][name], tensor, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
