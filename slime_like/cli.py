"""The `slime-like` console script."""

from __future__ import annotations

import argparse
import sys


def _make_tiny_model(argv: list[str]) -> int:
    from slime_like.models.tiny import make_tiny_model

    p = argparse.ArgumentParser(prog="slime-like make-tiny-model",
                                description="Write a tiny HF-layout Llama checkpoint to DIR.")
    p.add_argument("dir")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-word-embeddings", action="store_true")
    a = p.parse_args(argv)
    out = make_tiny_model(a.dir, layers=a.layers, hidden=a.hidden, heads=a.heads,
                          kv_heads=a.kv_heads, seed=a.seed,
                          tie_word_embeddings=a.tie_word_embeddings)
    print(out)
    return 0


def _train(argv: list[str]) -> int:
    from slime_like.train import main as train_main

    return train_main(argv)


COMMANDS = {
    "make-tiny-model": _make_tiny_model,
    "train": _train,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: slime-like {" + ",".join(COMMANDS) + "} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
