"""``python -m frforensics.recorder._cxx [--background]``: see :func:`main`."""

import sys

from frforensics.recorder._cxx import main

sys.exit(main())
