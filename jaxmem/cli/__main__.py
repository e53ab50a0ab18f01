"""`python -m jaxmem.cli`: the jaxmem command line."""
import sys

from jaxmem.cli import main

sys.exit(main())
