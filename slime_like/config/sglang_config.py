"""The `--sglang-config` YAML schema (slime's), validated with pydantic.

Shape checks live here; rules that need the flags (GPU sums, engine sizes against nodes,
one updatable model, ...) live in `topology.py`. Every error is a ConfigError whose path is
the YAML path of the bad field, e.g. `sglang[1].server_groups[0].num_gpus: must be > 0, got 0`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slime_like.config.argtypes import did_you_mean
from slime_like.config.config_file import read_yaml, show
from slime_like.errors import ConfigError
from slime_like.protocol.modes import WorkerType

LEGACY_GROUPS_KEY = "engine_groups"


class _Strict(BaseModel):
    # strict: YAML `num_gpus: "4"` or `update_weights: 1` are mistakes, not values to coerce.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ServerGroupConfig(_Strict):
    """GPUs of one model served by engines of one worker type and size."""

    worker_type: WorkerType = Field(strict=False)  # YAML gives the word; the field is the enum
    num_gpus: int = Field(gt=0)
    num_gpus_per_engine: int | None = Field(default=None, gt=0)
    overrides: dict[str, Any] = Field(default_factory=dict)


class ModelConfig(_Strict):
    """One model: its checkpoint, whether it receives weight updates, its server groups."""

    name: str = Field(min_length=1)
    model_path: str | None = None
    update_weights: bool | None = None
    num_gpus_per_engine: int | None = Field(default=None, gt=0)
    server_groups: list[ServerGroupConfig] = Field(default_factory=list)


class SglangConfig(_Strict):
    """The whole file: `sglang:` followed by a list of models, each with its own router."""

    sglang: list[ModelConfig] = Field(min_length=1)

    @property
    def total_num_gpus(self) -> int:
        return sum(g.num_gpus for m in self.sglang for g in m.server_groups)


_FIELDS_AT_DEPTH = {
    0: SglangConfig.model_fields,
    2: ModelConfig.model_fields,
    4: ServerGroupConfig.model_fields,
}


def format_loc(loc: tuple[Any, ...]) -> str:
    """('sglang', 1, 'server_groups', 0, 'num_gpus') -> 'sglang[1].server_groups[0].num_gpus'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(err: dict[str, Any]) -> str:
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    loc = err["loc"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        fields = list(_FIELDS_AT_DEPTH.get(len(loc) - 1, {}))
        if len(loc) == 3:
            fields.append(LEGACY_GROUPS_KEY)
        hint = did_you_mean(str(loc[-1]), fields)
        return f"unknown field{hint or '; expected one of ' + ', '.join(fields)}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']}, got {show(value)}"
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return f"must be an integer, got {show(value)}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false, got {show(value)}"
    if kind == "string_type":
        return f"must be a string, got {show(value)}"
    if kind in ("literal_error", "enum"):
        return f"must be one of {', '.join(WorkerType)}; got {show(value)}"
    if kind == "list_type":
        return f"must be a list, got {show(value)}"
    if kind in ("dict_type", "model_type"):
        return f"must be a mapping, got {show(value)}"
    if kind in ("too_short", "string_too_short"):
        return "must not be empty"
    return err["msg"]


def _normalize_legacy(data: Any) -> tuple[Any, set[int]]:
    """Rename legacy `engine_groups` to `server_groups`; remember where, for error paths."""
    legacy: set[int] = set()
    if not isinstance(data, dict) or not isinstance(data.get("sglang"), list):
        return data, legacy
    models = []
    for i, m in enumerate(data["sglang"]):
        if isinstance(m, dict) and LEGACY_GROUPS_KEY in m:
            if "server_groups" in m:
                raise ConfigError(f"sglang[{i}]", "give server_groups or the legacy "
                                                  "engine_groups, not both")
            m = {("server_groups" if k == LEGACY_GROUPS_KEY else k): v for k, v in m.items()}
            legacy.add(i)
        models.append(m)
    return {**data, "sglang": models}, legacy


def parse_sglang_config(data: Any) -> SglangConfig:
    """Validate already-loaded YAML data; raises ConfigError naming the first bad field."""
    if data is None:
        raise ConfigError("sglang", "required field is missing (the file is empty)")
    if not isinstance(data, dict):
        raise ConfigError("", f"must be a mapping with the key 'sglang', got {show(data)}")
    data, legacy = _normalize_legacy(data)
    try:
        return SglangConfig.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        err = errors[0]
        if err["type"] == "missing":
            # A misspelt key shows up twice: as missing and as unknown. Name the typo.
            parent = tuple(err["loc"][:-1])
            err = next((x for x in errors if x["type"] == "extra_forbidden"
                        and tuple(x["loc"][:-1]) == parent), err)
        loc = tuple(err["loc"])
        if len(loc) >= 3 and loc[2] == "server_groups" and loc[1] in legacy:
            loc = (*loc[:2], LEGACY_GROUPS_KEY, *loc[3:])
        raise ConfigError(format_loc(loc), _message({**err, "loc": loc})) from None


def load_sglang_config(path: str | Path) -> SglangConfig:
    """Read and validate a `--sglang-config` file."""
    return parse_sglang_config(read_yaml(path, "--sglang-config"))
