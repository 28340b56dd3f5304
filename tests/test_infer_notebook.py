"""examples/quickstart.ipynb runs headless, top to bottom.

The kernel is ipykernel's `python3`, which jupyter_client starts with this interpreter
(sys.executable: the venv's python)."""

import os

import jax
import nbclient
import nbformat

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _text(cell) -> str:
    return "".join(out.get("text", "") for out in cell.get("outputs", []))


def test_quickstart_notebook_executes(monkeypatch):
    env = {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(os.path.join(EXAMPLES, "quickstart.ipynb"), as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=60, kernel_name="python3",
                                     resources={"metadata": {"path": EXAMPLES}})
    client.execute()  # raises CellExecutionError, with the traceback, if any cell fails
    outputs = "\n".join(_text(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert "ZAYA1-base  per token per layer: CCA   512  MHA  4096  (8x smaller)" in outputs
    assert "sampled:" in outputs
    diffs = [float(line.rsplit(":", 1)[1]) for line in outputs.splitlines() if "max |diff| at position" in line]
    assert len(diffs) == 4 and max(diffs) < 1e-4
