"""Builds the native CPU grouped matmul (zaya_jax/native/grouped_matmul.cc) at install time.

Headers: XLA's FFI headers from the jaxlib wheel (what `jax.ffi.include_dir()` returns) and
OpenBLAS's cblas.h from scipy-openblas32, both build requirements (pyproject.toml); the library links
scipy-openblas32's libscipy_openblas.so, which zaya_jax.native.grouped_matmul loads from the installed
wheel before its own. The extension is optional: without a working C++ compiler the install
succeeds without it and the MoE runs on XLA (a one-line warning at first use).
"""

import importlib.util
import pathlib

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


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


setup(
    ext_modules=[Extension(
        "zaya_jax.native._grouped_matmul_ffi",
        sources=["zaya_jax/native/grouped_matmul.cc"],
        libraries=["scipy_openblas"],
        language="c++",
        extra_compile_args=["-std=c++17", "-O3", "-g0"],
        optional=True,
    )],
    cmdclass={"build_ext": BuildNativeKernels},
)
