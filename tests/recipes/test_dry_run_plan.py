"""`--dry-run` of the GPU recipe, as a miles user first runs it: a missing or wrong `--hf-checkpoint`
exits 2 naming it; checkpoints default to the run dir; a `--sglang-<typo>` is refused when SGLang's
server arguments can be read here, else warned about; the plan is right for servers given by
`--sglang-urls` and for a multi-node trainer; stdout is the JSON plan alone (warnings on stderr),
with no `\\u00d7` escapes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from miles_aio.errors import ConfigError
from miles_aio.inference.sglang_args import check_sglang_args, sglang_server_flags, unknown_sglang_flags
from tests.helpers import make_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("gsm8k")
    model = d / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = d / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "label": "2"}) + "\n")
    return model, data


def dry_run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recipes.gsm8k_qwen3", "--dry-run", "--run-dir", str(tmp_path / "run"), *argv],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "MILES_AIO_TRAINER_SECRET": "s" * 64},
    )


@pytest.mark.parametrize("model", [None, "missing", "no-config"])
def test_a_missing_or_wrong_hf_checkpoint_exits_2_naming_it(
    tmp_path: Path, files: tuple[Path, Path], model: str | None
) -> None:
    _, data = files
    argv = ["--prompt-data", str(data)]
    if model == "missing":
        argv += ["--hf-checkpoint", str(tmp_path / "nowhere")]
    elif model == "no-config":
        argv += ["--hf-checkpoint", str(tmp_path)]
    proc = dry_run(tmp_path, *argv)
    assert proc.returncode == 2, proc.stderr
    assert "--hf-checkpoint" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "run").exists()


def test_the_plan_saves_into_the_run_dir_and_prints_no_escapes(
    tmp_path: Path, files: tuple[Path, Path]
) -> None:
    model, data = files
    proc = dry_run(tmp_path, "--hf-checkpoint", str(model), "--prompt-data", str(data))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)  # stdout is the plan alone
    assert plan["checkpoints"] == {
        "save": str(tmp_path / "run" / "checkpoints"),
        "save_interval": 50,
        "load": None,
    }
    assert "\\u00d7" not in proc.stdout and "TP 2 × PP 1 × DP 2" in proc.stdout
    assert plan["gpus"] == {
        "trainer": "0-3 (megatron, TP 2 × PP 1 × DP 2)",
        "rollout": "4-7 (4 SGLang engines × 1 GPU)",
    }


def test_the_plan_of_external_engines_and_a_multi_node_trainer(
    tmp_path: Path, files: tuple[Path, Path]
) -> None:
    model, data = files
    urls = ["http://10.0.0.3:30000", "http://10.0.0.4:30000"]
    proc = dry_run(
        tmp_path,
        *("--hf-checkpoint", str(model), "--prompt-data", str(data), "--sglang-urls", *urls),
        *("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8"),
        *("--trainer-host", "10.0.0.1", "--trainer-port", "29600", "--sglang-mem-fraction-static", "0.8"),
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["gpus"]["trainer"] == (
        "2 nodes × 8 GPUs, ranks started by torchrun on each node, dialing 10.0.0.1:29600 "
        "(megatron, TP 2 × PP 1 × DP 8)"
    )
    assert plan["gpus"]["rollout"] == "2 SGLang servers given by --sglang-urls (running, not launched)"
    assert plan["engines"] == urls and plan["sglang_args"] == []
    assert (
        "--sglang-* flags not used: the servers given by --sglang-urls run with their own flags"
        in proc.stderr
    )


def test_a_sglang_typo_is_refused_or_warned_about(tmp_path: Path, files: tuple[Path, Path]) -> None:
    """Refused (exit 2, naming it) when SGLang's server arguments are readable here; else one warning
    on stderr, and the plan alone on stdout."""
    model, data = files
    proc = dry_run(
        tmp_path,
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--sglang-mem-fracton-static",
        "0.8",
    )
    if isinstance(sglang_server_flags(), frozenset):
        assert proc.returncode == 2, proc.stderr
        assert "--sglang-mem-fracton-static" in proc.stderr and "--sglang-mem-fraction-static" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert "--sglang-* flags not checked: sglang is not importable here" in proc.stderr
        assert json.loads(proc.stdout)["sglang_args"] == ["--mem-fracton-static", "0.8"]


KNOWN = frozenset({"--mem-fraction-static", "--context-length", "--disable-radix-cache", "--tp-size", "--tp"})


def test_the_check_against_sglangs_server_arguments() -> None:
    cfg = make_config(rollout_backend="sglang")
    assert (
        check_sglang_args(
            cfg, ["--mem-fraction-static", "0.8", "--context-length=64"], [], server_flags=KNOWN
        )
        == []
    )
    assert unknown_sglang_flags(["--disable-radix", "--tp", "2"], KNOWN) == []  # argparse's abbreviations
    assert unknown_sglang_flags(["--t", "2"], KNOWN) == ["--t"]  # ambiguous
    with pytest.raises(ConfigError, match="did you mean --sglang-mem-fraction-static") as e:
        check_sglang_args(cfg, ["--mem-fracton-static", "0.8"], [], server_flags=KNOWN)
    assert e.value.flags == ("--sglang-mem-fracton-static",)
    with pytest.raises(ConfigError) as e:
        check_sglang_args(cfg, [], ["--contxt-length", "64"], server_flags=KNOWN)
    assert e.value.flags == ("--eval-sglang-contxt-length",)
    local = make_config()  # the embedded engines: no SGLang server gets them
    assert check_sglang_args(local, ["--typo"], [], server_flags=KNOWN) == [
        "--sglang-* flags not used: no SGLang server is launched (--rollout-backend local)"
    ]


def test_sglangs_own_parser_is_read_when_sglang_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    class ServerArgs:
        @staticmethod
        def add_cli_args(parser: argparse.ArgumentParser) -> None:
            parser.add_argument("--mem-fraction-static", type=float)
            parser.add_argument("--tensor-parallel-size", "--tp-size", type=int)

    module = types.ModuleType("sglang.srt.server_args")
    module.ServerArgs = ServerArgs  # type: ignore[attr-defined]
    for name, mod in (("sglang", types.ModuleType("sglang")), ("sglang.srt", types.ModuleType("sglang.srt"))):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", module)
    expected = frozenset({"--mem-fraction-static", "--tensor-parallel-size", "--tp-size"})
    assert sglang_server_flags() == expected


def test_quickstart_packs_prompts_on_fsdp_only() -> None:
    """--pack-shared-prompts is the quickstart's default where it exists (the fsdp backend): a megatron
    run is not refused over a flag it never passed; tool_use keeps the settings it was measured with."""
    import recipes.quickstart as quickstart
    import recipes.tool_use as tool_use
    from miles_aio.recipe import parse_recipe

    def train(recipe: object, *argv: str) -> tuple[bool, int]:
        cfg = parse_recipe(recipe, list(argv)).cfg  # type: ignore[arg-type]
        return cfg.train.pack_shared_prompts, cfg.engine.engine_max_running_requests

    assert train(quickstart.RECIPE) == (True, 256)
    assert train(quickstart.RECIPE, "--train-backend", "megatron") == (False, 256)
    assert train(quickstart.RECIPE, "--no-pack-shared-prompts") == (False, 256)
    assert train(tool_use.RECIPE) == (False, 64)
