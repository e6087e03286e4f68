"""Process entry point: parse sglang flags, load the engine, serve HTTP until SIGTERM."""

from __future__ import annotations

import logging

import uvicorn

from slime_like.errors import ConfigError
from slime_like.reference_engine.args import parse_args

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    """Run one reference engine; returns the process exit status."""
    try:
        args = parse_args(argv)
    except ConfigError as e:
        logger.error("invalid argument %s", e)
        return 2
    logging.getLogger().setLevel(args.all_args.get("log_level", "info").upper())
    if args.node_rank > 0:
        # Another node of a multi-node engine: no HTTP, only its TP ranks (sglang's layout).
        from slime_like.reference_engine.multinode import serve_node
        from slime_like.reference_engine.tp import rank_main

        return serve_node(args, rank_main)
    # Imported after argument parsing so `--help` and flag errors answer fast.
    from slime_like.reference_engine.engine import ReferenceEngine
    from slime_like.reference_engine.http_server import create_app

    engine = ReferenceEngine(args)
    try:
        app = create_app(engine)
        # A bounded graceful shutdown: an open stream must not keep SIGTERM from stopping us.
        pure = args.http_stack == "asyncio"
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                timeout_keep_alive=30, access_log=False, timeout_graceful_shutdown=5,
                                loop="asyncio" if pure else "auto", http="h11" if pure else "auto")
        uvicorn.Server(config).run()
    finally:
        engine.shutdown()
    return 0
