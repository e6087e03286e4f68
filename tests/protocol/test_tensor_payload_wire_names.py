"""Functions on the wire carry sglang's global names, as its SafeUnpickler requires."""

from __future__ import annotations

import pickletools

from slime_like.protocol.tensor_payload import rebuild_cuda_tensor, serialize_bytes


def test_cuda_rebuild_function_is_pickled_under_sglangs_name():
    # A CUDA tensor's handle is rebuilt by this function; pickling it alone shows the name
    # the engine (ours or sglang's) must resolve, without needing a GPU here.
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(serialize_bytes(rebuild_cuda_tensor))]
    strings = [arg for name, arg in ops if isinstance(arg, str)]
    assert "sglang.srt.utils.patch_torch" in strings
    assert "_rebuild_cuda_tensor_modified" in strings
    assert not any("slime_like" in s for s in strings)
