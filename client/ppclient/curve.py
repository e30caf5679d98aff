"""Admitting CURVE peers by their public key: the server's sockets and a client's result socket
accept only the keys authorised in a keys directory (`keyfiles.authorized_keys`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import zmq


def authenticator(
    ctx: zmq.Context, authorized: Iterable[bytes], refused: Callable[[str], None], log: Optional[logging.Logger] = None
) -> Any:
    """A started ZAP authenticator for the CURVE server sockets of `ctx` that admits only the
    `authorized` public keys (z85); each refusal is passed to `refused` in words. Stop it when
    the sockets are closed."""
    from zmq.auth.thread import ThreadAuthenticator

    keys = frozenset(authorized)

    class AuthorizedKeys:
        def callback(self, domain: str, client_key: bytes) -> bool:
            if client_key in keys:
                return True
            refused(f"CURVE key {client_key.decode(errors='replace')[:16]}... is not authorised")
            return False

    auth = ThreadAuthenticator(ctx, log=log)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=AuthorizedKeys())
    return auth
