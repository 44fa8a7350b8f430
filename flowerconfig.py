"""Flower settings, read by `celery -A app flower` from the working directory (Flower's --conf default).

Basic auth always: ENCORE_FLOWER_BASIC_AUTH="user:password[,user2:password2]"; without it a random
password is generated and printed once, so neither the UI nor the API is ever open. State (tasks seen,
workers) persists in ENCORE_FLOWER_DB across restarts. The values come from app.core.config, like celeryconfig's.
"""

import secrets
import sys

from app.core.config import load_settings

_settings = load_settings()
_credentials = _settings.flower_basic_auth
if not _credentials:
    _credentials = f"admin:{secrets.token_urlsafe(12)}"
    print(f"[flower] ENCORE_FLOWER_BASIC_AUTH not set; generated credentials {_credentials}", file=sys.stderr)

basic_auth = [pair.strip() for pair in _credentials.split(",") if pair.strip()]
port = _settings.flower_port
address = _settings.flower_address
persistent = True
db = _settings.flower_db
state_save_interval = 60_000  # ms: persist the state every minute, not only at shutdown
max_tasks = 100_000
