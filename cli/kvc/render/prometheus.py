"""Prometheus text for `kvc stats --prom` (the metric families are `kvcache.live.metrics`'s; `kvc serve
--metrics-port` serves the same)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


def print_prometheus(families: Iterable[Metric]) -> None:
    """The Prometheus text exposition of metric families (`kvcache.live.metrics`) on stdout."""
    from kvcache.live.metrics import exposition  # prometheus_client: only when asked for

    typer.echo(exposition(families), nl=False)
