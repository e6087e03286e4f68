"""/start_profile and /stop_profile: a torch.profiler trace of the scheduler thread's work."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from slime_like.protocol import io_struct as p
from slime_like.reference_engine.scheduler import Scheduler


class Profiler:
    """Starts and stops torch.profiler on the scheduler thread; writes a Chrome trace."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._prof: profile | None = None
        self._path: Path | None = None
        self._steps_left: int | None = None
        self.last_trace: Path | None = None
        scheduler.step_hooks.append(self._on_step)

    async def start(self, req: p.ProfileRequest) -> None:
        """/start_profile: start torch.profiler on the scheduler thread."""
        await asyncio.wrap_future(self.scheduler.call(lambda: self._start(req)))

    async def stop(self) -> Path:
        """/stop_profile: stop and write the Chrome trace; returns its path."""
        return await asyncio.wrap_future(self.scheduler.call(self._stop))

    def _start(self, req: p.ProfileRequest) -> None:
        if self._prof is not None:
            raise RuntimeError("Profiling is already in progress. Call /stop_profile first.")
        wanted = set(req.activities or ["CPU", "GPU"])
        activities = [ProfilerActivity.CPU] if "CPU" in wanted else []
        if "GPU" in wanted and self.scheduler.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        if not activities:
            raise RuntimeError(f"no supported profiler activity in {sorted(wanted)} (CPU, GPU)")
        out_dir = Path(req.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or tempfile.gettempdir())
        out_dir.mkdir(parents=True, exist_ok=True)
        profile_id = req.profile_id or str(time.time())
        self._path = out_dir / f"{profile_id}-TP-0.trace.json"
        self._prof = profile(activities=activities, record_shapes=bool(req.record_shapes),
                             with_stack=bool(req.with_stack))
        self._prof.start()
        self._steps_left = req.num_steps

    def _stop(self) -> Path:
        if self._prof is None:
            raise RuntimeError("Profiling is not in progress. Call /start_profile first.")
        prof, self._prof = self._prof, None
        prof.stop()
        prof.export_chrome_trace(str(self._path))
        self.last_trace = self._path
        self._steps_left = None
        return self._path

    def _on_step(self) -> None:
        if self._prof is None or self._steps_left is None:
            return
        self._prof.step()
        self._steps_left -= 1
        if self._steps_left <= 0:
            self._stop()

