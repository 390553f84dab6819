"""ServerPolicy: the tenants of ``paged serve``, their keys and terms; from a TOML file or built in Python.

The file (``paged serve --policy tenants.toml``)::

    [default]                  # every key without a [tenants.*] entry (--api-key keys, no-key access)
    requests_per_minute = 600

    [tenants.alice]
    keys = ["sk-alice-1", "sha256:3a6eb0790f39ac87c94f3856b2dd2c5d110e6811602261a9a923d3bb23adc8b7"]
    priority = -5              # alice may ask for -5 or any later priority
    weight = 2.0
    requests_per_minute = 60
    tokens_per_minute = 100000
    max_concurrent_requests = 8
    max_tokens = 512
    isolate_cache = true
    models = ["SmolLM2-135M-Instruct"]     # default: every model
    routes = ["/v1/chat/completions"]      # default: every route (ROUTES; /v1/responses covers its stored responses)

A key is the key itself or ``sha256:`` and the hex SHA-256 of it, so the file need not
hold secrets. The terms are ``sdk.policy.TenantPolicy``'s fields, checked with its bounds;
an unknown field is an error, never ignored. In Python: ``ServerPolicy(tenants=[Tenant(...)],
default=TenantPolicy(...))`` or ``ServerPolicy.load(path)``, then ``create_app(policy=...)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ParameterError
from sdk.policy import TenantPolicy

ROUTES = (
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/metrics", "/tokenize", "/detokenize",
    "/v1/embeddings", "/v1/rerank", "/rerank", "/v1/score", "/score",
)  # fmt: skip
ANONYMOUS = "anonymous"  # the tenant of requests to a server without keys
_HASHED = re.compile(r"sha256:[0-9a-f]{64}")
_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(TenantPolicy))


def route_of(path: str) -> str:
    """The route of ``ROUTES`` a request path belongs to: ``/v1/responses/{id}`` (and below) is ``/v1/responses``."""
    return "/v1/responses" if path.startswith("/v1/responses/") else path


class PolicyError(ValueError):
    """A policy that cannot be served; the message names the file, the tenant and the field."""


def key_digest(key: str) -> str:
    """The hex SHA-256 of an API key: how keys are stored and compared."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key: str) -> str:
    """A tenant id for an unnamed API key: a short hash, safe to log and audit."""
    return "key-" + key_digest(key)[:12]


@dataclass(frozen=True)
class Tenant:
    """One tenant: its keys, its terms, and the models and routes it may use (None = all)."""

    name: str
    keys: tuple[str, ...] = ()  # each the key or "sha256:<hex>"
    policy: TenantPolicy = field(default_factory=TenantPolicy)
    models: tuple[str, ...] | None = None
    routes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise PolicyError("a tenant needs a name")
        for i, key in enumerate(self.keys):
            if not isinstance(key, str) or not key or (key.startswith("sha256:") and not _HASHED.fullmatch(key)):
                raise PolicyError(f"tenants.{self.name}.keys.{i}: a key, or sha256: and 64 lower-case hex digits")
        for i, route in enumerate(self.routes or ()):
            if route not in ROUTES:
                raise PolicyError(f"tenants.{self.name}.routes.{i}: {route!r} is not one of {', '.join(ROUTES)}")

    @property
    def digests(self) -> tuple[str, ...]:
        return tuple(k.removeprefix("sha256:") if _HASHED.fullmatch(k) else key_digest(k) for k in self.keys)

    def may_use_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def may_use_route(self, route: str) -> bool:
        return self.routes is None or route in self.routes


@dataclass(frozen=True)
class ServerPolicy:
    """Every tenant of a server, and the terms of keys no tenant names.

    Raises:
        PolicyError: two tenants share a name or a key.
    """

    tenants: tuple[Tenant, ...] = ()
    default: TenantPolicy = field(default_factory=TenantPolicy)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", tuple(self.tenants))
        names: set[str] = set()
        digests: set[str] = set()
        for tenant in self.tenants:
            if tenant.name in names:
                raise PolicyError(f"tenants.{tenant.name}: named twice")
            names.add(tenant.name)
            for digest in tenant.digests:
                if digest in digests:
                    raise PolicyError(f"tenants.{tenant.name}.keys: a key another tenant has")
                digests.add(digest)

    @classmethod
    def load(cls, path: str | Path) -> ServerPolicy:
        """Read a policy file (TOML, the format in the module docstring).

        Raises:
            PolicyError: unreadable, not TOML, or a field that is unknown or out of bounds.
        """
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise PolicyError(f"{path}: {exc}") from None
        try:
            return cls.from_dict(data)
        except PolicyError as exc:
            raise PolicyError(f"{path}: {exc}") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServerPolicy:
        """A policy from the parsed file: ``{"default": {...}, "tenants": {name: {...}}}``."""
        _no_unknown(data, {"default", "tenants"}, "")
        default = _terms(data.get("default", {}), "default")
        tenants = []
        raw_tenants = data.get("tenants", {})
        if not isinstance(raw_tenants, Mapping):
            raise PolicyError("tenants: a table of [tenants.NAME] sections")
        for name, raw in raw_tenants.items():
            where = f"tenants.{name}"
            if not isinstance(raw, Mapping):
                raise PolicyError(f"{where}: a table")
            _no_unknown(raw, _POLICY_FIELDS | {"keys", "models", "routes"}, where)
            terms = {k: v for k, v in raw.items() if k in _POLICY_FIELDS}
            if not raw.get("keys"):
                raise PolicyError(f"{where}.keys: at least one key is needed")
            tenants.append(
                Tenant(
                    name, _strings(raw.get("keys"), f"{where}.keys") or (), _terms(terms, where),
                    _strings(raw.get("models"), f"{where}.models"), _strings(raw.get("routes"), f"{where}.routes"),
                )  # fmt: skip
            )
        return cls(tuple(tenants), default)

    def with_keys(self, keys: Mapping[str, str]) -> ServerPolicy:
        """This policy plus ``{tenant: key}`` (``--api-key``), each a tenant on the default terms."""
        added = [Tenant(name, (key,), self.default) for name, key in keys.items()]
        return dataclasses.replace(self, tenants=(*self.tenants, *added))

    def key_table(self) -> dict[str, str]:
        """Key digest -> tenant name."""
        return {digest: tenant.name for tenant in self.tenants for digest in tenant.digests}

    def tenant(self, name: str) -> Tenant:
        """The named tenant; the anonymous one (default terms, every model and route) for ``ANONYMOUS``."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        if name == ANONYMOUS:
            return Tenant(ANONYMOUS, (), self.default)
        raise KeyError(name)


def _terms(raw: Any, where: str) -> TenantPolicy:
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: a table")
    _no_unknown(raw, _POLICY_FIELDS, where)
    try:
        return TenantPolicy(**raw)
    except ParameterError as exc:
        raise PolicyError(f"{where}.{exc}") from None


def _strings(raw: Any, where: str) -> tuple[str, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise PolicyError(f"{where}: a list of strings")
    return tuple(raw)


def _no_unknown(raw: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise PolicyError(f"{where + '.' if where else ''}{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
