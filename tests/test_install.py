"""The install the README gives is what a script imports from anywhere, a clone's parent folder included.

`git clone` names the folder after the repository, zaya_jax, and a script run from the folder above
it sees that folder (no __init__.py) first on sys.path. setuptools' default editable install for
this layout resolves the package with a finder placed after the path finder, so that folder won
as an empty namespace package (`module 'zaya_jax' has no attribute 'load_hf'`). The test runs the
suite's own interpreter, without PYTHONPATH, from such a parent folder and from an unrelated one.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROBE = "import zaya_jax, os; print(os.path.realpath(zaya_jax.__file__)); print(callable(zaya_jax.load_hf))"


@pytest.mark.parametrize("folder_beside", ["zaya_jax", "pallas_kernels", None])
def test_the_installed_package_is_imported_beside_a_folder_of_its_name(tmp_path, folder_beside):
    if folder_beside is not None:
        clone = tmp_path / folder_beside  # a clone's folder as seen from its parent: no __init__.py
        clone.mkdir()
        (clone / "README.md").write_text("a clone\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = PROBE + "; import pallas_kernels; print(os.path.realpath(pallas_kernels.__file__))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    package_file, has_load_hf, kernels_file = done.stdout.split()
    assert package_file == str(REPO / "zaya_jax" / "__init__.py")
    assert has_load_hf == "True"
    assert kernels_file == str(REPO / "pallas_kernels" / "__init__.py")
