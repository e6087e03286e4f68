"""Version-dependent behaviour, read from an engine's /server_info `version`."""

from __future__ import annotations

import pytest

from slime_like.errors import ConfigError
from slime_like.protocol.compat import EngineFeatures, parse_version
from slime_like.router.router import check_router_version


@pytest.mark.parametrize("text,expected", [
    ("0.5.23", (0, 5, 23)), ("0.5.23.post1", (0, 5, 23)), ("v0.5.9rc0", (0, 5, 9)), ("1.0", (1, 0, 0)),
])
def test_versions_are_read_as_sglang_spells_them(text, expected):
    assert parse_version(text) == expected


def test_unreadable_version_is_a_config_error():
    with pytest.raises(ConfigError, match="'dev'"):
        parse_version("dev")


# version -> (weight_update_session, get_load, ready_endpoint, model_info, pause_modes,
#             failed_flush_after_update_is_400)
VERSION_TABLE = {
    "0.5.2": (False, True, False, False, False, False),
    "0.5.9": (False, True, False, True, True, False),
    "0.5.20": (False, True, True, True, True, False),
    "0.5.21": (True, False, True, True, True, False),
    "0.5.23": (True, False, True, True, True, True),
}


@pytest.mark.parametrize("version", list(VERSION_TABLE))
def test_features_follow_the_documented_version_matrix(version):
    f = EngineFeatures.from_server_info({"version": version})
    got = (f.weight_update_session, f.get_load, f.ready_endpoint, f.model_info, f.pause_modes,
           f.failed_flush_after_update_is_400)
    assert got == VERSION_TABLE[version]


def test_server_info_without_a_version_is_treated_as_pre_0_5_9():
    assert not EngineFeatures.from_server_info({}).model_info


def test_installed_routers_speak_worker_ids():
    assert parse_version(check_router_version()) >= (0, 3, 0)
    assert check_router_version("smg") == "1.13.0"
