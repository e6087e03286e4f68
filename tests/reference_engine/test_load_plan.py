"""Load plans: a flattened bucket lands through cached plans into parameter arenas (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slime_like.protocol.buckets import dtype_name, flatten
from slime_like.reference_engine.load_plan import (
    ParamArena,
    build_plan,
    copy_planned,
    distributed_entries,
    request_key,
)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(8, 16, dtype=torch.bfloat16))   # 256 bytes
        self.b = nn.Parameter(torch.randn(4, 32, dtype=torch.bfloat16))   # 256 bytes
        self.c = nn.Parameter(torch.randn(5, dtype=torch.bfloat16))       # 10 bytes: padded
        self.d = nn.Parameter(torch.randn(64, dtype=torch.float32))       # another dtype


def _key(named):
    return request_key([n for n, _ in named], [dtype_name(t.dtype) for _, t in named],
                       [list(t.shape) for _, t in named])


def _land(params, arena, named):
    buf, _ = flatten(named)
    plan = build_plan(distributed_entries(_key(named)), params, arena, tied=False,
                      architecture="test")
    assert not plan.problems, plan.problems
    copy_planned(plan, buf)
    return plan


def test_arena_keeps_values_and_an_ordered_bucket_is_one_copy():
    model = _Model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    arena = ParamArena(list(params.values()))
    assert len(arena.segments) == 2  # one per dtype
    for n, p in params.items():
        assert torch.equal(p, before[n])
        assert p.untyped_storage().data_ptr() == arena.segments[arena.place[id(p)][0]].data_ptr()
    new = [("a", torch.randn(8, 16, dtype=torch.bfloat16)), ("b", torch.randn(4, 32, dtype=torch.bfloat16))]
    plan = _land(params, arena, new)
    assert len(plan.runs) == 1 and not plan.converts
    assert torch.equal(model.a, new[0][1]) and torch.equal(model.b, new[1][1])


def test_any_order_and_dtype_conversions_still_land():
    model = _Model()
    params = dict(model.named_parameters())
    arena = ParamArena(list(params.values()))
    new = [("d", torch.randn(64, dtype=torch.float32)),   # 4-byte itemsize first (alignment)
           ("b", torch.randn(4, 32, dtype=torch.float32)),  # float32 into a bfloat16 parameter
           ("c", torch.randn(5, dtype=torch.bfloat16)),
           ("a", torch.randn(8, 16, dtype=torch.bfloat16))]
    plan = _land(params, arena, new)
    assert len(plan.runs) == 3 and len(plan.converts) == 1
    assert torch.equal(model.d, new[0][1]) and torch.equal(model.c, new[2][1])
    assert torch.equal(model.a, new[3][1])
    assert torch.equal(model.b, new[1][1].to(torch.bfloat16))


def test_unknown_names_and_wrong_shapes_are_problems_not_copies():
    model = _Model()
    params = dict(model.named_parameters())
    arena = ParamArena(list(params.values()))
    named = [("a", torch.zeros(8, 16, dtype=torch.bfloat16)), ("nope", torch.zeros(2, dtype=torch.bfloat16)),
             ("b", torch.zeros(32, 4, dtype=torch.bfloat16))]
    plan = build_plan(distributed_entries(_key(named)), params, arena, tied=False, architecture="test")
    assert len(plan.problems) == 2
    assert "unknown parameter 'nope'" in plan.problems[0]
    assert "shape mismatch for 'b'" in plan.problems[1]


def test_engine_receiver_reuses_plans_and_rebuilds_them_after_release(tiny_model_dir):
    from slime_like.models.loading import load_pretrained
    from slime_like.reference_engine.weight_receiver import WeightReceiver

    model = load_pretrained(tiny_model_dir)
    receiver = WeightReceiver(model, tp_rank=0, tp_size=1, device=torch.device("cpu"),
                              model_path=str(tiny_model_dir), load_format="dummy")
    named = [(n, torch.randn_like(p)) for n, p in list(receiver.params.items())[:6]]
    key = _key(named)
    buf, _ = flatten(named)
    for _ in range(2):
        copy_planned(receiver._plan(key), buf)
    assert (receiver.plans.misses, receiver.plans.hits) == (1, 1)
    receiver.release_weights()
    receiver.resume_weights()
    copy_planned(receiver._plan(key), buf)
    assert receiver.plans.misses == 2  # the old plan pointed at the released storage
    for n, t in named:
        assert torch.equal(receiver.params[n], t), n


def test_ipc_storages_stay_open_for_the_lifetime_each_load_asked_for():
    """A rotating pack buffer is opened once per sync; a buffer sent with keep_ipc_mapping
    stays open past the session until a session ends that did not ask to keep it again;
    everything else is closed at the session's end (a sender that frees it gets it back)."""
    from slime_like.reference_engine.ipc_mappings import (
        KEPT,
        LOAD,
        PER_SESSION,
        SESSION,
        IpcMappings,
    )

    m = IpcMappings()
    buffers = [torch.zeros(64, dtype=torch.uint8) for _ in range(PER_SESSION + 1)]
    assert not m.hold(buffers[0], SESSION)
    assert not m.hold(buffers[1], SESSION)
    assert m.hold(buffers[0], SESSION)  # reused bucket after bucket: one entry
    assert m.stats()["session"] == 2
    for b in buffers[2:]:
        m.hold(b, SESSION)
    assert m.stats()["session"] == PER_SESSION  # bounded, oldest out first
    assert not m.hold(buffers[1], LOAD)  # buffers[1] went out first: no longer open
    kept = torch.zeros(64, dtype=torch.uint8)
    m.hold(kept, KEPT)
    assert m.end_session() == 1 and m.stats()["session"] == 0
    assert m.hold(kept, KEPT)  # the next session finds it open, and keeps it again
    assert m.end_session() == 1
    assert m.hold(kept, SESSION)  # sent without keep_ipc_mapping: closed at this end
    assert m.end_session() == 0
    assert m.stats() == {"held": 0, "session": 0, "opened": PER_SESSION + 3, "reused": 3}
    with pytest.raises(ValueError, match="lifetime"):
        m.hold(kept, "forever")


def test_a_bucket_whose_offsets_or_dtype_are_not_what_they_claim_is_refused_by_name():
    """Payload metadata comes from another process: a bad field names its tensor."""
    model = _Model()
    params = dict(model.named_parameters())
    arena = ParamArena(list(params.values()))
    entries = [("a", torch.bfloat16, (8, 16), 0.0, 256),           # a float offset
               ("b", torch.bfloat16, (4, 32), 512, 256),           # end before start
               ("d", "float32", (64,), 512, 768)]                  # not a torch dtype
    plan = build_plan(entries, params, arena, tied=False, architecture="test")
    assert len(plan.problems) == 3
    assert "'a'" in plan.problems[0] and "byte range" in plan.problems[0]
    assert "'b'" in plan.problems[1]
    assert "'d'" in plan.problems[2] and "dtype" in plan.problems[2]
    assert not plan.runs and not plan.converts
