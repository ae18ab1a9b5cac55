"""`python -m jaxpaged.serve`: the OpenAI-compatible server, kept at this name (the code is
jaxpaged/entrypoints/serve/)."""

import sys

from jaxpaged.entrypoints.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
