"""`python -m app`: the command-line client (see app/clients/cli.py)."""

import sys

from app.clients.cli import main

sys.exit(main())
