"""The fleet's ``/metrics``: every replica's exposition, merged, each sample labelled with its replica."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


def merge_expositions(expositions: Mapping[str, str]) -> bytes:
    """One Prometheus text exposition of ``{replica id: its exposition}``: each family once, samples labelled.

    Raises:
        ValueError: an exposition that does not parse.
    """
    families: dict[str, Metric] = {}
    for replica, text in expositions.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            merged.samples.extend(s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
