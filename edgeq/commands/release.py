"""``edgeq release`` (host) and ``edgeq pull`` (device): pull-based rollout (deploy/FLEET.md)."""

from __future__ import annotations

import click


@click.command("release")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder a static web server serves.")
@click.option("--version", "version", required=True, help="The release's name, e.g. 2026-12-05.1.")
@click.option("--key", type=click.Path(dir_okay=False), help="SSH private key that signs release.json.")
def release(files, out, version, key):
    """Write FILES (models with their manifests) and a signed release.json into --out, for
    devices to fetch with `edgeq pull URL`."""
    from edgeq.fleet.release import make_release

    path = make_release(list(files), out, version, key)
    click.echo(f"release {version}: {len(files)} file(s) in {path.parent} ({'signed' if key else 'unsigned'})")


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
        click.echo(f"release {result.version}: updated {', '.join(result.updated)} ({result.fetched} request(s))")
    else:
        click.echo(f"release {result.version}: up to date ({result.fetched} request(s))")
