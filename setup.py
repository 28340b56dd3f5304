"""Builds the native CPU grouped matmul (zaya_jax/native/grouped_matmul.cc) at install time.

Headers: XLA's FFI headers from the jaxlib wheel (what `jax.ffi.include_dir()` returns) and
OpenBLAS's cblas.h from scipy-openblas32, both build requirements (pyproject.toml); the library links
scipy-openblas32's libscipy_openblas.so, which zaya_jax.native.grouped_matmul loads from the installed
wheel before its own. The extension is optional: without a working C++ compiler the install
succeeds without it and the MoE runs on XLA (a one-line warning at first use).

`pip install -e .` puts one folder on sys.path (a .pth entry): build/__editable_packages__, holding
a link to each package folder, so a folder named zaya_jax beside a script (a clone, seen from its
parent) cannot shadow the install (tests/test_install.py).
"""

import importlib.util
import pathlib

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.editable_wheel import editable_wheel

PACKAGES = ("zaya_jax", "pallas_kernels")


def _package_dir(name: str) -> pathlib.Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"{name} (a build requirement) is not installed")
    return pathlib.Path(spec.origin).parent


class BuildNativeKernels(build_ext):
    """build_ext that finds the headers in the build environment and never fails the install."""

    def build_extension(self, ext):
        try:
            openblas = _package_dir("scipy_openblas32")
            ext.include_dirs += [str(_package_dir("jaxlib") / "include"), str(openblas / "include")]
            ext.library_dirs += [str(openblas / "lib")]
        except ModuleNotFoundError as err:
            print(f"WARNING: skipping the native CPU grouped matmul: {err}")
            return
        super().build_extension(ext)


class _PathEntry:
    """An editable install's strategy: one .pth line naming `folder` (setuptools' strategy protocol)."""

    def __init__(self, name: str, folder: pathlib.Path):
        self.name, self.folder = name, folder

    def __call__(self, wheel, files, mapping):
        wheel.writestr(f"__editable__.{self.name}.pth", f"{self.folder}\n".encode())

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return None


class EditableByLinks(editable_wheel):
    """editable_wheel whose sys.path entry is a folder of links to the package folders.

    setuptools' default for this flat layout is a finder appended to sys.meta_path, after the path
    finder: a folder named zaya_jax without __init__.py in the script's directory then wins as a
    namespace package. A path entry holding the real package is found first; the links keep new
    files visible without reinstalling."""

    def _select_strategy(self, name, tag, build_lib):
        project = pathlib.Path(self.project_dir).resolve()
        links = project / "build" / "__editable_packages__"
        links.mkdir(parents=True, exist_ok=True)
        for package in PACKAGES:
            link = links / package
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(project / package, target_is_directory=True)
        return _PathEntry(name, links)


setup(
    ext_modules=[Extension(
        "zaya_jax.native._grouped_matmul_ffi",
        sources=["zaya_jax/native/grouped_matmul.cc"],
        libraries=["scipy_openblas"],
        language="c++",
        extra_compile_args=["-std=c++17", "-O3", "-g0"],
        optional=True,
    )],
    cmdclass={"build_ext": BuildNativeKernels, "editable_wheel": EditableByLinks},
)
