"""`python -m slime_like.router.launch ARGS`: sglang-router's own launcher, without sglang.

`sglang_router.launch_router` imports its mini load balancer, which imports sglang's
tracing (and with it torch) when sglang is installed, for a feature the router binary does
not use: about 4.5 s of CPU at every router start. Hiding sglang from this process makes
that optional import fail as it does where sglang is absent; the router itself, its flags
and its behaviour are sglang-router's.
"""

from __future__ import annotations

import sys


def main() -> None:
    sys.modules["sglang"] = None  # type: ignore[assignment]  # `import sglang...` -> ImportError
    from sglang_router.launch_router import main as launch_router_main

    launch_router_main()


if __name__ == "__main__":
    main()
