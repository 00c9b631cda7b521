"""A plug-in module that cannot be imported is named, with what to do about it (PYTHONPATH)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_aio.errors import ConfigError, PluginError
from miles_aio.plugins import load_object, resolve_plugins
from tests.helpers import make_config

pytestmark = pytest.mark.pure


def test_a_module_not_on_the_path_says_pythonpath() -> None:
    with pytest.raises(PluginError) as info:
        load_object("my_rewards_not_on_path:reward")
    message = str(info.value)
    assert "'my_rewards_not_on_path'" in message
    assert "PYTHONPATH" in message and "importable" in message


def test_a_package_not_on_the_path_says_pythonpath_too() -> None:
    with pytest.raises(PluginError, match="PYTHONPATH"):
        load_object("my_pkg_not_on_path.rewards.reward")  # miles' dotted form


def test_a_missing_dependency_of_an_importable_module_is_named_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "needs_a_dependency.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as info:
        load_object("needs_a_dependency:reward")
    assert "no_such_dependency_xyz" in str(info.value)
    assert "PYTHONPATH" not in str(info.value)  # the module was found; what it imports was not


def test_the_module_loads_once_its_directory_is_on_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_local_rewards.py").write_text("async def reward(ctx, sample):\n    return 1.0\n")
    with pytest.raises(PluginError, match="PYTHONPATH"):
        load_object("my_local_rewards:reward")
    monkeypatch.syspath_prepend(str(tmp_path))  # what PYTHONPATH=tmp_path does
    assert load_object("my_local_rewards:reward").__name__ == "reward"


def test_the_run_config_error_names_the_flag_and_pythonpath() -> None:
    cfg = make_config(custom_rm_path="my_rewards_not_on_path:reward")
    with pytest.raises(ConfigError, match="PYTHONPATH") as info:
        resolve_plugins(cfg)
    assert info.value.flags == ("--custom-rm-path",)
