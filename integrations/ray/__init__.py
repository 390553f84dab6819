"""The engine as a fleet on Ray Serve: ``paged serve --replicas N`` or a Serve config (docs/scale_out.md).

Needs the ``ray`` extra. ``app.build_app`` (and ``config.app_builder`` for Serve configs) make the application,
``router.PrefixAffinityRouter`` routes by prompt prefix, ``replica.EngineReplica`` runs one
``paged serve`` per replica, ``ingress.Ingress`` is the HTTP entry.
"""
