"""The bad-config corpus: every mistake is caught at parse time with its exact message.

Each file in bad_configs/ starts with `# flags: ...` (the command line it is run with) and
`# expect: ...` (the exact error; `{file}` stands for the file's path).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from slime_like.config import parse_args
from slime_like.errors import ConfigError

CORPUS = sorted((Path(__file__).parent / "bad_configs").glob("*.yaml"))


def _header(path: Path, key: str) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"{path.name} has no '# {key}:' line")


def test_corpus_holds_at_least_25_cases():
    assert len(CORPUS) >= 25


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_bad_config_is_rejected_with_its_exact_message(path: Path):
    argv = ["--sglang-config", str(path), *shlex.split(_header(path, "flags"))]
    expected = _header(path, "expect").replace("{file}", str(path))
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert str(err.value) == expected


def test_error_path_and_message_are_separate_fields():
    path = next(p for p in CORPUS if p.stem == "01_num_gpus_zero")
    with pytest.raises(ConfigError) as err:
        parse_args(["--sglang-config", str(path), *shlex.split(_header(path, "flags"))])
    assert err.value.path == "sglang[1].server_groups[0].num_gpus"
    assert err.value.message == "must be > 0, got 0"
