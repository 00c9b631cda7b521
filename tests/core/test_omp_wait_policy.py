"""`import miles_aio` makes OpenMP's idle threads sleep (PASSIVE) in every process of a run, unless the
user chose a policy: a run's processes share the CPU cores, and spinning threads take them from each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs

# the engine and trainer entry points are modules of the package, so they import it before torch does
PROBE = "import os, sys, miles_aio; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"


def policy_seen(env_policy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_passive_by_default_and_set_before_torch_loads() -> None:
    assert policy_seen(None) == "PASSIVE False"


def test_a_policy_the_user_set_is_kept() -> None:
    assert policy_seen("ACTIVE") == "ACTIVE False"


ROOT = Path(__file__).resolve().parents[2]
BARE_LOOP_PROBE = """
import os, sys, time
import benchmarks.learning
policy_when_torch_loaded = os.environ.get("OMP_WAIT_POLICY")
torch_loaded = "torch" in sys.modules
import torch
import miles_aio  # what the bare loop imports next: it sets the policy for later children only
torch.set_num_threads(2)
a = torch.randn(256, 256)
for _ in range(100):
    a @ a
t = time.process_time()
time.sleep(1.0)
print(policy_when_torch_loaded, torch_loaded, round(time.process_time() - t, 2))
"""


@pytest.mark.parametrize("user", [None, "PASSIVE"])
def test_benchmarks_learning_gives_its_bare_loop_openmps_default_and_no_thread_keeps_spinning(
    user: str | None,
) -> None:
    """`benchmarks.learning` runs the bare GRPO loop in its own process, alone on the cores: it loads
    torch before anything imports miles_aio, so that loop gets OpenMP's default policy (spin briefly,
    then sleep; PASSIVE made it 1.4x slower), and once a parallel loop is done its threads sleep, so they
    take no core from the next recipe run (ACTIVE kept one spinning: ~1 s of CPU per second asleep).
    A policy the user set is the one torch loads with."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if user is not None:
        env["OMP_WAIT_POLICY"] = user
    out = subprocess.run(
        [sys.executable, "-c", BARE_LOOP_PROBE], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[:2] == [str(user), "True"]
    assert float(out[2]) < 0.2  # CPU seconds used while asleep for 1 s
