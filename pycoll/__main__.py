"""`python -m pycoll` is the `pycoll` command."""
import sys

from .cli import main

sys.exit(main())
