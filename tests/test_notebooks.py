"""Every notebook's code cells run top to bottom, and notebooks are stored without outputs."""
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_is_stripped(path, tmp_path, monkeypatch):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for cell in code:
        exec(compile("".join(cell["source"]), f"{path.name}", "exec"), scope)
