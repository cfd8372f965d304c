"""``outrate keys add USER --keys-file FILE``: a new API key for ``--identity api-key`` (R30).

The key is printed once, as the only line on standard output, and only its SHA-256 hash is
stored in FILE (``reference/keysfile.py``: created if missing, mode 0600, replaced
atomically, so a running server reloads it within a second). Nothing else knows the key:
hand it to the user now. Revoke a key by removing its hash from the file.
"""

from __future__ import annotations

import click

from vllm_output_rate.reference.keysfile import add_key
from vllm_output_rate.reference.section import OutputRateConfigError


@click.group("keys")
def keys() -> None:
    """API keys of `outrate serve --identity api-key` (the keys file holds hashes only)."""


@keys.command("add")
@click.argument("user")
@click.option(
    "--keys-file",
    "keys_file",
    required=True,
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="The keys file of `outrate serve --keys-file` (created if missing).",
)
def add(user: str, keys_file: str) -> None:
    """Create a key for USER: print it once (the only output line) and store its hash in FILE."""
    try:
        key = add_key(keys_file, user)
    except OutputRateConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except OSError as exc:
        raise click.UsageError(f"keys file {keys_file}: cannot be written ({exc.strerror})") from None
    click.echo(key)
