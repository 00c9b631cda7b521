"""The plots: a run whose records hold no consume staleness gets a staleness plot that says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from miles_aio.plot import main, plot_run, staleness_note

pytestmark = [pytest.mark.pure, pytest.mark.timeout(60)]


def write_run(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def rows(consume: bool, train: bool = True) -> list[dict[str, Any]]:
    out = []
    for step in range(4):
        r: dict[str, Any] = {"step": step, "rollout/reward": 0.1 * step}
        if consume:
            r |= {"rollout/fully_async/avg_staleness": 1.0, "rollout/fully_async/max_staleness": 2.0}
        if train:
            r["rollout/train_staleness_mean"] = 2.0
        out.append(r)
    return out


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """PNG name → the texts drawn on its axes, for every figure saved."""
    texts: dict[str, list[str]] = {}
    save = Figure.savefig

    def spy(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        texts[Path(fname).name] = [t.get_text() for ax in self.axes for t in ax.texts]
        save(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return texts


def test_the_note_names_the_buffer_and_what_is_shown_instead() -> None:
    assert staleness_note(rows(consume=True)) is None
    note = staleness_note(rows(consume=False), "my.buffers:BestFirst")
    assert note == (
        "no consume staleness metrics (rollout/fully_async/*): custom buffer my.buffers:BestFirst reports "
        "none; train staleness shown"
    )
    assert staleness_note(rows(consume=False, train=False)) == (
        "no consume staleness metrics (rollout/fully_async/*): the run's buffer reports none"
    )


def test_a_run_without_consume_staleness_gets_plots_with_the_note(
    tmp_path: Path, drawn: dict[str, list[str]]
) -> None:
    run_dir = write_run(tmp_path / "run", rows(consume=False, train=False))
    written = {p.name for p in plot_run(run_dir, buffer="my.buffers:BestFirst")}
    assert {"staleness.png", "learning.png"} <= written  # drawn although it has no line
    for png in ("staleness.png", "learning.png"):
        assert any("custom buffer my.buffers:BestFirst reports none" in t for t in drawn[png]), png


def test_a_run_with_consume_staleness_has_no_note(tmp_path: Path, drawn: dict[str, list[str]]) -> None:
    run_dir = write_run(tmp_path / "run", rows(consume=True))
    assert {"staleness.png", "learning.png"} <= {p.name for p in plot_run(run_dir)}
    assert drawn["staleness.png"] == [] and drawn["learning.png"] == []


def test_the_cli_takes_the_buffer_name(tmp_path: Path, drawn: dict[str, list[str]]) -> None:
    run_dir = write_run(tmp_path / "run", rows(consume=False))
    assert main([str(run_dir), "--buffer", "pkg.mod:Buf"]) == 0
    assert any(
        "custom buffer pkg.mod:Buf reports none; train staleness shown" in t for t in drawn["staleness.png"]
    )
