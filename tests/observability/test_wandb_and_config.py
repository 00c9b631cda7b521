"""wandb (offline, under the run dir, no network) and the observability flags."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from miles_aio.cli import build_parser, parse_run_config
from miles_aio.errors import ConfigError
from miles_aio.observability.wandb_sink import WandbSink, wandb_mode
from tests.helpers import make_config

pytestmark = pytest.mark.timeout(60)


def test_wandb_sink_runs_offline_under_the_run_dir_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: no API key
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any network attempt would fail fast
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    connects: list[Any] = []
    real_connect = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
            "127.0.0.1",
            "::1",
            "localhost",
        ):
            connects.append(address)
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, use_wandb=True, wandb_project="p", wandb_group="g", wandb_run_name="r")
    sink = WandbSink(cfg)
    assert sink.mode == "offline"
    sink.log(0, {"rollout/reward": 0.5, "perf/step_time_s": 1.0})
    sink.log(1, {"rollout/reward": 0.75, "bad": float("nan")})
    wandb_dir = sink.run_dir
    sink.close()
    assert wandb_dir is not None and wandb_dir.parent == run_dir / "wandb"
    assert wandb_dir.name.startswith("offline-run-")
    (record,) = wandb_dir.glob("run-*.wandb")  # the offline record, ready for `wandb sync`
    assert connects == []
    # eval/* is defined against eval/step, so lagging eval points chart at the step they evaluated: the
    # metric-definition records are in the offline log (wandb's reader is Go-only; no eval metric was
    # logged here, so these names can come from nothing else)
    data = record.read_bytes()
    assert b"eval/*" in data and b"eval/step" in data


def test_wandb_mode_auto(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
    assert wandb_mode("offline") == "offline"


def test_observability_flags_parse_and_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--rollout-batch-size", "2", "--num-rollout", "1", "--use-tis", "--run-dir", str(tmp_path)]
    cfg = parse_run_config([*base, "--trace", "", "--custom-rollout-log-function-path", "a.b:c"])
    assert cfg.observability.trace == "" and cfg.observability.custom_rollout_log_function_path == "a.b:c"
    assert parse_run_config(base).observability.trace == "trace.json"
    helptext = build_parser().format_help()
    for f in ("--trace", "--use-wandb", "--wandb-project", "--wandb-group", "--wandb-run-name"):
        assert f in helptext
    assert "--custom-eval-rollout-log-function-path" in helptext
    with pytest.raises(SystemExit) as e:
        parse_run_config([*base, "--wandb-project", "p"])
    assert e.value.code == 2 and "--use-wandb" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--wandb-group"):
        make_config(tmp_path, wandb_group="g")
