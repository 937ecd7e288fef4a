"""Shared fixtures: a tiny local model (random Qwen2 + trained tokenizer), built once per session;
the checks that an options dataclass declares and enforces ranges for its numbers and the valid
values of its strings."""

from __future__ import annotations

import pytest
import torch

TEXTS = [f"{a}+{b}={a + b} #### {a + b}" for a in range(0, 60, 7) for b in range(0, 60, 5)]


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from trellis_demo.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TEXTS, hidden_size=32, num_layers=2, seed=0))


@pytest.fixture(scope="session")
def tiny_untied_model_path(tmp_path_factory):
    from trellis_demo.tiny import make_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-untied"
    return str(make_tiny_model(path, TEXTS, hidden_size=32, num_layers=2, seed=1, tie_word_embeddings=False))


@pytest.fixture(scope="session")
def tiny_tools_model_path(tmp_path_factory):
    """The tiny model with a chat template that renders tools (``TOOLS_CHAT_TEMPLATE``) and room
    for the tool schemas it puts in every prompt (2048 positions)."""
    from transformers import AutoTokenizer

    from trellis_demo.tiny import TOOLS_CHAT_TEMPLATE, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-tools", TEXTS, hidden_size=32, num_layers=2, max_position_embeddings=2048)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def make_prompts():
    """``make_prompts(tokenizer, texts)``: a prompt Batch (``input_ids``, ``attention_mask``,
    ``position_ids``) left-padded by hand."""
    return _left_padded_prompts


def _left_padded_prompts(tokenizer, texts):
    from trellis.batch import Batch

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return Batch({"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, {"text": texts})


@pytest.fixture
def assert_ranges_enforced():
    """``assert_ranges_enforced(schema, registry)``: every numeric option of ``schema`` declares a
    range, and a value just outside each bound fails validation with an error that names the
    dotted key, the value and the range."""
    return _assert_ranges_enforced


def _assert_ranges_enforced(schema, registry) -> int:
    import typing

    from omegaconf import OmegaConf

    from trellis.config import ConfigError, field_range, numeric_fields, validate

    checked = 0
    hints = typing.get_type_hints(schema)
    for f in numeric_fields(schema):
        allowed = field_range(f)
        assert allowed is not None, f"{schema.__name__}.{f.name} declares no range"
        is_list = typing.get_origin(hints[f.name]) is list
        for bad in _just_outside(allowed):
            with pytest.raises(ConfigError) as err:
                validate(OmegaConf.create({f.name: [bad] if is_list else bad}), schema, registry, "section.")
            message = str(err.value)
            assert f"'section.{f.name}'" in message and repr(bad) in message and f"must be {allowed}" in message, message
            checked += 1
    return checked


def _just_outside(allowed) -> list:
    """A value beyond each declared bound (the bound itself when it is excluded)."""
    out = []
    if allowed.gt is not None:
        out.append(allowed.gt)
    if allowed.ge is not None:
        out.append(allowed.ge - 1)
    if allowed.lt is not None:
        out.append(allowed.lt)
    if allowed.le is not None:
        out.append(allowed.le + 1)
    assert out, "a range with no bound"
    return out


@pytest.fixture
def assert_choices_enforced():
    """``assert_choices_enforced(schema, registry, open_ended=())``: every string option of
    ``schema`` declares its valid values (``choice``) unless named in ``open_ended`` (paths, names,
    free text), and a near miss of each fails validation with an error that names the dotted key,
    the value, the valid values and the closest of them. A choice of a component kind with no
    names in ``registry`` is skipped. Returns how many were checked."""
    return _assert_choices_enforced


def _assert_choices_enforced(schema, registry, open_ended=()) -> int:
    import typing

    from omegaconf import OmegaConf

    from trellis.config import ConfigError, field_choices, string_fields, validate

    checked = 0
    for f in string_fields(schema):
        choices = field_choices(f)
        if f.name in open_ended:
            assert choices is None, f"{schema.__name__}.{f.name} declares choices but is listed as open-ended"
            continue
        assert choices is not None, f"{schema.__name__}.{f.name} declares no choices (make it with trellis.choice, or list it as open-ended)"
        valid = list(choices.values) or registry.names(choices.kind)
        if not valid:
            continue
        bad = valid[-1] + "_"
        is_list = typing.get_origin(typing.get_type_hints(schema)[f.name]) is list
        with pytest.raises(ConfigError) as err:
            validate(OmegaConf.create({f.name: [bad] if is_list else bad}), schema, registry, "section.")
        message = str(err.value)
        assert message.startswith(f"config key 'section.{f.name}' is ") and repr(bad) in message, message
        assert all(v in message for v in valid) and f"did you mean {valid[-1]!r}?" in message, message
        checked += 1
    return checked
