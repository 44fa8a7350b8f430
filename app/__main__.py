"""`python -m app`: the command-line client (see app/clients/cli.py), the same as the installed `encore` command."""

import sys

from app.clients.cli import main

sys.exit(main(prog="python -m app"))
