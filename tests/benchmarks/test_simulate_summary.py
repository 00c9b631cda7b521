"""`benchmarks.simulate` labels both staleness measures, and states its bounds in the right one."""

from __future__ import annotations

import pytest

from benchmarks.simulate import SimConfig, print_summary, run_sim

pytestmark = pytest.mark.timeout(60)


def test_the_summary_says_which_staleness_each_line_is(capsys: pytest.CaptureFixture[str]) -> None:
    res = run_sim(
        SimConfig(
            rollout_batch_size=4,
            n_samples_per_prompt=4,
            num_rollout=6,
            warmup_steps=2,
            train_step_s=1.0,
            max_running=8,
            max_admission_staleness=1,
        )
    )
    assert res["consume_staleness_max"] <= 1  # the bound holds in the measure it is stated in
    assert res["staleness_max"] <= res["consume_staleness_max"] + 1  # train: one more under the prefetch
    print_summary(res)
    lines = capsys.readouterr().out.splitlines()
    (consume,) = [line for line in lines if line.startswith("consume staleness ")]
    (train,) = [line for line in lines if line.startswith("train staleness ")]
    assert "--max-admission-staleness 1 bounds" in consume
    assert "--max-" not in train
    assert f"max {res['staleness_max']:.0f}" in train and f"max {res['consume_staleness_max']:.0f}" in consume
    assert not [line for line in lines if line.startswith("staleness")]  # no unlabelled staleness line
