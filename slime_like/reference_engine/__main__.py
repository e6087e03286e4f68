"""`python -m slime_like.reference_engine --model-path DIR --host H --port P [sglang flags]`."""

from __future__ import annotations

import logging
import sys

from slime_like.reference_engine.server import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
