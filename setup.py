"""Builds the optional C copy kernel, llm_datadist._shm._copykernel (shm/_copykernel.c); every other piece of
metadata lives in pyproject.toml. `optional=True`: without a compiler or Python's headers the install goes
on without it (as msgpack's and PyYAML's do) and the copies run in numpy."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "llm_datadist._shm._copykernel",
            sources=["shm/_copykernel.c"],
            optional=True,
        )
    ]
)
