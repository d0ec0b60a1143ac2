"""The native recording path (dtwatch/record/_fastpath.c), built with the machine's C compiler where it has one.

Everything else about the package is in pyproject.toml. The extension is optional: without a compiler the
package installs and dtwatch records through its Python path (dtwatch.record.native says which is in use).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dtwatch.record._fastpath",
            sources=["dtwatch/record/_fastpath.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-missing-field-initializers"],
            optional=True,
        )
    ]
)
