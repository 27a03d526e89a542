"""The documentation site (``mkdocs.yml``, ``docs/``) cannot rot.

- Every ```` ```python ```` block of ``README.md`` and of the ``docs/`` pages runs, in page order, in one namespace per
  page (its own asserts check its numbers). A block that needs what the tests do not have (a Hub model, a GPU, a long
  rollout) is preceded by ``<!-- docs-test: skip REASON -->``; it is still compiled, its ``trl_prime`` imports must
  resolve and every keyword it gives a trl-prime config must be a field of that config.
- The method pages carry the generated config tables (``docs/_hooks/config_tables.py``), and every field trl-prime
  adds to a config appears on its page.
- No page, docstring, test, recipe, benchmark or notebook cites the private working notes (:data:`NOTES`): papers
  and equations, or a page under ``docs/``, only.

``mkdocs build --strict`` (broken links, missing references) runs in ``.ci/run`` through ``make docs``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
SKIP = re.compile(r"^<!-- docs-test: skip (?P<reason>\S.*\S) -->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")

sys.path.insert(0, str(DOCS / "_hooks"))
import config_tables  # noqa: E402


# config -> the page documenting it
CONFIG_PAGES = {
    "PrimeRLOOConfig": "methods/prime.md",
    "PrimeGRPOConfig": "methods/prime.md",
    "ImplicitPRMConfig": "methods/implicit-prm.md",
    "PRLConfig": "methods/prl.md",
    "ProfGRPOConfig": "methods/prof.md",
}


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip_reason)`` of every ```` ```python ```` block (fences at the start of a line)."""
    lines = text.splitlines()
    blocks, i, previous = [], 0, ""
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group("lang"):
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        start, lang = i, m.group("lang")
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if lang == "python":
            skip = SKIP.match(previous)
            blocks.append((start + 1, "\n".join(lines[start + 1 : i]) + "\n", skip.group("reason") if skip else None))
        previous, i = "", i + 1
    return blocks


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def test_the_block_parser():
    text = (
        "intro\n\n```python\nx = 1\n```\n\n<!-- docs-test: skip needs a GPU -->\n```python\ny = '```'\n```\n"
        "```bash\nmake test\n```\n"
    )
    assert python_blocks(text) == [(3, "x = 1\n", None), (8, "y = '```'\n", "needs a GPU")]


def test_every_page_is_checked_and_most_examples_run():
    names = {_page_id(p) for p in PAGES}
    assert {"README.md", "docs/index.md", "docs/methods/prime.md", "docs/guides/verifiers.md"} <= names
    blocks = [b for p in PAGES for b in python_blocks(p.read_text())]
    run = [b for b in blocks if b[2] is None]
    assert len(run) >= 8 and len(run) > len(blocks) - len(run), (len(run), len(blocks))


@pytest.mark.parametrize(
    "page", [p for p in PAGES if any(b[2] is None for b in python_blocks(p.read_text()))], ids=_page_id
)
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    namespace = {"__name__": f"docs_example_{page.stem}"}
    for line, code, skip in python_blocks(page.read_text()):
        if skip is None:
            exec(compile(code, f"{_page_id(page)}:{line}", "exec"), namespace)


def _config_fields(name: str) -> set[str]:
    import trl_prime

    return {f.name for f in dataclasses.fields(getattr(trl_prime, name))}


@pytest.mark.parametrize("page", [p for p in PAGES if any(b[2] for b in python_blocks(p.read_text()))], ids=_page_id)
def test_skipped_examples_compile_and_match_the_api(page):
    for line, code, skip in python_blocks(page.read_text()):
        if skip is None:
            continue
        where = f"{_page_id(page)}:{line}"
        tree = ast.parse(code, where)
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl_prime":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
                    imported[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
                name = imported[node.func.id]
                if name.endswith("Config"):
                    unknown = {k.arg for k in node.keywords if k.arg} - _config_fields(name)
                    assert not unknown, f"{where}: {name} has no field(s) {sorted(unknown)}"


def test_a_wrong_config_keyword_in_a_skipped_example_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: skip needs a Hub model -->\n```python\nfrom trl_prime import PRLConfig\n"
        "PRLConfig('out', prl_etta=200)\n```\n"
    )
    with pytest.raises(AssertionError, match="prl_etta"):
        test_skipped_examples_compile_and_match_the_api(page)


@pytest.mark.parametrize("name", sorted(CONFIG_PAGES))
def test_every_added_config_field_is_on_its_page(name):
    import trl_prime

    cls = getattr(trl_prime, name)
    source = (DOCS / CONFIG_PAGES[name]).read_text()
    assert f"<!-- config-fields: trl_prime.{name} -->" in source, f"{CONFIG_PAGES[name]} lacks the {name} table"
    rendered = config_tables.render(source)
    added, changed = config_tables.config_fields(cls)
    assert added, name
    for f in added + [f for f, _ in changed]:
        assert f"| `{f.name}` |" in rendered, f"{name}.{f.name} is not documented on {CONFIG_PAGES[name]}"
    # the defaults shown are the dataclass's (e.g. PRIME's paper values)
    if name == "PrimeRLOOConfig":
        assert "| `prm_beta` | `0.05` |" in rendered and "| `filter_lower` | `0.2` |" in rendered
        assert "| `learning_rate` | `5e-07` | `1e-06` |" in rendered  # PRIME's policy rate vs TRL's


#: the private working notes' name, spelled so that searching the tree for it finds no citation
NOTES = "SP" + "EC"
#: where nothing may cite them (``grep -rn`` over these comes back empty), and the text files searched there
NO_NOTES = ("trl_prime", "tests", "recipes", "benchmarks", "notebooks", "docs", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".ipynb", ".json", ".jsonl", ".txt", ".toml", ".html"}


def test_no_page_cites_the_working_notes():
    for page in PAGES:
        text = config_tables.render(page.read_text())
        assert NOTES not in text, f"{_page_id(page)} cites {NOTES}: cite the paper and equation"


def test_mkdocs_config_lists_every_page():
    text = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        assert str(page.relative_to(DOCS)) in text, f"{page} is not in mkdocs.yml's nav"
    assert "font: false" in text and "strict: true" in text


def test_no_docstring_test_or_recipe_cites_the_working_notes():
    """The API reference renders the package's docstrings: they, the tests, the recipes and their configs, the
    benchmarks and the notebooks cite papers and equations (or a page under docs/) too."""
    for top in NO_NOTES:
        paths = [ROOT / top] if (ROOT / top).is_file() else sorted((ROOT / top).rglob("*"))
        for path in paths:
            if path.suffix in TEXT_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                assert NOTES not in path.read_text(errors="replace"), f"{path.relative_to(ROOT)} cites {NOTES}"


def test_readme_links_resolve():
    """The README is a landing page into the docs (mkdocs checks the docs' own links, not the README's)."""
    text = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not t.startswith(("http://", "https://"))]
    assert sum(t.startswith("docs/") for t in targets) >= 10, targets
    for target in targets:
        path, _, anchor = target.partition("#")
        path = path or "README.md"  # "#heading": a section of the README itself
        assert (ROOT / path).exists(), f"README links to a missing {path}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}, target
