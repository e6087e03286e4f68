"""Check rendered engine argv against the real `sglang.srt.server_args` in a child process.

sglang takes seconds to import and reconfigures logging on parse, so every argv of a batch
is parsed in one subprocess: `check_argvs([...])` runs `python -m
tests.contract.sglang_args_check`, which reads argvs as JSON on stdin and answers, per
argv, the constructed ServerArgs fields or the parser's error text.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from slime_like.errors import LaunchError


def sglang_import_error() -> str | None:
    """Why `import sglang.srt.server_args` fails here, or None when it works (in a child)."""
    proc = subprocess.run([sys.executable, "-c", "import sglang.srt.server_args"],
                          capture_output=True, text=True, timeout=120)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


def check_argvs(argvs: Sequence[Sequence[str]], timeout: float = 180.0) -> dict[str, Any]:
    """Parse and construct each argv with sglang's own code; one subprocess for the batch.

    Returns {"sglang_version", "fields": [field names], "results": [{"ok", "args"|"error"}]}.
    """
    proc = subprocess.run([sys.executable, "-m", "tests.contract.sglang_args_check"],
                          input=json.dumps([list(a) for a in argvs]), capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise LaunchError("sglang argv check subprocess failed", proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _main() -> None:
    import sglang
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    argvs = json.loads(sys.stdin.read())
    fields = sorted(f.name for f in record_fields(ServerArgs))
    results = []
    for argv in argvs:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
                sa = prepare_server_args(argv)
            results.append({"ok": True, "args": {f: _jsonable(getattr(sa, f, None)) for f in fields},
                            "stderr": err.getvalue()[-2000:]})
        except SystemExit:  # argparse reports a bad flag by exiting
            # argparse prints its usage first; the last line is the reason.
            results.append({"ok": False, "error": (err.getvalue().strip().splitlines() or ["?"])[-1]})
        except Exception as e:  # a constructor check failed; the message is the answer
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    out = {"sglang_version": sglang.__version__, "fields": fields, "results": results}
    sys.stdout.write("\n" + json.dumps(out) + "\n")


if __name__ == "__main__":
    _main()
