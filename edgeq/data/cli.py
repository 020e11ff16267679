"""`edgeq data`: describe a data source, export a split as .npz for devices."""

from __future__ import annotations

import click


@click.group("data")
def data():
    """Datasets: digits, shapes, faces, synthetic:HxWxC:K[:N], npz:PATH, images:DIR, coco:, tfrecord:."""


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
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["npz", "coco", "tfrecord"]),
    default="npz",
    show_default=True,
    help="npz: normalised float32 x and labels y (for profile --data). A detection split also as COCO JSON "
    "(OUT.json and OUT_images/) or as TF Object Detection API TFRecords.",
)
def export(source, split, out, fmt):
    """Write one split of SOURCE to OUT: .npz (normalised float32 x, labels y), COCO JSON or TFRecord."""
    from edgeq.data.sources import load_dataset
    from edgeq.data.splits import export_split

    dataset = load_dataset(source)
    if fmt == "npz":
        path = export_split(dataset, split, out)
    else:
        from edgeq.data.export import export_detection

        path = export_detection(dataset, split, out, fmt)
    click.echo(f"{path}: {len(dataset.split(split)[0])} samples of {dataset.input_shape}")
