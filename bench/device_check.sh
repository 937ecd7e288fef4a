#!/usr/bin/env bash
# GPU checks on the bare torch+CUDA machine (no network); logs in $OUT. bench/device_wheels.sh fills
# .whl/ (the project's wheels + what the image lacks) first. SMOKE=--tiny rehearses it on a CPU.
set -u
OUT=${OUT:-out} SMOKE=${SMOKE:-}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >"$OUT/install.log" 2>&1; echo "install rc=$?" | tee "$OUT/summary.txt"
export PYTHONPATH=/tmp/site
run() { # name seconds command...: log, exit status to summary.txt
  local name=$1 s=$2; shift 2
  timeout "$s" "$@" >"$OUT/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$OUT/summary.txt"
}
run doctor 60 python3 -m trellis.cli doctor
run fsdp_hf 140 python3 bench/gpu_smoke.py $SMOKE --rollout hf
run offload_padfree 140 python3 bench/gpu_smoke.py $SMOKE --rollout hf backend.padding_free=true \
  backend.offload_params=true backend.offload_optimizer=true rollout.share_actor_weights=false
run megatron 110 python3 -m pytest -x -q tests/megatron/test_distributed.py \
  "tests/megatron/test_training.py::test_actor_update_equals_fsdp[tp1]"
# NCCL: each GPU a rank, at most 2 (NCCL refuses two ranks on one GPU)
run nccl 60 python3 -c '
import torch, torch.distributed as d, torch.multiprocessing as mp
def f(r, w):
    torch.cuda.set_device(r); d.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=r, world_size=w)
    t = torch.full((1 << 20,), r + 1.0, device="cuda"); d.all_reduce(t)
    assert t[0].item() == w * (w + 1) / 2; print("rank", r, "of", w, "nccl", torch.cuda.nccl.version(), "ok")
    d.destroy_process_group()
w = min(2, torch.cuda.device_count()); assert w, "no CUDA device"; mp.spawn(f, args=(w,), nprocs=w)'
