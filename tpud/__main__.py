"""`python -m tpud`: the same as the `tpud` command."""

import sys

from tpud.cli import main

if __name__ == "__main__":
    sys.exit(main())
