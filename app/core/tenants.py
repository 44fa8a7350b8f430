"""Who a request is: every API token belongs to a tenant, and every tenant has a role.

A tenant owns the jobs it submits: it reads, lists, follows, downloads, cancels and retries only those, and its
idempotency keys and rate-limit windows are its own. Another tenant's job answers exactly as a job that does not
exist. `admin` tenants also see every tenant's jobs and run the operator routes (drain, resume, the worker table).

Where tenants come from (app/core/config.py reads the variables; `tenant_directory` builds this from them):

- `ENCORE_TENANTS_FILE`: a JSON file an operator edits, tokens kept as SHA-256 digests, never in clear
  (`python -m app hash-token` prints one). Read at start; restart the web (or send gunicorn HUP) to apply a change.

      {"tenants": {"acme":  {"role": "client", "token_sha256": ["9f86d0…"]},
                   "ops":   {"role": "admin",  "token_sha256": ["60303a…"]}}}

- `API_TOKEN=a,b`: each token is a `client` tenant of its own (named `token-` and the first 12 hex digits of its
  digest); `ENCORE_ADMIN_TOKENS=x` names admin tokens (tenant `admin`). Both may be set beside the file.
- One `API_TOKEN` and nothing else: that token is the one tenant, `default`, and administers the deployment, as
  before tenants existed. No token at all (the demo): every request is `default`, an admin.

Jobs written before tenants existed have no owner field: they belong to `default`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLIENT, ADMIN = "client", "admin"
ROLES = (CLIENT, ADMIN)
DEFAULT_TENANT = "default"  # the implicit tenant: no authentication, one token, or a job older than tenants
ADMIN_TENANT = "admin"  # the tenant of ENCORE_ADMIN_TOKENS
TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}", re.ASCII)  # matched whole: safe in keys, labels and logs
DIGEST = re.compile(r"[0-9a-f]{64}", re.ASCII)


PRIORITY_LEVELS = ("low", "normal", "high")  # app/core/priority.PRIORITIES, least first (checked in a test)
LIMIT_FIELDS = ("max_open_tracks", "max_priority", "max_retries", "max_song_s", "max_video_s", "submit_rate_limit")


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's own limits from the tenants file; None: the deployment's default (app/control/tenant_limits.py
    resolves them against the settings)."""

    max_open_tracks: int | None = None  # tracks not ended at once (0: no cap)
    max_priority: str | None = None  # the highest priority its jobs may ask for
    max_retries: int | None = None  # retries per track
    max_song_s: float | None = None  # the longest song it may ask for
    max_video_s: float | None = None  # the longest face video it may upload
    submit_rate_limit: str | None = None  # its submit rate, in the limits package's notation ("10/minute")


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name (what owns jobs), its role and its own limits."""

    name: str
    role: str = CLIENT
    limits: TenantLimits = field(default_factory=TenantLimits, compare=False)

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN

    def may_see(self, owner: str) -> bool:
        """Whether this tenant may read or act on a job owned by `owner`."""
        return self.is_admin or owner == self.name


OPEN_TENANT = Tenant(DEFAULT_TENANT, ADMIN)  # every request of a deployment with no token (the demo)


def token_digest(token: str | bytes) -> str:
    """The SHA-256 hex digest a token is stored and looked up as."""
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).hexdigest()


def token_tenant_name(token: str) -> str:
    """The tenant name an `API_TOKEN` entry gets when several are listed."""
    return "token-" + token_digest(token)[:12]


@dataclass(frozen=True)
class TenantDirectory:
    """Every known token digest and its tenant. `open`: no token is configured, so no request authenticates and
    every request is the implicit admin tenant `default` (the demo)."""

    by_digest: dict[str, Tenant] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return not self.by_digest

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """Each tenant once, by name."""
        return tuple(sorted(set(self.by_digest.values()), key=lambda t: t.name))

    def named(self, name: str) -> Tenant:
        """The tenant called `name` (a job's owner): as configured; with no token configured, the implicit admin;
        otherwise a client with the deployment's default limits (an owner since removed from the configuration)."""
        if self.open:
            return OPEN_TENANT
        return next((t for t in self.by_digest.values() if t.name == name), Tenant(name or DEFAULT_TENANT, CLIENT))

    def for_token(self, token: str | bytes) -> Tenant | None:
        """The tenant of a bearer token, or None. A dict lookup of the token's digest: what an attacker can time
        is the lookup of a SHA-256 they cannot steer, never a comparison with a stored token."""
        if self.open:
            return OPEN_TENANT
        return self.by_digest.get(token_digest(token))

    def for_authorization(self, header: str) -> Tenant | None:
        """The tenant of an `Authorization: Bearer <token>` header (its bytes as sent: non-ASCII never matches),
        or None when it names no known token. With no token configured, every request is `default` (admin)."""
        if self.open:
            return OPEN_TENANT
        scheme, _, given = header.partition(" ")
        token = given.strip(" \t")  # HTTP's optional whitespace only: str.strip() also drops 0x85 and 0xA0
        if scheme.lower() != "bearer" or not token:
            return None
        return self.for_token(token.encode("latin-1", "replace"))


def tenant_directory(
    api_tokens: tuple[str, ...], admin_tokens: tuple[str, ...] = (), tenants_file: Path | None = None
) -> TenantDirectory:
    """The directory from the settings (see the module docstring). ValueError naming the setting for an unreadable
    or malformed file, an unknown role, a bad digest or name, or one token given to two tenants."""
    entries: list[tuple[str, Tenant, str]] = []  # (digest, tenant, where it came from)
    if tenants_file is not None:
        entries += _from_file(tenants_file)
    if len(api_tokens) == 1 and not admin_tokens and tenants_file is None:
        entries.append((token_digest(api_tokens[0]), Tenant(DEFAULT_TENANT, ADMIN), "API_TOKEN"))
    else:
        entries += [(token_digest(t), Tenant(token_tenant_name(t), CLIENT), "API_TOKEN") for t in api_tokens]
    entries += [(token_digest(t), Tenant(ADMIN_TENANT, ADMIN), "ENCORE_ADMIN_TOKENS") for t in admin_tokens]
    by_digest: dict[str, Tenant] = {}
    origin: dict[str, str] = {}
    for digest, tenant, where in entries:
        if digest in by_digest:
            raise ValueError(
                f"{where}: a token is given twice (also in {origin[digest]}, tenant {by_digest[digest].name!r})"
            )
        by_digest[digest], origin[digest] = tenant, where
    return TenantDirectory(by_digest)


RESERVED_NAMES = re.compile(r"admin|default|token-[0-9a-f]{12}", re.ASCII)  # matched whole: names other sources give


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose every key is given once (json.loads keeps the last of two silently)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} is given twice in one object")
        seen[key] = value
    return seen


def _from_file(path: Path) -> list[tuple[str, Tenant, str]]:
    where = "ENCORE_TENANTS_FILE"
    try:
        document = json.loads(path.read_text(), object_pairs_hook=_unique_keys)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {path} is not JSON: {exc}") from None
    except ValueError as exc:  # a key given twice (_unique_keys): one of the two would be dropped without a word
        raise ValueError(f"{where}: {path}: {exc}") from None
    tenants = document.get("tenants") if isinstance(document, dict) else None
    if not isinstance(tenants, dict) or not tenants:
        raise ValueError(f'{where}: {path} must hold {{"tenants": {{name: {{"role", "token_sha256"}}}}}}')
    entries = []
    for name, spec in tenants.items():
        if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
            raise ValueError(
                f"{where}: tenant name {name!r}: 1 to 63 of a-z 0-9 _ . - (starting with a letter or digit)"
            )
        if RESERVED_NAMES.fullmatch(name):
            raise ValueError(
                f"{where}: tenant name {name!r} is reserved: `admin` is ENCORE_ADMIN_TOKENS' tenant, `default` the "
                "single API_TOKEN's and older jobs', `token-<12 hex>` an API_TOKEN entry's (it would read their jobs)"
            )
        if not isinstance(spec, dict) or set(spec) - {"role", "token_sha256", "limits"}:
            raise ValueError(f'{where}: tenant {name!r}: an object with "role", "token_sha256" and "limits" only')
        role = spec.get("role", CLIENT)
        if role not in ROLES:
            raise ValueError(f"{where}: tenant {name!r}: role must be one of {', '.join(ROLES)}, not {role!r}")
        digests = spec.get("token_sha256")
        if not isinstance(digests, list) or not digests:
            raise ValueError(f"{where}: tenant {name!r}: token_sha256 must be a non-empty list of digests")
        for digest in digests:
            if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
                raise ValueError(
                    f"{where}: tenant {name!r}: {str(digest)[:70]!r} is not a SHA-256 hex digest "
                    "(64 lower-case hex digits; `python -m app hash-token` prints one)"
                )
        limits = _limits(name, spec.get("limits", {}), where)
        for digest in digests:
            entries.append((digest, Tenant(name, role, limits), where))
    return entries


def _limits(name: str, spec: object, where: str) -> TenantLimits:
    """A tenant's "limits" object: each field checked for its type and range, naming it."""
    if not isinstance(spec, dict) or set(spec) - set(LIMIT_FIELDS):
        raise ValueError(f"{where}: tenant {name!r}: limits may hold {', '.join(LIMIT_FIELDS)} only")
    for field_name in ("max_open_tracks", "max_retries"):
        value = spec.get(field_name)
        if value is not None and (type(value) is not int or value < 0):
            raise ValueError(f"{where}: tenant {name!r}: limits.{field_name} must be a whole number >= 0")
    for field_name in ("max_song_s", "max_video_s"):
        value = spec.get(field_name)
        if value is not None and (type(value) not in (int, float) or not 0 < value < 1e9):
            raise ValueError(f"{where}: tenant {name!r}: limits.{field_name} must be a number of seconds above 0")
    priority = spec.get("max_priority")
    if priority is not None and priority not in PRIORITY_LEVELS:
        raise ValueError(f"{where}: tenant {name!r}: limits.max_priority must be one of {', '.join(PRIORITY_LEVELS)}")
    rate = spec.get("submit_rate_limit")
    if rate is not None:
        if not isinstance(rate, str) or not rate.strip():
            raise ValueError(f"{where}: tenant {name!r}: limits.submit_rate_limit must be a rate such as 10/minute")
        check_rate(rate, f"{where}: tenant {name!r}: limits.submit_rate_limit")
    return TenantLimits(**spec)


def check_rate(rate: str, where: str) -> None:
    """A submit rate in the `limits` notation (`10/minute;200/day`), each item allowing at least one request (a
    `0/minute` would refuse every submit); ValueError naming `where` otherwise."""
    from limits import parse_many

    try:
        items = parse_many(rate)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    for item in items:
        if item.amount < 1:
            raise ValueError(f"{where}: {item} lets no request through; give at least 1 per window")
