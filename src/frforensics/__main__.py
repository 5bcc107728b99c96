"""``python -m frforensics`` is ``fr-analyze``."""

from frforensics.cli import main

if __name__ == "__main__":
    main()
