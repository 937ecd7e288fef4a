"""String options whose values are open (paths, names, free text), by options class: what
``assert_choices_enforced`` leaves alone in core's sections (tests/core) and trellis-algos' recipes' (tests/algos)."""

OPEN_ENDED = {
    "AdapterConfig": {"target_modules"},  # module-name suffixes of the model at hand, or all-linear
    "AgentLoopConfig": {"name", "component"},  # component: a registered agent loop, checked with the section
    "CriticConfig": {"model_path"},
    "InteractionConfig": {"name", "component", "verl_class"},  # component: a registered name, checked with the section
    "JudgeEngineConfig": {"model"},  # a folder; engine is a choice of the rollout kind's names
    "ModelConfig": {"path", "tokenizer_path"},
    "PromptData": {"image_key"},  # a column of the user's rows
    "MultiTurnConfig": {"agent", "environment"},  # a function or class: path/to/file.py:name, checked with the section
    "RLConfig": {"recipe"},
    "RewardConfig": {"name", "path"},  # a registered reward or a function in reward.path
    "RewardTerm": {"name", "path", "key"},
    "RewardModelConfig": {"path", "key"},
    "RMConfig": {"recipe"},
    "SFTConfig": {"recipe"},
    "SFTData": {"response_key", "image_key"},  # columns of the user's rows
    "SPINConfig": {"recipe"},
    "TeacherConfig": {"path"},
    "ToolConfig": {"component", "verl_class"},
    "TrainerConfig": {"run_dir", "threads", "resume", "resume_allow_changes"},  # threads: auto or a count; resume: auto, never or a path
}
OPEN_ENDED["RLTrainerConfig"] = OPEN_ENDED["TrainerConfig"]  # the rl recipe's trainer section adds async_mode
