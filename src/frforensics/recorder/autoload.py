"""Hook called by torch on ``import torch`` (entry point group ``torch.backends``).

It must cost nothing and never raise: a raise here breaks ``import torch`` for the
whole environment. It does nothing unless ``FRFORENSICS_ENABLE`` is set.
"""

from __future__ import annotations

import os


def autoload() -> None:
    """Turn the recorder on when ``FRFORENSICS_ENABLE`` asks for it; else no-op."""
    if not os.environ.get("FRFORENSICS_ENABLE"):
        return
    try:
        from frforensics.recorder._enable import _autoenable

        _autoenable()
    except Exception as exc:  # never break `import torch`
        import sys

        print(f"frforensics: recorder not enabled: {exc}", file=sys.stderr)
