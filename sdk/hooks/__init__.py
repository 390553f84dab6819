"""Hooks on the request path: input filters, output filters and audit, run by the client for every route.

    from sdk.hooks import Hook, AuditLog, RegexFilter, ContentBlocked

``sdk.hooks.base`` holds the interface (``Hook``, ``RequestContext``, ``Stop``, ``HookChain``);
``audit`` and ``filters`` the ready-made hooks; ``replay`` the audit record's replay part.
"""

from sdk.errors import ContentBlocked, HookFailed
from sdk.hooks.audit import AuditChainBroken, AuditLog
from sdk.hooks.base import FilterDecision, Hook, HookChain, ModelSource, RequestContext, RequestOrigin, Stop
from sdk.hooks.filters import RegexFilter

__all__ = [
    "AuditChainBroken",
    "AuditLog",
    "ContentBlocked",
    "FilterDecision",
    "Hook",
    "HookChain",
    "HookFailed",
    "ModelSource",
    "RegexFilter",
    "RequestContext",
    "RequestOrigin",
    "Stop",
]
