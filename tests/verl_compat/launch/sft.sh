#!/usr/bin/env bash
# The shape of verl's examples/sft/gsm8k/run_qwen_05_sp2.sh on verl 0.9.1's engine trainer
# (verl.trainer.sft_trainer): multi-turn `messages` rows, the FSDP engine with sequence parallelism,
# a cosine schedule with warm-up, LoRA on every linear layer, launched by torchrun.
set -xeuo pipefail

NUM_GPUS=${NUM_GPUS:-8}
TRAIN_FILES=${HOME}/data/gsm8k_sft/train.parquet
VAL_FILES=${HOME}/data/gsm8k_sft/test.parquet
MODEL_PATH=${MODEL_PATH:-${HOME}/models/Qwen2.5-0.5B-Instruct}
ckpts_home=${ckpts_home:-${HOME}/verl/test/gsm8k-sft}

ENGINE_CONFIG="\
    engine=fsdp \
    optim=fsdp \
    optim.lr=1e-5 \
    optim.lr_warmup_steps_ratio=0.05 \
    optim.weight_decay=0.1 \
    optim.betas=[0.9,0.95] \
    optim.clip_grad=1.0 \
    optim.min_lr_ratio=0.1 \
    optim.lr_scheduler_type=cosine \
    engine.ulysses_sequence_parallel_size=2 \
    engine.strategy=fsdp"

torchrun --standalone --nnodes=1 --nproc_per_node=${NUM_GPUS} -m verl.trainer.sft_trainer \
    data.train_files="${TRAIN_FILES}" \
    data.val_files="${VAL_FILES}" \
    data.train_batch_size=256 \
    data.micro_batch_size_per_gpu=4 \
    data.max_length=2048 \
    data.pad_mode=no_padding \
    data.truncation=error \
    data.use_dynamic_bsz=True \
    data.max_token_len_per_gpu=8192 \
    data.messages_key=messages \
    model.path=$MODEL_PATH \
    model.lora_rank=32 \
    model.lora_alpha=16 \
    model.target_modules=all-linear \
    ${ENGINE_CONFIG} \
    trainer.test_freq=after_each_epoch \
    trainer.save_freq=-1 \
    trainer.logger=['console','wandb'] \
    trainer.project_name=gsm8k-sft \
    trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct \
    trainer.total_epochs=2 \
    trainer.default_local_dir="${ckpts_home}" \
    trainer.resume_mode=disable $@
