"""The flag reference is generated from the parser, and the docs name only flags that exist."""

from __future__ import annotations

import ast
import importlib
import re

import pytest

from miles_aio import docgen
from tests.docs._docs import DOCS, README, ROOT, pages

FLAGS_MD = DOCS / "reference" / "flags.md"
MILES_PAGE = DOCS / "guide" / "coming-from-miles.md"
FLAG_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?:-\*|-<[a-z]+>)?(?![\w-])")

# miles flags with no counterpart here: allowed on the "coming from miles" page only (its "miles-only
# flags" table), and checked to be absent from the parser.
MILES_ONLY = {
    "--fully-async",
    "--colocate",
    "--rollout-sample-filter-path",
    "--over-sampling-batch-size",
    "--data-source-path",
    "--rm-type",
    "--rm-url",
    "--keep-old-actor",
    "--eval-config",
    "--save-trigger-sentinel",
    "--use-dynamic-global-batch-size",
    "--balance-data",
    "--use-dynamic-batch-size",
    "--custom-tis-function-path",
    "--get-mismatch-metrics",
    "--custom-convert-samples-to-train-data-path",
    "--optimizer",
}
# other tools' flags the docs show in commands
TOOL_FLAGS = {"--strict", "--no-deps", "--format"}  # mkdocs, pip, py-spy
# vLLM's own server flags, named on the "Choosing an engine" page (vLLM is not installed here to ask)
VLLM_FLAGS = {
    "--model",
    "--no-enable-prefix-caching",
    "--logprobs-mode",
    "--enable-prompt-tokens-details",
    "--weight-transfer-config",
}


def torchrun_flags() -> set[str]:
    """torchrun's own flags (the multi-node command in the GPU layout guide), from its parser."""
    from torch.distributed.run import get_args_parser

    return {o for action in get_args_parser()._actions for o in action.option_strings}


def engine_flags() -> set[str]:
    """The embedded engine's own flags (`python -m miles_aio.engine`, its docs page)."""
    from miles_aio.engine.cli import build_parser

    return {o for action in build_parser()._actions for o in action.option_strings}


def script_flags() -> set[str]:
    """The benchmark scripts' and recipes' own `--flags`: their `build_parser()`'s, where a module has
    one, plus every constant `--flag` passed to add_argument."""
    found: set[str] = set()
    for path in [*ROOT.joinpath("recipes").glob("*.py"), *ROOT.joinpath("benchmarks").glob("*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.FunctionDef) and n.name == "build_parser" for n in tree.body):
            module = importlib.import_module(f"{path.parent.name}.{path.stem}")
            parser = module.build_parser()
            found |= {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                found |= {
                    a.value
                    for a in node.args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")
                }
    return found


def test_the_flag_reference_is_the_generated_one() -> None:
    assert FLAGS_MD.read_text(encoding="utf-8") == docgen.flags_markdown(), (
        "docs/reference/flags.md is out of date: run `python -m miles_aio.docgen`"
    )


def test_every_flag_is_in_the_reference_with_its_default_and_help() -> None:
    text = FLAGS_MD.read_text(encoding="utf-8")
    rows: dict[str, str] = {}
    for line in text.split("## Recipe defaults")[0].splitlines():
        if line.startswith("| `--"):
            rows.setdefault(line.split(" | ")[0], line)
    parser = docgen.recipe_parser()
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest == "help":
            continue
        row = next((r for k, r in rows.items() if f"`{longs[0]}`" in k), None)
        assert row is not None, f"{longs[0]} missing from the flag reference"
        help_text = docgen._help(action)
        assert help_text, f"{longs[0]} has no help text"
        assert docgen._cell(help_text) in row, (longs[0], help_text)
        default = docgen._default(action)
        assert f"| {default} |" in row, (longs[0], default)


def test_the_docs_name_only_flags_that_exist() -> None:
    known = docgen.all_option_strings() | script_flags() | TOOL_FLAGS | VLLM_FLAGS
    known |= torchrun_flags() | engine_flags()
    bad: list[str] = []
    for page in [*pages(), README]:
        for flag in set(FLAG_RE.findall(page.read_text(encoding="utf-8"))):
            if flag in known or flag.startswith(("--sglang-", "--eval-sglang-")):  # SGLang passthrough
                continue
            if flag.endswith(("-*", ">")):  # a family: `--eval-*`
                prefix = flag.rsplit("-", 1)[0] + "-"
                if any(k.startswith(prefix) for k in known):
                    continue
            if flag in MILES_ONLY and page == MILES_PAGE:
                continue
            bad.append(f"{page.relative_to(ROOT)}: {flag}")
    assert not bad, "flags the parser does not have:\n" + "\n".join(sorted(bad))


def test_miles_only_flags_really_do_not_exist_here() -> None:
    text = MILES_PAGE.read_text(encoding="utf-8")
    assert not MILES_ONLY & docgen.all_option_strings()
    for flag in MILES_ONLY:
        assert f"`{flag}`" in text, f"{flag} is allowed as miles-only but not on the miles page"


@pytest.mark.parametrize("argv", [["--check"]])
def test_docgen_check_passes(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert docgen.main(argv) == 0


DEFAULT_RE = re.compile(r"\(default\b|(?<!\()\bdefault:")


def test_every_flag_states_its_default_once() -> None:
    """`--help` appends the default; a help text that states one too printed two ("(default: off).
    (default: 2)" under a recipe's default), so none may."""
    from miles_aio.recipe import _parser

    parsers = [docgen.recipe_parser(), *(_parser(m.RECIPE) for m in docgen.recipe_modules())]
    twice = [
        f"{p.prog} {a.option_strings[0]}: {a.help}"
        for p in parsers
        for a in p._actions
        if a.option_strings and len(DEFAULT_RE.findall(a.help or "")) > 1
    ]
    assert not twice, "\n".join(twice)


def test_rollout_shuffle_names_the_seed_it_uses() -> None:
    action = next(a for a in docgen.recipe_parser()._actions if "--rollout-shuffle" in a.option_strings)
    assert "--rollout-seed" in (action.help or "") and "--seed " not in (action.help or "")
