"""The metric registry agrees with the code, the docs and a real run's metrics.jsonl."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from miles_aio.observability import registry
from miles_aio.observability.registry import METRICS, lookup, unknown_metrics
from tests.docs._docs import METRIC_RE, METRICS_PAGE, README, ROOT, inline_code, pages, template

SRC = ROOT / "src" / "miles_aio"
RUNTIME = [m for m in METRICS if not m.user]
TEMPLATES = {m.template for m in RUNTIME}
# f-string names built from a key the runtime does not spell out here, each checked elsewhere
DYNAMIC = {
    "train/{}": "trainer/rank_main.py: train/<key> of the loss's sums and maxes (test_loss_keys_...)",
    "eval/{}": "eval/external.py: a CheckpointEvalFn's own names (the registry's user entry)",
}


def runtime_lookup(name: str) -> bool:
    spec = lookup(name)
    return spec is not None and not spec.user


def _strings(node: ast.AST, names: dict[str, str]) -> str | None:
    """A str constant, f-string (placeholders as `{}`) or `+` of those / known names, as a template."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}" for v in node.values
        )
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _strings(node.left, names), _strings(node.right, names)
        return None if left is None or right is None else left + right
    return None


def emitted_names(path: Path) -> list[tuple[int, str]]:
    """Every metric-looking string (constant, f-string, concatenation) in a source file, but docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
    }
    names: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            value = _strings(n.value, {})
            if value is not None:
                names[n.targets[0].id] = value
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    out = []
    for n in ast.walk(tree):
        if id(n) in docstrings | parts or not isinstance(n, ast.Constant | ast.JoinedStr | ast.BinOp):
            continue
        text = _strings(n, names)
        if text is not None and METRIC_RE.match(text):
            out.append((n.lineno, text))
    return out


def test_every_metric_name_in_the_code_is_registered() -> None:
    bad = []
    files = [p for p in SRC.rglob("*.py") if p.name not in ("registry.py", "docgen.py")]
    for path in files:
        for line, name in emitted_names(path):
            where = f"{path.relative_to(ROOT)}:{line}: {name!r}"
            t = template(name)
            if name.endswith("/"):  # a prefix
                ok = any(m.template.startswith(t) for m in RUNTIME)
            elif "{}" in t:
                ok = t in TEMPLATES or t in DYNAMIC
            else:
                ok = runtime_lookup(name)
            if not ok:
                bad.append(where)
    assert not bad, "metric names missing from miles_aio.observability.registry:\n" + "\n".join(bad)


def test_the_scan_sees_the_emitters() -> None:
    """The AST scan must find the known emitters' names (guards the scan itself)."""
    found = {name for p in SRC.rglob("*.py") for _, name in emitted_names(p)}
    for name in (
        "rollout/fully_async/queue_size",  # "rollout/fully_async/" + "queue_size"
        "eval/{}/reward",  # p = f"eval/{name}/"; p + "reward"
        "perf/engine/{}/queue_len",
        "rollout/dynamic_filter/drop_{}",
        "train/grad_norm",
    ):
        assert name in found, name


def test_loss_keys_are_registered_as_train_metrics() -> None:
    tree = ast.parse((SRC / "trainer" / "losses.py").read_text(encoding="utf-8"))
    keys: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name | ast.Subscript):
            target = n.targets[0]
            if (
                isinstance(target, ast.Name)
                and target.id in ("sums", "maxes")
                and isinstance(n.value, ast.Dict)
            ):
                keys |= {
                    k.value for k in n.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
                }
            if (
                isinstance(target, ast.Subscript)
                and getattr(target.value, "id", None) in ("sums", "maxes")
                and isinstance(target.slice, ast.Constant)
                and isinstance(target.slice.value, str)
            ):
                keys.add(target.slice.value)
    assert {"loss", "tokens", "tis_weight", "entropy"} <= keys
    assert not [k for k in keys if not runtime_lookup(f"train/{k}")]


def test_every_registry_entry_is_documented_on_the_metrics_page() -> None:
    documented = set(inline_code(METRICS_PAGE.read_text(encoding="utf-8")))
    missing = [m.name for m in METRICS if m.name not in documented]
    assert not missing, f"not on {METRICS_PAGE.relative_to(ROOT)}: {missing}"


def test_every_metric_named_in_the_docs_is_registered() -> None:
    bad = []
    for page in [*pages(), README]:
        for code in inline_code(page.read_text(encoding="utf-8")):
            if not METRIC_RE.match(code) or code.endswith("/") or code in {m.name for m in METRICS}:
                continue
            t = template(code)
            if code.endswith("*"):  # a family: `train/train_rollout_*`
                ok = any(m.name.startswith(code[:-1]) for m in RUNTIME)
            elif "{}" in t:
                ok = t in TEMPLATES
            else:
                ok = runtime_lookup(code)
            if not ok:
                bad.append(f"{page.relative_to(ROOT)}: {code}")
    assert not bad, "metric names the registry does not have:\n" + "\n".join(bad)


def test_registry_names_are_unique_and_match_themselves() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in RUNTIME:
        concrete = m.name.replace("{", "").replace("}", "")
        assert lookup(concrete) is not None, m.name
    assert lookup("eval/gsm8k/accuracy") is not None and not lookup("eval/gsm8k/accuracy").user  # type: ignore[union-attr]
    assert lookup("eval/mmlu/anything").user  # type: ignore[union-attr]
    assert lookup("perf/engine/0/queue_len") is not None
    assert lookup("rollout/nope") is None and lookup("perf/engine/0/1/queue_len") is None


def test_an_unknown_metric_is_warned_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_checked", set())
    with structlog.testing.capture_logs() as logs:
        registry.check_metrics({"rollout/reward": 1.0, "rollout/made_up": 2.0})
        registry.check_metrics({"rollout/made_up": 3.0})
    warned = [e for e in logs if e["event"] == "unregistered metric"]
    assert [e["metric"] for e in warned] == ["rollout/made_up"]


def test_a_run_writes_only_registered_metrics(vrun: Any, tmp_path: Path) -> None:
    """A controller run over the fake engine/trainer with eval: every key of metrics.jsonl is known.

    (tests/recipes/test_recipes.py checks the same on the quickstart's real engine and trainer.)
    """
    from tests.observability._run import run_controller

    with structlog.testing.capture_logs() as logs:
        run_controller(vrun, tmp_path / "run", num_rollout=3, eval_interval=1, eval_prompts=4)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in rows for k in r}
    assert {"eval/held/accuracy", "perf/trainer_idle_ratio", "rollout/fully_async/queue_size"} <= keys
    assert unknown_metrics(keys) == []
    assert not [e for e in logs if e["event"] == "unregistered metric"]
