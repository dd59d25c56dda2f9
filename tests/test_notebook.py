"""``examples/quickstart.ipynb`` runs top to bottom in a real Jupyter kernel (issue 56, item 2).

nbclient executes every cell in an ipykernel started from this interpreter (a kernel spec of
our own, so a system-wide ``python3`` kernel without hyperfed is never picked); a cell that
raises fails the test. The printed per-client lines are read back from the cells' outputs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def _outputs_text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out["text"])
            elif "data" in out:
                parts.append(out["data"].get("text/plain", ""))
    return "\n".join(parts)


def test_the_quickstart_notebook_runs_in_a_kernel(tmp_path, monkeypatch):
    spec = tmp_path / "jupyter" / "kernels" / "hyperfed-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "hyperfed test", "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models; the CPU is shared
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook without outputs"
    )
    client = NotebookClient(
        nb,
        kernel_name="hyperfed-test",
        timeout=300,
        startup_timeout=180,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # a cell that raises: CellExecutionError
    text = _outputs_text(nb)
    assert "round 2/2: mean acc" in text
    # four clients each, first the zoo's MLP under FedAvg, then the notebook's own Net
    assert len(re.findall(r"^client \d \(mlp\): [01]\.\d{3}$", text, re.M)) == 4, text
    assert len(re.findall(r"^client \d \(Net\): [01]\.\d{3}$", text, re.M)) == 4, text
    # FedPer keeps Net's fc (32 * 10 + 10) home: the body, 64 * 32 + 32, is what goes up
    assert "floats uploaded per client: 2080.0" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jupyter"]  # nothing written
