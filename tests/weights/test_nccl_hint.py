"""A trainer that disables NCCL transports its engines keep is told what is wrong."""

from __future__ import annotations

from slime_like.weights.group_setup import nccl_env_hint


def test_p2p_or_shm_disabled_in_the_trainer_is_named(monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.delenv("NCCL_SHM_DISABLE", raising=False)
    assert nccl_env_hint() == ""
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    assert nccl_env_hint() == ""
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setenv("NCCL_SHM_DISABLE", "1")
    hint = nccl_env_hint()
    assert "NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1" in hint
    assert "ring 0 does not contain rank 1" in hint and "Unset them" in hint
