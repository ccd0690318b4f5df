"""The `batchgen` command line. Options map onto the config dataclasses; defaults live there."""

from __future__ import annotations

import click

from batchgen.errors import BatchgenError


@click.group()
def main() -> None:
    """Offline batch generation with a continuous-batching engine."""


@main.group()
def model() -> None:
    """The embedded default model."""


@model.command("build-default")
def build_default() -> None:
    """Build the embedded tiny model (deterministic, offline) and print its folder."""
    from batchgen.models import default_model_path

    try:
        click.echo(default_model_path())
    except BatchgenError as exc:
        raise click.ClickException(str(exc)) from exc
