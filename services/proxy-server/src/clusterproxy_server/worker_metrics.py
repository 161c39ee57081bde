"""The pod's metrics under ``--workers N``: each worker's, merged as one process would count them."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

__all__ = ["MergedMetrics", "sum_samples"]


class MergedMetrics(Collector):
    """The workers' metrics as one process would count them: every sample summed over the workers
    (counters, gauges of what each holds, histogram buckets), the ``_created`` times the earliest."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for text in self.texts:
            for family in text_string_to_metric_families(text):
                families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                samples = values.setdefault(family.name, {})
                for sample in family.samples:
                    key = (sample.name, tuple(sample.labels.items()))
                    if key not in samples:
                        samples[key] = sample.value
                    elif sample.name.endswith("_created"):
                        samples[key] = min(samples[key], sample.value)
                    else:
                        samples[key] += sample.value
        for name, family in families.items():
            for (sample_name, labels), value in values[name].items():
                family.add_sample(sample_name, dict(labels), value)
            yield family


def sum_samples(text: bytes, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
        if sample.name == name
    )
