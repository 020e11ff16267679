"""``edgeq report PATH... --out report.html``: one self-contained page of what quantization cost."""

from __future__ import annotations

import click

from edgeq.ui import human_bytes


@click.command("report")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True), metavar="PATH...")
@click.option("--out", default="report.html", show_default=True, type=click.Path(dir_okay=False), help="HTML file.")
@click.option("--title", help="Page title (default: 'edgeq report').")
@click.option("--open", "open_browser", is_flag=True, help="Open the page in the default browser, where there is one.")
def report(paths, out, title, open_browser):
    """Run folders and edgeq JSON (manifests, eval, analyze, profile, verify) and .tflite files -> one HTML page."""
    from edgeq.report.build import build_report

    result = build_report(list(paths), out, title=title)
    words = {"pass": "passes", "fail": "FAILS", "unknown": "no pass/fail check"}[result.verdict]
    click.echo(
        f"report: {result.path} ({human_bytes(result.size_bytes)}, {result.seconds:.1f} s; "
        f"{', '.join(result.sections) or 'no sections'}): {words}"
    )
    if open_browser:
        import webbrowser

        if not webbrowser.open(result.path.resolve().as_uri()):
            click.echo("no browser here: open the file yourself", err=True)
