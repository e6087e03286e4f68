"""Push the tiny model's weights once into engines over a `distributed` weight group, as the
trainer's rank 0 on this host does; one JSON line per case on stdout.

    python -m tests.hosts.push_weights --model DIR --engine URL [--engine URL ...]
        --case NAME=IFNAME [--case ...]     (IFNAME: GLOO_SOCKET_IFNAME for it; '' = unset)

Run on a test host (over ssh), so the group forms across hosts' network stacks.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from slime_like.errors import WeightSyncError
from slime_like.weights import WeightSync
from tests.weights.weight_sync_helpers import trainer_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", action="append", required=True)
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--group-timeout", type=float, default=120.0)
    args = ap.parse_args()
    policy = trainer_model(args.model, seed=7)
    for case in args.case:
        name, _, ifname = case.partition("=")
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        else:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        sync = WeightSync([(url, 1) for url in args.engine], http_timeout_s=30,
                          group_timeout_s=args.group_timeout)
        t0 = time.monotonic()
        try:
            sync.update(policy)
            out = {"case": name, "ok": True}
        except WeightSyncError as e:
            out = {"case": name, "ok": False, "error": str(e)}
        finally:
            sync.close()
        out["seconds"] = round(time.monotonic() - t0, 2)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
