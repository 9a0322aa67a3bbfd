"""Prometheus text for `kvc stats --prom` (the metric families are `kvcache.live.metrics`'s; `kvc serve
--metrics-port` serves the same)."""

from __future__ import annotations

import typer


def print_prometheus(families: list) -> None:
    """The Prometheus text exposition of metric families (`kvcache.live.metrics`) on stdout."""
    from kvcache.live.metrics import exposition  # prometheus_client: only when asked for

    typer.echo(exposition(families), nl=False)
