"""Tenants: an optional API-key file mapping each key to the memories it may read and change (docs/serving.md).

The file is JSON: {"keys": {"<key>": {"memories": ["alice", "team-*"], "admin": false}}}. A pattern ending in `*`
covers every memory whose name starts with what comes before it. A key may read the base model, and read, learn into,
forget from, merge into, delete and list the memories its patterns cover (a merge needs every source and the target).
`admin: true` covers every memory. Without a key file the server is open: every request may do everything.

Keys are compared in constant time. A request with no key or an unknown one is answered 401; a known key asking for
a memory it does not cover is answered 403 with the same body whether the memory exists or not, so nothing about
other tenants leaks.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from ..hf.memory_store import NAME_PATTERN
from .schemas import ServeError


@dataclass(frozen=True)
class Tenant:
    """What one key may touch: memory-name patterns (exact names, or prefixes ending in '*'), or everything."""

    patterns: tuple[str, ...]
    admin: bool = False

    def covers(self, name: str) -> bool:
        if self.admin:
            return True
        return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in self.patterns)


OPEN = Tenant((), admin=True)  # a server without a key file


def load_keys(path: str | Path) -> dict[str, Tenant]:
    """The tenants of an API-key file (see the module docstring); ValueError naming the file and the entry at fault."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"api_keys: cannot read {path} as JSON ({err})") from None
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, dict) or not keys:
        raise ValueError(f'api_keys: {path}: expected {{"keys": {{<key>: {{"memories": [...]}}}}}}')
    tenants = {}
    for number, (key, entry) in enumerate(keys.items()):
        where = f"api_keys: {path}: key #{number + 1}"  # never the key itself: it is a secret
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError(f"{where}: a key must be a string of at least 8 characters")
        if not isinstance(entry, dict) or set(entry) - {"memories", "admin"}:
            raise ValueError(f'{where}: expected {{"memories": [...], "admin": false}}')
        patterns = entry.get("memories", [])
        admin = entry.get("admin", False)
        if not isinstance(patterns, list) or not isinstance(admin, bool):
            raise ValueError(f"{where}: memories must be a list of names or prefixes ending in '*', admin a bool")
        for pattern in patterns:
            stem = pattern[:-1] if isinstance(pattern, str) and pattern.endswith("*") else pattern
            if not isinstance(stem, str) or (stem and not NAME_PATTERN.fullmatch(stem)):
                raise ValueError(f"{where}: {pattern!r} is not a memory name or a prefix ending in '*'")
        tenants[key] = Tenant(tuple(patterns), admin)
    return tenants


class Gate:
    """Who a request is, from its `Authorization: Bearer <key>` header (the OpenAI clients send it)."""

    def __init__(self, tenants: dict[str, Tenant] | None) -> None:
        self.tenants = tenants

    def tenant(self, authorization: str | None) -> Tenant:
        if self.tenants is None:
            return OPEN
        scheme, _, key = (authorization or "").partition(" ")
        found = None
        for known, tenant in self.tenants.items():  # every key compared, in constant time each
            if hmac.compare_digest(known.encode(), key.strip().encode()) and scheme.lower() == "bearer":
                found = tenant
        if found is None:
            raise ServeError("unauthorized", None, 401)
        return found

    @staticmethod
    def check(tenant: Tenant, *names: str | None) -> None:
        """403, with no detail, unless `tenant` covers every memory of `names` (None: the base model)."""
        if not all(name is None or tenant.covers(name) for name in names):
            raise ServeError("forbidden", None, 403)
