"""``edgeq release`` (host) and ``edgeq pull`` (device): pull-based rollout (deploy/FLEET.md)."""

from __future__ import annotations

import json

import click


@click.command("release")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder a static web server serves.")
@click.option("--version", "version", help="The release's name, e.g. 2026-12-05.1.")
@click.option(
    "--key",
    "keys",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="SSH private key that signs release.json (repeat it: one signature per key, for a --threshold).",
)
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
@click.option(
    "--cosign",
    is_flag=True,
    help="Add --key's signature to the store's current release.json (a second signer of a k-of-n release).",
)
def release(files, out, version, keys, number, expires, resign, rollback_to, cosign):
    """Write FILES (models with their manifests) and a signed release.json into --out, for
    devices to fetch with `edgeq pull URL`. Each release is numbered above the last and expires:
    devices refuse an older number (rollback) and expired metadata (freeze)."""
    from edgeq.errors import UsageError
    from edgeq.fleet.release import cosign as add_signature
    from edgeq.fleet.release import make_release, resign_release, rollback_release

    key = list(keys) or None
    if cosign:
        if files or resign or rollback_to or len(keys) != 1:
            raise UsageError("--cosign adds one --key's signature to the release in --out: no FILES, no other action")
        count = add_signature(out, keys[0])
        click.echo(f"{out}: release.json now carries {count} signature(s)")
        return
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
        f"{f'signed by {len(keys)} key(s)' if keys else 'unsigned'}, expires {record['expires']}"
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
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds per socket read or connect.")
@click.option(
    "--min-rate",
    type=float,
    default=16.0,
    show_default=True,
    help="KiB/s: a download slower than this on average (past --timeout) is dropped, as a slow-retrieval attack.",
)
@click.option(
    "--threshold",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Distinct keys of --allowed-signers that must have signed the release (k of n).",
)
def pull(url, workdir, allowed_signers, unsigned, timeout, min_rate, threshold):
    """Make the release at URL live in WORKDIR/models: only changed files are fetched, each
    checked by sha256, the replaced version kept for `edgeq push --rollback`."""
    from edgeq.errors import UsageError
    from edgeq.fleet.release import pull as run_pull

    if not allowed_signers and not unsigned:
        raise UsageError("give --allowed-signers FILE to check the release's signature (or --unsigned to skip it)")
    if unsigned and threshold > 1:
        raise UsageError("--threshold counts signatures: it needs --allowed-signers, not --unsigned")
    result = run_pull(url, workdir, None if unsigned else allowed_signers, timeout, threshold, min_rate * 1024)
    if result.updated:
        click.echo(
            f"release {result.version} (number {result.number}): updated {', '.join(result.updated)} "
            f"({result.fetched} request(s))"
        )
    else:
        click.echo(f"release {result.version} (number {result.number}): up to date ({result.fetched} request(s))")
