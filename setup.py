"""Build configuration for the one optional C extension (everything else is in pyproject.toml).

``frforensics.recorder._fastframes`` walks CPython 3.11's interpreter frames for
the recorder's per-op stack capture. It is optional twice over: it is only
attempted on CPython 3.11 (the frame layout is internal to each minor version),
and ``optional=True`` makes a failed compile (no compiler, no headers) a warning,
not a failed install. Without it the recorder uses its pure-Python walk.
"""

from __future__ import annotations

import platform
import sys

from setuptools import Extension, setup

ext_modules = []
if platform.python_implementation() == "CPython" and sys.version_info[:2] == (3, 11):
    ext_modules.append(
        Extension(
            "frforensics.recorder._fastframes",
            sources=["src/frforensics/recorder/_fastframes.c"],
            optional=True,
        )
    )

if platform.python_implementation() == "CPython":
    ext_modules.append(
        Extension(
            "frforensics.formats._picklescan",
            sources=["src/frforensics/formats/_picklescan.c"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
