"""`python -m paratune ...`: the command line, for a job entry point or an environment without the script on PATH."""

import sys

from paratune.cli import main

sys.exit(main())
