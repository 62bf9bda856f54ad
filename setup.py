"""Builds datastates and its native I/O module (datastates._native, from csrc/).

The native module is not optional: if it cannot be compiled, installation fails.
"""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

native = Pybind11Extension(
    "datastates._native",
    sorted(__import__("glob").glob("csrc/*.cpp")),
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(
    name="datastates-llm",
    version="0.1.0",
    description="Lazy asynchronous multi-level checkpointing for Megatron-style LLM training",
    packages=find_packages(include=["datastates", "datastates.*"]),
    ext_modules=[native],
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "megatron-core>=0.16.1,<0.20", "psutil", "numpy"],
    extras_require={"test": ["pytest", "hypothesis", "safetensors"]},
    zip_safe=False,
)
