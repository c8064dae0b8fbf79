"""`python -m supervisor.cli`: the same as `outboxd`."""

import sys

from supervisor.cli import main

sys.exit(main())
