#!/usr/bin/env bash
# Fills .whl/ (git ignores it) with what bench/device_check.sh installs on the H200 machine: the
# project's own wheels, built from this tree, and the dependencies its image lacks, at the lock's
# versions. The image (python 3.12, torch 2.11, transformers 5.17, tokenizers, safetensors,
# huggingface_hub, numpy, pyarrow, matplotlib, pluggy, pytest, einops, psutil, peft ...) is listed
# in the device tool's KINDS.md. PY=3.11 fetches wheels for a rehearsal on this machine instead.
#
#   bash bench/device_wheels.sh          # then: run(command="bash bench/device_check.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
MISSING="omegaconf tensordict pyvers megatron-core mbridge"  # not in the image (cloudpickle, numpy are)
rm -rf .whl && mkdir .whl
python3 -m pip wheel -q --no-deps -w .whl packages/core packages/algos packages/backend-fsdp \
  packages/rollout-hf packages/backend-megatron
pins=$(for name in $MISSING; do grep -i "^$name==" locks/project.txt || { echo "$name: not in locks/project.txt" >&2; exit 1; }; done)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
ls .whl
echo "$(du -sm .whl | cut -f1) MiB in .whl (the device call carries 64 MiB with the tree)"
