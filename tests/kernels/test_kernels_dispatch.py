"""Which path a kernel call takes, and the NaN-poisoning debug switch."""

from __future__ import annotations

import pytest
import torch

from kernels import _dispatch
from kernels._dispatch import new_buffer, poison, wants_triton


def test_default_follows_the_device() -> None:
    assert wants_triton(torch.zeros(1), None) is False
    assert wants_triton(torch.zeros(1), False) is False
    if torch.cuda.is_available():
        assert wants_triton(torch.zeros(1, device="cuda"), None) is True


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_dispatch, "triton_interpreter_on", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        wants_triton(torch.zeros(1), True)
    monkeypatch.setattr(_dispatch, "triton_interpreter_on", lambda: True)
    assert wants_triton(torch.zeros(1), True) is True


def test_poisoned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(poison, "enabled", True)
    assert new_buffer((3,), torch.float32, torch.device("cpu")).isnan().all()
    assert (new_buffer((2,), torch.int64, torch.device("cpu")) == -1).all()
