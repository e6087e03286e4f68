"""Reference-engine processes for the weight-sync tests.

Engines are real `python -m slime_like.reference_engine` processes on free ports; the test
process is the trainer (rank 0 of every weight group). Engines are session-scoped because
starting one costs seconds; a test that changes an engine's weights leaves it serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from weight_sync_helpers import Engine, start_engine


@pytest.fixture(scope="session")
def weights_log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights-engine-logs")


@pytest.fixture(scope="session")
def engines(tiny_model_dir, weights_log_dir) -> Iterator[list[Engine]]:
    """Engine A (TP=1) and engine B (TP=2), shared by the sync tests."""
    started: list[Engine] = []
    try:
        started.append(start_engine(tiny_model_dir, weights_log_dir, 1))
        started.append(start_engine(tiny_model_dir, weights_log_dir, 2))
        yield started
    finally:
        for e in started:
            e.process.terminate(grace=10)
