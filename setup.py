"""The native I/O module (datastates._native, from csrc/); everything else is declared in pyproject.toml.

The native module is not optional: if it cannot be compiled, installation fails.
"""
import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

native = Pybind11Extension(
    "datastates._native",
    sorted(glob.glob("csrc/*.cpp")),
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext}, zip_safe=False)
