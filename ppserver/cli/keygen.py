"""`ppserver keygen`: the CURVE key pairs of a server and its clients and workers."""

from __future__ import annotations

import argparse

from ppserver.cli.output import fail_config


def run(args: argparse.Namespace) -> int:
    from ppclient import UsageError
    from ppclient.keyfiles import keygen

    try:
        server, client = keygen(args.dir, force=args.force)
    except UsageError as exc:
        return fail_config("keygen", exc)
    print(f"wrote {server} (+ secret) and {client} (+ secret); authorised {client}")
    return 0
