"""verl's SFT trainer (``verl.trainer.sft_trainer``, and ``fsdp_sft_trainer`` before verl 0.9) as
trellis's ``sft`` recipe: its data, model, engine, optimizer and trainer keys with verl's semantics."""

from __future__ import annotations

from typing import Any

from trellis_verl_compat import shared_rules as shared
from trellis_verl_compat.features import lora_rules
from trellis_verl_compat.reasons import READ_BY_OTHERS, REASONS, SPEED, TRELLIS_BEHAVIOUR, Known
from trellis_verl_compat.rule import SKIP, Differs, Rule, Source, Unmapped, when


def _messages(value: Any, src: Source) -> Any:
    if value != "messages":
        raise Unmapped(f"trellis reads a row's chat from its 'messages' column, not {value!r}; rename the column")
    return SKIP


def _prompt_key(value: Any, src: Source) -> Any:
    if value != "prompt":
        raise Unmapped(f"trellis reads a prompt-and-response row's prompt from its 'prompt' column, not {value!r}; rename the column")
    return SKIP


def _response_key(value: Any, src: Source) -> Any:
    """verl's older trainer reads the target from ``response_key`` (a dict column's
    ``response_dict_keys`` inside it); trellis reads ``data.response_key``, by default
    ``extra_info.answer`` (verl's GSM8K layout) where a row has it."""
    keys = list(src.get("data.response_dict_keys") or [])
    if value == "extra_info" and keys == ["answer"]:
        return SKIP  # trellis's default column
    if keys:
        raise Unmapped(f"trellis reads the target from one column (data.response_key) or extra_info.answer, not {value}.{keys}")
    return value


def _warmup_fraction(value: Any, src: Source) -> Any:
    """The older trainer's ``warmup_steps_ratio`` x the run's steps (none: SKIP)."""
    steps = int(float(value) * shared.total_steps(src)) if value else 0
    return steps or SKIP


def _hf_warmup(value: Any, src: Source) -> Any:
    """The older trainer's warm-up is transformers' (its first step at lr 0), where there is one."""
    return SKIP if _warmup_fraction(value, src) is SKIP else True


def _truncation(value: Any, src: Source) -> Any:
    if value == "right":
        return SKIP
    if value == "error":
        return Differs(SKIP, "trellis cuts a sample longer than data.max_length on the right, with one counted warning, where verl stops")
    raise Unmapped(f"trellis cuts a sample longer than data.max_length on the right; verl's {value!r} is not that")


def _epoch_freq(value: Any, src: Source) -> Any:
    """verl's SFT validates (saves) every ``test_freq`` (``save_freq``) steps, or ``after_each_epoch``: every epoch's steps."""
    if value == "after_each_epoch":
        epochs = int(src.get("trainer.total_epochs") or 1)
        return max(shared.total_steps({**src, "trainer.total_training_steps": None}) // epochs, 1)
    return shared.freq(value, src)


def _megatron(value: Any, src: Source) -> Any:
    return "megatron" if value == "megatron" else SKIP


def _compute_dtype(value: Any, src: Source) -> Any:
    """verl's mixed-precision dtype: bfloat16 is trellis's ``auto`` (bfloat16 on CUDA, float32 on a CPU)."""
    if value == "bfloat16":
        return SKIP
    return shared.dtype(value, src)


def _hf_model(value: Any, src: Source) -> Any:
    return True if "hf_model" in list(value or ()) else SKIP


SFT_RULES: tuple[Rule, ...] = (
    Rule("model.path", "model.path"),
    Rule("model.partial_pretrain", "model.path", note="verl before 0.9"),
    Rule("model.tokenizer_path", "model.tokenizer_path"),
    Rule("data.train_files", "data.train_path", shared.data_files, "one file or a list"),
    Rule("data.val_files", "data.val_path", shared.data_files, "one file or a list"),
    Rule("data.train_batch_size", "data.batch_samples", note="samples per optimizer step in both"),
    Rule("data.micro_batch_size_per_gpu", "train.micro_batch_samples", note="per rank"),
    Rule("data.max_token_len_per_gpu", "train.max_tokens_per_micro_batch", when("data.use_dynamic_bsz"), "with use_dynamic_bsz"),
    Rule("data.max_length", "data.max_length"),
    Rule("data.truncation", "data.max_length", _truncation, "longer samples are cut on the right"),
    Rule("data.messages_key", "data.train_path", _messages, "the 'messages' column"),
    Rule("data.prompt_key", "data.train_path", _prompt_key, "verl before 0.9: the 'prompt' column"),
    Rule("data.response_key", "data.response_key", _response_key, "verl before 0.9: the target column (extra_info + ['answer']: trellis's default)"),
    Rule("optim.warmup_steps_ratio", "train.optim.warmup_steps", _warmup_fraction, "verl before 0.9: x total steps"),
    Rule("optim.warmup_steps_ratio", "train.optim.warmup_from_zero", _hf_warmup, "verl before 0.9: transformers' warm-up, its first step at lr 0"),
    Rule("optim.lr_scheduler", "train.optim.lr_schedule", shared.schedule, "verl before 0.9"),
    Rule("model.fsdp_config.model_dtype", "backend.dtype", shared.dtype, "verl before 0.9"),
    *lora_rules("model.", "train."),
    Rule("model.enable_gradient_checkpointing", "backend.activation_checkpointing"),
    Rule("model.use_remove_padding", "backend.padding_free"),
    Rule("engine.strategy", "backend.name", _megatron, "megatron -> megatron; fsdp and fsdp2 are fsdp"),
    *(
        Rule(f"engine.{kind}_model_parallel_size", f"backend.{kind}_parallel", when("engine.strategy", lambda v, s: v), "under strategy megatron")
        for kind in ("tensor", "pipeline")
    ),
    Rule("engine.model_dtype", "backend.dtype", shared.dtype, "fp32 -> float32, bf16 -> bfloat16"),
    Rule("engine.dtype", "backend.param_dtype", _compute_dtype, "bfloat16: trellis's auto (bfloat16 on CUDA)"),
    Rule("checkpoint.save_contents", "trainer.save_hf_model", _hf_model, "hf_model: the final model as a Hugging Face folder"),
    *shared.optim("", "train."),
    Rule("trainer.total_training_steps", "trainer.total_steps", shared.steps),
    Rule("trainer.total_epochs", "trainer.total_steps", shared.epochs, "epochs x (training rows // train_batch_size)"),
    Rule("trainer.save_freq", "trainer.save_every_steps", _epoch_freq, "after_each_epoch -> an epoch's steps; -1 -> 0 (the last step only)"),
    Rule("trainer.test_freq", "trainer.val_every_steps", _epoch_freq, "after_each_epoch -> an epoch's steps; -1 -> 0"),
    Rule("trainer.logger", "trainer.trackers", shared.trackers, "jsonl added (metrics.jsonl)"),
    Rule("trainer.default_local_dir", "trainer.run_dir"),
    Rule("trainer.resume_mode", "trainer.resume", shared.resume, "disable -> never; resume_path -> trainer.resume_from_path"),
    Rule("trainer.max_ckpt_to_keep", "trainer.keep_checkpoints", note="null: every checkpoint kept, in both"),
    Rule("trainer.seed", "seed"),
    Rule("trainer.nnodes", "trainer.nnodes"),
    Rule("trainer.n_gpus_per_node", "trainer.procs_per_node"),
    Rule("trainer.n_gpus_per_node", "trainer.controller", shared.controller, "ray when nnodes x n_gpus_per_node > 1"),
)

# verl 0.9.1's sft_trainer_engine.yaml (with its model, engine and optim defaults) where it differs from trellis's sft
SFT_DEFAULTS: Source = {
    "data.train_batch_size": 256,
    "data.micro_batch_size_per_gpu": 4,
    "data.max_length": 1024,
    "data.truncation": "error",
    "model.enable_gradient_checkpointing": True,
    "model.use_remove_padding": True,
    "optim.lr": 1e-3,
    "optim.weight_decay": 0.01,
    "optim.clip_grad": 1.0,
    "trainer.total_epochs": 4,
    "trainer.seed": 1,
    "trainer.n_gpus_per_node": 1,
    "trainer.max_ckpt_to_keep": None,  # every checkpoint kept
}

# the sft config's sections that hold a registered component's options: (section, kind, trellis default name)
SFT_SECTIONS = (("backend", "backend", "fsdp"), ("train.loss", "sft_loss", "cross_entropy"))

# the config groups of verl's sft_trainer_engine.yaml and the option each takes by default; an
# override ``engine=megatron`` chooses an option (a hydra group choice, not a value)
SFT_GROUPS = {"model": "hf_model", "engine": "fsdp", "optim": "fsdp", "profiler": "profiler"}


def group_choices(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """The group choices among an SFT launch's overrides (``engine=megatron``), and the other
    arguments with ``engine.strategy`` set from the engine chosen (before them: theirs wins)."""
    choices, rest = {}, []
    for arg in args:
        key, _, value = arg.lstrip("+").partition("=")
        if key in SFT_GROUPS and value:
            choices[key] = value
        else:
            rest.append(arg)
    return choices, ([f"engine.strategy={choices['engine']}"] if "engine" in choices else []) + rest


# verl SFT values that are what trellis's sft recipe does anyway
SFT_BEHAVIOUR: Source = {
    "model.use_shm": False,
    "model.trust_remote_code": False,
    "model.override_config": {},
    "model.enable_activation_offload": False,
    "model.use_liger": False,
    "model.use_fused_kernels": False,
    "model.fused_kernel_options.impl_backend": "torch",
    "engine.param_offload": False,
    "engine.optimizer_offload": False,
    "engine.offload_policy": False,
    "engine.reshard_after_forward": True,
    "engine.fsdp_size": -1,  # shard over every rank
    "engine.full_determinism": False,
    "engine.forward_only": False,
    "optim.optimizer": "AdamW",
    "optim.optimizer_impl": "torch.optim",
    "optim.total_training_steps": -1,  # filled from the run's step count
    "optim.num_cycles": 0.5,  # half a cosine
    "checkpoint.*": ["model", "optimizer", "extra"],  # a checkpoint holds the weights, the optimizer and the trainer's state
    "data.train_max_samples": -1,
    "data.val_max_samples": -1,
    "data.balance_dp_token": False,
    "data.use_shm": False,
    "data.apply_chat_template_kwargs": {},
    "data.ignore_input_ids_mismatch": False,
    "data.enable_thinking_default": "none",  # the chat template's own default
    "trainer.profile_interval": [-1, -1],
}

SFT_REASONS: tuple[tuple[str, str], ...] = (
    ("*_target_", ""),
    ("engine.ulysses_sequence_parallel_size", "no sequence parallelism"),
    (
        "model.lora.*",
        "verl's LoRA section of its Megatron engine; trellis's adapter is train.adapter, converted from model.lora_rank, "
        "lora_alpha and target_modules",
    ),
    ("model.*", "a model-loading or kernel knob of verl's; trellis loads the folder as transformers does"),
    ("engine.turbo_config.*", "the settings of verl's turbo engine, which the script does not run"),
    ("engine.*_offload", "trellis offloads a role only while a rollout engine generates; an SFT run keeps it on the device"),
    ("engine.seed", "trellis seeds every rank from the run's seed (seed, from trainer.seed)"),
    ("engine.wrap_policy.*", "trellis's fsdp backend shards every decoder layer (no wrap policy)"),
    ("engine.*", SPEED),
    ("optim.*", "trellis's optimizer is torch's AdamW with lr, betas, eps, weight_decay and grad_clip"),
    ("checkpoint.*", "a trellis checkpoint holds the weights, the optimizer and the trainer's state; trainer.save_hf_model adds the model"),
    ("data.pad_mode", "a micro-batch's layout is backend.padding_free (converted from model.use_remove_padding)"),
    (
        "data.prompt_dict_keys",
        "trellis renders a row's 'prompt' column (verl's GSM8K parquet holds the question with its instruction there), "
        "not a key inside another column",
    ),
    ("data.tools_key", "the sft recipe renders a row's messages with the chat template alone (no tools column)"),
    ("data.enable_thinking*", "the sft recipe renders a row with the chat template's own defaults"),
    ("data.apply_chat_template_kwargs", "the sft recipe renders a row with the chat template's own defaults"),
    ("data.num_workers", "rows are tokenised once, in the trainer process"),
    ("data.*", "no trellis sft data option"),
    ("trainer.profile_interval", "no profiler settings"),
)

SFT_KNOWN = Known(
    frozenset(READ_BY_OTHERS) | {"data.use_dynamic_bsz", "optim.zero_indexed_step", "data.response_dict_keys"},
    {**TRELLIS_BEHAVIOUR, **SFT_BEHAVIOUR},
    SFT_REASONS + REASONS,
)
