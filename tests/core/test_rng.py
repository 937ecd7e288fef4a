"""RNG checkpoints across machines with different numbers of visible GPUs, on a simulated CUDA
(this machine has none): ``torch.cuda`` is replaced by a stand-in with N devices whose per-device
``set_rng_state`` refuses a device that does not exist, as the real one does."""

from __future__ import annotations

import pytest
import torch

from trellis import rng


class FakeCuda:
    """``n`` visible devices, the current one 0; per-device generator states are distinct tensors."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.states = {i: torch.full((16,), i + 10, dtype=torch.uint8) for i in range(n)}

    def install(self, monkeypatch) -> None:
        for name in ("is_available", "is_initialized"):
            monkeypatch.setattr(torch.cuda, name, lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[0 if device == "cuda" else int(device)].clone())
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [self.states[i].clone() for i in range(self.n)])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: [self.set_state(s, i) for i, s in enumerate(states)])

    def set_state(self, state: torch.Tensor, device="cuda") -> None:
        index = 0 if device == "cuda" else int(device)
        if index >= self.n:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (only {self.n} visible)")
        self.states[index] = state.clone()


def test_a_state_saved_with_two_visible_gpus_restores_with_one(monkeypatch):
    saving = FakeCuda(2)
    saving.install(monkeypatch)
    saved = rng.get_rng_state()
    assert torch.equal(saved["cuda"], saving.states[0])  # the current device's state alone
    one = FakeCuda(1)
    one.states[0].zero_()
    one.install(monkeypatch)
    rng.set_rng_state(saved)
    assert torch.equal(one.states[0], saving.states[0])


def test_an_older_checkpoint_with_every_devices_state_restores_the_current_ones(monkeypatch):
    two = FakeCuda(2)
    two.install(monkeypatch)
    old = {**rng.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()}
    one = FakeCuda(1)
    one.install(monkeypatch)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_rng_state_all(old["cuda"])  # what restoring every saved device did
    rng.set_rng_state(old)
    assert torch.equal(one.states[0], two.states[0])
