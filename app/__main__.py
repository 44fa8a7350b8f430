"""`python -m app`: the command-line client (see app/cli.py)."""
import sys

from app.cli import main

sys.exit(main())
