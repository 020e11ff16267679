"""`edgeq data`: describe a data source, export a split as .npz for devices."""

from __future__ import annotations

import click


@click.group("data")
def data():
    """Datasets: digits, synthetic:HxWxC:K[:N], npz:PATH, images:DIR."""


@data.command("info")
@click.argument("source")
def info(source):
    """Print shapes, classes, split sizes and normalisation of SOURCE."""
    import json

    from edgeq.data.sources import load_dataset

    click.echo(json.dumps(load_dataset(source).describe(), indent=2))


@data.command("export")
@click.argument("source")
@click.option("--split", type=click.Choice(["train", "val", "test"]), default="test", show_default=True)
@click.option("--out", required=True, type=click.Path(dir_okay=False))
def export(source, split, out):
    """Write one split of SOURCE (normalised float32 x, labels y) to OUT.npz."""
    from edgeq.data.sources import load_dataset
    from edgeq.data.splits import export_split

    dataset = load_dataset(source)
    path = export_split(dataset, split, out)
    click.echo(f"{path}: {len(dataset.split(split)[0])} samples of {dataset.input_shape}")
