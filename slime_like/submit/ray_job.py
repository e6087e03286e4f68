"""Submit the job to a Ray cluster once it can take it, follow its logs, return its outcome.

    python -m slime_like.submit.ray_job --address http://head:8265 [--timeout S] -- python -m ...

`ray job submit` fails at once with "No available agent to submit job" when the head
node's job agent has not registered yet (a fresh or loaded cluster), and the dashboard's
`/api/version` answers before that agent is up, so polling it is not enough. This waits
for the dashboard, then retries the submission only while the answer is that one error
(the job was not created, so a retry cannot run it twice), all within one deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from slime_like.errors import SlimeLikeError

NO_AGENT = "No available agent"
POLL_S = 2.0


class JobSubmitError(SlimeLikeError):
    """The cluster did not take the job: unreachable, no job agent in time, or refused."""


def _connect(address: str):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def wait_and_submit(address: str, entrypoint: str, *, runtime_env: dict[str, Any] | None = None,
                    timeout_s: float = 120.0, submission_id: str | None = None,
                    connect: Callable[[str], Any] = _connect, say=print) -> tuple[Any, str]:
    """(client, submission id) once the cluster accepted the job; JobSubmitError at the deadline."""
    deadline = time.monotonic() + timeout_s
    submission_id = submission_id or f"slime_like_{time.strftime('%Y%m%d_%H%M%S')}_" \
                                     f"{uuid.uuid4().hex[:6]}"
    waiting_for, last = "the Ray dashboard to answer", ""
    client = None
    announced = False
    while True:
        try:
            if client is None:
                client = connect(address)
                waiting_for = "the head node's job agent to accept a job"
            client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                              submission_id=submission_id)
            return client, submission_id
        except (ConnectionError, RuntimeError) as e:
            last = str(e).strip()
            if client is not None and NO_AGENT not in last:
                raise JobSubmitError(f"{address}: the job was refused: {last}") from None
        if time.monotonic() + POLL_S > deadline:
            raise JobSubmitError(f"gave up after {timeout_s:g} s waiting for {waiting_for} at "
                              f"{address} (last answer: {last or 'none'}); check that the "
                              "cluster is up, RAY_ADDRESS and the auth token")
        if not announced:
            say(f"[slime_like] waiting for {waiting_for} at {address} (up to {timeout_s:g} s)")
            announced = True
        time.sleep(POLL_S)


async def _follow(client: Any, submission_id: str) -> None:
    async for chunk in client.tail_job_logs(submission_id):
        sys.stdout.write(chunk)
        sys.stdout.flush()


def run(address: str, entrypoint: Sequence[str], *, env: dict[str, str], timeout_s: float) -> int:
    """Submit, stream the job's logs, 0 if it SUCCEEDED; Ctrl-C stops the job."""
    client, sid = wait_and_submit(address, shlex.join(entrypoint),
                                  runtime_env={"env_vars": env}, timeout_s=timeout_s)
    print(f"[slime_like] submitted job {sid} to {address}", flush=True)
    try:
        asyncio.run(_follow(client, sid))
    except KeyboardInterrupt:
        print(f"\n[slime_like] stopping job {sid}", file=sys.stderr)
        client.stop_job(sid)
        return 130
    status = _final_status(client, sid)
    if status != "SUCCEEDED":
        info = client.get_job_info(sid)
        print(f"[slime_like] job {sid} ended {status}: "
              f"{getattr(info, 'message', '') or ''}".rstrip(": "), file=sys.stderr)
        return 1
    return 0


def _final_status(client: Any, sid: str, timeout_s: float = 60.0) -> str:
    """The job's terminal status; the log stream can end (a dashboard restart) before it does."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get_job_status(sid)
        name = getattr(status, "value", str(status))
        if status.is_terminal() or time.monotonic() > deadline:
            return name
        time.sleep(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of this module (what scripts/run_job.sh calls); the exit status."""
    p = argparse.ArgumentParser(prog="python -m slime_like.submit.ray_job", description=__doc__.split(
        "\n")[0])
    p.add_argument("--address", required=True, help="The dashboard, e.g. http://head:8265.")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="Seconds to wait for the dashboard and the job agent.")
    p.add_argument("--env", default="{}", help="JSON object of environment variables for the job.")
    p.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    a = p.parse_args(argv)
    entrypoint = a.entrypoint[1:] if a.entrypoint[:1] == ["--"] else a.entrypoint
    if not entrypoint:
        p.error("no command after --")
    try:
        return run(a.address, entrypoint, env=json.loads(a.env), timeout_s=a.timeout)
    except JobSubmitError as e:
        print(f"[slime_like] error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the job was submitted: nothing to stop
        return 130


if __name__ == "__main__":
    sys.exit(main())
