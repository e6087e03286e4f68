"""A CUDA IPC "ready" event: the trainer's writes, waited for on the engine's GPU stream.

Before a `tensor` request whose tensors the trainer just wrote (an FP8 quantize into the
kept copy, a step into flat parameters), the trainer had to wait on its host until its
stream drained, then send: the engine's HTTP round trip, unpickling and copy plan then
ran after the GPU work instead of beside it. With an engine that advertises
`READY_EVENT_KEY` in `/server_info`, the trainer instead records one interprocess event on
its stream and sends its handle in the request (`ready_event`); the engine's stream waits
for that event before its copy (`cudaStreamWaitEvent`: no host wait on either side), and
the engine still answers only once its copy is done, as before.

One event per sender is enough: the engine enqueues its wait before it answers, and the
trainer records the event again only for a later request, so an engine waits at worst for
a later point of the same stream (never an earlier one). sglang has no such field; engines
that do not advertise the key get the host synchronize.
"""

from __future__ import annotations

import base64

import torch

#: ours, in /server_info: the engine's tensor loads honour `ready_event`
READY_EVENT_KEY = "ipc_ready_event"


class ReadyEvent:
    """The trainer's side: one interprocess event, recorded before each request."""

    def __init__(self, device: torch.device):
        self.device = device
        self._event: torch.cuda.Event | None = None
        self._handle: str | None = None

    def record(self) -> str:
        """Record the event on the device's current stream; its handle for the request."""
        if self._event is None:
            self._event = torch.cuda.Event(enable_timing=False, interprocess=True)
        self._event.record(torch.cuda.current_stream(self.device))
        if self._handle is None:  # the handle is the event's, not the record's: made once
            self._handle = base64.b64encode(self._event.ipc_handle()).decode()
        return self._handle


class OpenedEvents:
    """The engine's side: each sender's event opened once, by its handle."""

    def __init__(self, device: torch.device, most: int = 16):
        self.device = device
        self.most = most
        self._opened: dict[str, torch.cuda.Event] = {}
        self.waited = 0  # loads that waited for an event (the engine reports it)

    def wait(self, handle: str) -> None:
        """Make the device's current stream wait for the sender's last record."""
        event = self._opened.get(handle)
        if event is None:
            try:
                raw = base64.b64decode(handle, validate=True)
            except ValueError as e:
                raise ValueError(f"ready_event is not a base64 CUDA IPC event handle: {e}") \
                    from None
            if len(self._opened) >= self.most:  # senders come and go: keep the last few
                self._opened.pop(next(iter(self._opened)))
            event = self._opened[handle] = torch.cuda.Event.from_ipc_handle(self.device, raw)
        torch.cuda.current_stream(self.device).wait_event(event)
        self.waited += 1
