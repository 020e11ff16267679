"""``edgeq release`` (host) and ``edgeq pull`` (device): pull-based rollout (deploy/FLEET.md)."""

from __future__ import annotations

import json

import click


@click.command("release")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder a static web server serves.")
@click.option("--version", "version", help="The release's name, e.g. 2026-12-05.1.")
@click.option("--key", type=click.Path(dir_okay=False), help="SSH private key that signs release.json.")
@click.option(
    "--number", type=click.IntRange(min=1), help="Its place in the store's order [default: the store's last + 1]."
)
@click.option(
    "--expires", default="30d", show_default=True, help="How long devices accept it (30d, 12h): stops a freeze."
)
@click.option("--resign", is_flag=True, help="Re-sign the store's current release with a new --expires, no FILES.")
@click.option(
    "--rollback-to",
    metavar="VERSION",
    help="A new release, numbered above the store's, carrying the files of the earlier release VERSION.",
)
def release(files, out, version, key, number, expires, resign, rollback_to):
    """Write FILES (models with their manifests) and a signed release.json into --out, for
    devices to fetch with `edgeq pull URL`. Each release is numbered above the last and expires:
    devices refuse an older number (rollback) and expired metadata (freeze)."""
    from edgeq.errors import UsageError
    from edgeq.fleet.release import make_release, resign_release, rollback_release

    if resign or rollback_to:
        if files or (resign and rollback_to) or number is not None:
            raise UsageError("--resign and --rollback-to take no FILES and no --number, and not both")
        path = resign_release(out, key, expires) if resign else rollback_release(out, rollback_to, key, expires)
    else:
        if not files or not version:
            raise UsageError("give the FILES to release and --version NAME (or --resign, or --rollback-to VERSION)")
        path = make_release(list(files), out, version, key, number, expires)
    record = json.loads(path.read_text(encoding="utf-8"))
    click.echo(
        f"release {record['version']} (number {record['number']}): {len(record['files'])} file(s) in {path.parent}, "
        f"{'signed' if key else 'unsigned'}, expires {record['expires']}"
    )


@click.command("pull")
@click.argument("url")
@click.option("--workdir", default="~/edgeq", show_default=True, help="The device's edgeq folder (as push uses).")
@click.option(
    "--allowed-signers",
    type=click.Path(dir_okay=False),
    help="ssh-keygen allowed_signers file naming the release key (principal edgeq-release).",
)
@click.option("--unsigned", is_flag=True, help="Accept a release without a signature (trusted networks only).")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds per HTTP request.")
def pull(url, workdir, allowed_signers, unsigned, timeout):
    """Make the release at URL live in WORKDIR/models: only changed files are fetched, each
    checked by sha256, the replaced version kept for `edgeq push --rollback`."""
    from edgeq.errors import UsageError
    from edgeq.fleet.release import pull as run_pull

    if not allowed_signers and not unsigned:
        raise UsageError("give --allowed-signers FILE to check the release's signature (or --unsigned to skip it)")
    result = run_pull(url, workdir, None if unsigned else allowed_signers, timeout)
    if result.updated:
        click.echo(
            f"release {result.version} (number {result.number}): updated {', '.join(result.updated)} "
            f"({result.fetched} request(s))"
        )
    else:
        click.echo(f"release {result.version} (number {result.number}): up to date ({result.fetched} request(s))")
