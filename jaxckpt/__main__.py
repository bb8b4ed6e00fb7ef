"""`python -m jaxckpt demo|plan`: the `jaxckpt` command where no console script is installed."""

import sys

from jaxckpt.cli import main

sys.exit(main())
