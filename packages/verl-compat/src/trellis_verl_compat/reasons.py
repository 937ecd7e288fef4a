"""Why a verl key is not converted: read by another key's rule, what trellis does anyway, or the
reason it has no trellis setting (printed with the key)."""

from __future__ import annotations

from dataclasses import dataclass

from trellis_verl_compat.features import DLOSS
from trellis_verl_compat.rule import ACTOR, AR, ROLLOUT, Source

# read by another key's rule: not reported as unmapped
READ_BY_OTHERS = {
    ACTOR + "use_dynamic_bsz",
    "critic.use_dynamic_bsz",
    "trainer.resume_from_path",
    "custom_reward_function.name",
    "reward.custom_reward_function.name",
    "reward_model.model.path",
    "reward.reward_model.model_path",
    ACTOR + "use_remove_padding",  # verl's interpolation of model.use_remove_padding
    "data.tool_config_path",  # verl's interpolation of the rollout's
    *(f"reward_model.overlong_buffer.{k}" for k in ("len", "penalty_factor")),
    *(DLOSS + k for k in ("loss_mode", "topk", "use_task_rewards", "distillation_loss_coef", "loss_max_clamp", "log_prob_min_clamp")),
    DLOSS + "use_policy_gradient",
    "distillation.teacher_models.teacher_model.model_path",
    "distillation.teacher_models.teacher_model.key",
    "distillation.teacher_key",
    "*.optim.zero_indexed_step",  # read by the warm-up's rule
}
FILTER_INFLIGHT = "algorithm.filter_groups.max_inflight_gen_batches"

# a value that is what trellis always does: accepted silently (pattern -> value)
TRELLIS_BEHAVIOUR: Source = {
    "data.prompt_key": "prompt",
    "data.reward_fn_key": "data_source",
    "data.filter_overlong_prompts": True,
    "data.return_raw_chat": False,
    "trainer.v1.trainer_mode": "sync",  # generate, then train: trellis's trainer.async_mode=off
    ROLLOUT + "val_kwargs.top_p": 1.0,
    ROLLOUT + "val_kwargs.top_k": -1,
    "reward_model.reward_manager": "naive",
    "trainer.balance_batch": True,
    "*.optim.optimizer": "AdamW",
    "*.optim.optimizer_impl": "torch.optim",
    "*.optim.total_training_steps": -1,  # filled from the run's step count, as trellis's schedule is
    "*.optim.num_cycles": 0.5,  # half a cosine: trellis's cosine schedule
    "*.optim.override_optimizer_config": None,
    ROLLOUT + "do_sample": True,  # sampling at sampling.temperature
    ROLLOUT + "ignore_eos": False,
    ROLLOUT + "calculate_log_probs": True,  # trellis keeps the engine's log-probs of every sampled token
    ROLLOUT + "multi_turn.max_parallel_calls": 1,
    ROLLOUT + "multi_turn.tokenization_sanity_check_mode": "strict",  # trellis checks every turn's ids (sync check)
    ROLLOUT + "mode": "async",
    "algorithm.use_pf_ppo": False,
    "reward.reward_manager.source": "register",
    "reward.reward_manager.module.name": "custom_reward_manager",
    "trainer.val_only": False,
    "trainer.use_v1": True,
    "trainer.del_local_ckpt_after_load": False,
    "trainer.critic_warmup": 0,  # the critic and the actor update from the first step
    ACTOR + "megatron.expert_model_parallel_size": 1,  # no expert parallelism: a dense model, or trellis's
}


def feature_off(key: str, value: object, src: Source) -> bool:
    """Whether ``key`` is a setting of a verl feature that is off (its section's ``enable`` /
    ``enabled`` false, or ``key`` itself that switch at false): verl ignores it too."""
    if isinstance(value, dict) and value.get("enable", value.get("enabled")) is False:
        return True
    parts = key.split(".")
    sections = (".".join(parts[:end]) for end in range(len(parts), 0, -1))
    return any(src.get(f"{section}.{switch}") is False for section in sections for switch in ("enable", "enabled"))


# keys that change how fast or where verl runs, not what it trains
SPEED = "a speed or memory choice of verl's kernels and engines; trellis computes the same quantities its own way"

# the engine knobs of a reward model verl serves (beside a custom function: trellis's reward.judge)
SERVED_MODEL = (
    "the engine and placement knobs of the reward model verl serves; trellis serves it (reward.judge: engine, model and "
    "max_new_tokens converted) in the driver on loopback, the engine's own keys under reward.judge.options"
)
# why a key has no trellis counterpart (first matching pattern; "": nothing to report)
REASONS: tuple[tuple[str, str], ...] = (
    ("*_target_", ""),
    ("*.rollout_n", ""),  # verl's copy of rollout.n
    ("*.strategy", "the backend section (backend.name: fsdp or megatron) runs every role"),
    (ACTOR + "megatron.expert_model_parallel_size", "trellis trains a mixture-of-experts model on fsdp, without expert parallelism (docs/moe.md)"),
    *(
        (
            f"{role}megatron.{kind}_model_parallel_size",
            "every role runs at the backend section's sizes (backend.tensor_parallel, backend.pipeline_parallel)",
        )
        for role in (AR + "ref.", "critic.")
        for kind in ("tensor", "pipeline")
    ),
    (
        "*.optim.lr_scheduler_type",
        "trellis's schedules are constant and cosine (optim.lr_schedule), converted from lr_scheduler_type or warmup_style",
    ),
    ("*.optim.num_cycles", "trellis's cosine is one half cycle (num_cycles 0.5)"),
    ("*.optim.*", "trellis's optimizer is torch's AdamW with lr, betas, eps, weight_decay and grad_clip"),
    *(
        (pattern, SPEED)
        for pattern in (
            "*use_torch_compile",
            "*use_fused_kernels",
            "*entropy_from_logits*",
            "*entropy_checkpointing",
            "*pad_to_length*",
            "*use_prefix_grouper",
            "*forward_max_token_len_per_gpu",
            "*calculate_entropy",
            "*calculate_sum_pi_squared",
            ROLLOUT + "free_cache_engine",
            ROLLOUT + "enable_chunked_prefill",
            ROLLOUT + "enable_prefix_caching",
            ROLLOUT + "max_num_batched_tokens",
            ROLLOUT + "multi_stage_wake_up",
            ROLLOUT + "layered_summon",
            ROLLOUT + "load_format",
            ROLLOUT + "skip_tokenizer_init",
            ROLLOUT + "scheduling_policy",
            ROLLOUT + "checkpoint_engine.*",
            ROLLOUT + "engine_kwargs.*",
            ROLLOUT + "agent.num_workers",
            ROLLOUT + "over_sample_rate",
            "*disable_log_stats",
        )
    ),
    ("*data_loader_seed", "trellis seeds the data order, sampling and dropout from the run's seed"),
    ("*.checkpoint.*", "a trellis checkpoint holds every role's weights, optimizer state and the run's state (trainer.keep_checkpoints)"),
    ("*.qat.*", "quantisation-aware training has no trellis counterpart"),
    (ACTOR + "policy_loss.ppo_kl_coef", "read by verl's ppo_kl policy loss only (trellis: actor.use_kl_loss)"),
    (
        ROLLOUT + "logprobs_mode",
        "trellis's engines return the log-probs of the sampled tokens under the processed distribution (temperature applied), "
        "verl's processed_logprobs",
    ),
    (ROLLOUT + "val_kwargs.*", "validation samples at validation.temperature with sampling's top_p and top_k (no held-out ones of its own)"),
    (ROLLOUT + "dtype", "the engine holds the trainer's weights at the backend's dtype"),
    (ROLLOUT + "seed", "the engines sample from generators seeded by the run's seed (sampling.seed for per-request seeds)"),
    (ROLLOUT + "full_determinism", "trellis's engines sample from seeded generators; bitwise determinism is not promised"),
    (ROLLOUT + "prompt_length", ""),  # verl's copy of data.max_prompt_length
    (ROLLOUT + "nnodes", "trellis's engines run in the trainer's processes unless trainer.rollout_pool gives them their own"),
    (ROLLOUT + "n_gpus_per_node", "trellis's engines run in the trainer's processes unless trainer.rollout_pool gives them their own"),
    (ROLLOUT + "*_parallel_size", "engine parallelism beyond rollout.tensor_parallel_size is not set by trellis"),
    (ROLLOUT + "multi_turn.tool_response_truncate_side", "trellis cuts a tool response at its end (max_tool_response_chars)"),
    (
        ROLLOUT + "multi_turn.use_inference_chat_template",
        "trellis renders every turn with the tokenizer's chat template and keeps the sampled ids token for token",
    ),
    (ROLLOUT + "trace.*", "no rollout tracing (mlflow / weave traces of verl)"),
    (ROLLOUT + "prometheus.*", "no Prometheus metrics of the engine"),
    (ROLLOUT + "mtp", "no multi-token-prediction speculative decoding"),
    (ROLLOUT + "moe_load_balance_metrics_interval", "trellis reports each MoE layer's expert load every step (moe/load_max/layer{i})"),
    (ROLLOUT + "disaggregation.*", "no prefill/decode disaggregation"),
    (AR + "nccl_timeout", "trainer.ray_call_timeout_s bounds every call to the ranks"),
    *(
        (f"critic.model.{key}", f"the backend section's {what} holds for every role (converted from actor_rollout_ref.model.{key})")
        for key, what in (("use_remove_padding", "padding_free"), ("enable_gradient_checkpointing", "activation_checkpointing"))
    ),
    ("critic.fsdp.*", "FSDP sharding and offload are the backend section's options (trellis config show)"),
    ("reward.num_workers", "reward.max_concurrency: samples scored at once"),
    ("reward.sandbox_fusion.*", "a code reward's sandbox is trellis-sandbox's reward options (reward.kwargs)"),
    ("reward.reward_model.rollout.*", SERVED_MODEL),
    ("reward.reward_model.*", "the reward model role is reward.model.path; verl's served generative reward model is reward.judge"),
    ("reward.reward_manager.*", "a custom reward manager class has no trellis counterpart; score with reward.path (a function)"),
    ("algorithm.pf_ppo.*", "read by verl's PF-PPO only"),
    ("transfer_queue.*", "verl's transfer queue (where batches live between workers) has no trellis counterpart"),
    ("skip.*", "verl's cached rollouts for debugging have no trellis counterpart"),
    ("trainer.esi_redundant_time", "checkpoints are due by trainer.save_every_steps (no elastic-instance timing)"),
    ("trainer.ray_wait_register_center_timeout", "trainer.ray_timeout_s bounds Ray's placement"),
    ("trainer.device", "trellis places roles on the devices torch sees (CUDA, else CPU)"),
    ("*fsdp_config.*", "FSDP sharding and offload are the backend section's options (trellis config show)"),
    ("*profiler*", "no profiler settings"),
    ("*forward_micro_batch_size*", "forward passes use the role's micro_batch_samples / max_tokens_per_micro_batch"),
    ("*log_prob_*", "log-prob passes use the role's micro_batch_samples / max_tokens_per_micro_batch"),
    ("*ulysses_sequence_parallel_size", "no sequence parallelism"),
    (
        AR + "model.lora_adapter_path",
        "trellis starts a LoRA adapter at B = 0 (the base model); to start from a saved adapter, merge it into its base "
        "(peft's merge_and_unload) and give the merged folder as actor_rollout_ref.model.path",
    ),
    (AR + "model.exclude_modules", "trellis's LoRA has no exclude list; give target_modules without those modules"),
    (
        AR + "model.lora.*",
        "verl's Megatron-engine LoRA (Megatron module names); trellis's LoRA is lora_rank / lora_alpha / target_modules (actor.adapter)",
    ),
    ("critic.model.lora*", "trellis trains the critic's full weights; LoRA is the actor's (actor.adapter)"),
    (FILTER_INFLIGHT, "trellis generates one dynamic-sampling round at a time"),
    ("reward_model.overlong_buffer.log", ""),  # trellis always logs reward/overlong_penalty_mean
    (
        "distillation.teacher_models.*.inference.*",
        "trellis's teacher is a frozen model in the trainer's processes (teacher.path), not an inference server",
    ),
    ("distillation.distillation_loss.*", "with use_policy_gradient, trellis's distillation advantage goes through actor.policy_loss"),
    ("distillation.*", "the teacher shares the trainer's processes (no pool of its own) and is chosen per run, not per data_source"),
    (AR + "model.*", "model loading knob; trellis loads model.path with the backend's options"),
    ("critic.model.*", "model loading knob; trellis loads critic.model_path with the backend's options"),
    ("*ppo_micro_batch_size", "global micro-batch (deprecated in verl); give ppo_micro_batch_size_per_gpu"),
    ("data.filter_overlong_prompts", "trellis always drops prompts longer than max_prompt_length (with a warning)"),
    ("data.truncation", "trellis drops prompts longer than max_prompt_length (with a warning) instead of truncating"),
    ("data.prompt_key", "the prompt column is always 'prompt'"),
    ("data.return_raw_chat", "trellis keeps every row's chat messages; the multi-turn loop reads them"),
    (AR + "hybrid_engine", "trellis's engine shares the trainer's processes unless trainer.rollout_pool gives it its own"),
    ("data.reward_fn_key", "rewards are picked by 'data_source' (reward.name: auto)"),
    ("data.val_batch_size", "validation generates every held-out prompt at once; cap them with data.val_max_prompts"),
    ("data.*", "no trellis data option"),
    (
        "reward_model.model.input_tokenizer",
        "trellis compares the actor's tokenizer with the reward model's and re-tokenises samples when they differ",
    ),
    ("reward_model.rollout.*", SERVED_MODEL),
    *(
        (f"{rm}{key}", "the reward model's own GPUs in verl; trellis places its role like the actor's and serves a judge engine in the driver")
        for rm in ("reward_model.", "reward.reward_model.")
        for key in ("enable_resource_pool", "n_gpus_per_node", "nnodes")
    ),
    (
        "reward_model.model.type",
        "verl's reward loop serves the model to a custom reward function (generative) when there is one, else scores with it "
        "(discriminative), whatever the type says; so does trellis (reward.judge, else reward.model)",
    ),
    ("reward_model.*", "the reward_model role (reward.model.path) takes the actor's micro-batching and the backend section's options"),
    (
        "trainer.v1.trainer_mode",
        "verl's async trainers resume generations cut by a weight update and train from a replay buffer, with their own "
        "placement; the nearest in trellis is trainer.async_mode=one_step, or fully_async with trainer.max_staleness (whole "
        "steps) and trainer.partial_rollout: set them by hand",
    ),
    (
        "trainer.v1.sampler.max_off_policy_threshold",
        "the versions one trajectory may span in verl's async trainers (dropped or waited for); trellis bounds how many "
        "versions a step's oldest token lags: trainer.max_staleness with trainer.async_mode=fully_async",
    ),
    ("trainer.v1.*", "verl's v1 async trainers (trainer_mode colocate_async / separate_async) have no trellis counterpart"),
    ("async_training.*", "a knob of verl's fully-async rollouter's scheduling; trellis's fully-async mode has none"),
    (
        "rollout.*",
        "the rollout GPUs of verl's one-step-off / fully-async recipes: trellis's engines apart from the trainer are "
        "trainer.rollout_pool=N processes (Ray), each of rollout.tensor_parallel_size devices",
    ),
    (ROLLOUT + "agent.default_agent_loop", "rows without agent_name run multi_turn.agent_loop (trellis's own loops: tool_agent, openai_agent)"),
    ("trainer.project_name", "a run is named by trainer.run_dir (default_local_dir)"),
    ("trainer.experiment_name", "a run is named by trainer.run_dir (default_local_dir)"),
    ("trainer.critic_warmup", "the critic and actor update from the first step"),
    ("trainer.log_val_generations", "no logged generations"),
    ("trainer.max_critic_ckpt_to_keep", "a checkpoint holds every role: trainer.keep_checkpoints"),
    ("defaults", "a YAML file given is read flat; name it with --config-path and --config-name to follow its defaults list"),
)


@dataclass(frozen=True)
class Known:
    """What the converter knows of the verl keys no rule converts: those another rule reads
    (patterns), verl values that are what trellis does anyway, and why the others are not converted."""

    read: frozenset[str]
    behaviour: Source
    reasons: tuple[tuple[str, str], ...]


RL_KNOWN = Known(frozenset(READ_BY_OTHERS), TRELLIS_BEHAVIOUR, REASONS)
