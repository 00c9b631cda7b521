"""`import miles_aio` makes OpenMP's idle threads sleep (PASSIVE) in every process of a run, unless the
user chose a policy: a run's processes share the CPU cores, and spinning threads take them from each other."""

from __future__ import annotations

import os
import subprocess
import sys

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
