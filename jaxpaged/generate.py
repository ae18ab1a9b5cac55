"""`python -m jaxpaged.generate`: the command line, kept at this name (the code is jaxpaged/entrypoints/cli.py)."""

import sys

from jaxpaged.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
