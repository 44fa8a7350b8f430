"""Tenants for tests (app/core/tenants.py): a bearer header, and a tenants file written the way an operator would."""

from __future__ import annotations

import json
from pathlib import Path

from app.core.tenants import ADMIN, CLIENT, token_digest


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def write_tenants_file(
    path: Path, tokens: dict[str, str], admins: tuple[str, ...] = ("ops",), limits: dict[str, dict] | None = None
) -> Path:
    """`tokens` maps each token to its tenant's name; the tenants in `admins` are admins, the rest clients;
    `limits` gives a tenant its own limits. Only the tokens' digests are written."""
    tenants: dict[str, dict] = {}
    for token, name in tokens.items():
        spec = tenants.setdefault(name, {"role": ADMIN if name in admins else CLIENT, "token_sha256": []})
        spec["token_sha256"].append(token_digest(token))
    for name, own in (limits or {}).items():
        tenants[name]["limits"] = own
    path.write_text(json.dumps({"tenants": tenants}))
    return path
