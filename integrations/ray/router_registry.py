"""The prefix routers of this process, so the ingress can ask its handle's router which replicas it routes to.

NOTE: a module of its own: Ray Serve pickles a router's module by value, so state kept there would
be a copy; this module is pickled by reference, and the router and the ingress share it.
"""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(app_name: str, deployment_name: str, router: Any) -> None:
    """Records ``router`` (a ``PrefixAffinityRouter``) as this process's router for the deployment."""
    _ROUTERS[f"{app_name}#{deployment_name}"] = router


def replica_ids(app_name: str, deployment_name: str) -> list[str]:
    """The replicas this process's router for the deployment can route to; empty before its first request."""
    router = _ROUTERS.get(f"{app_name}#{deployment_name}")
    return [] if router is None else [replica_id.unique_id for replica_id in list(router.curr_replicas)]
