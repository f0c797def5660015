"""`elaswave run --core` over TLS: the flags and environment that name the Core's CA bundle and
this node's client certificate (wire.core_tls), resolved once when the flags are checked.

A node joined to a TLS Core speaks HTTPS to its REST API (the rendezvous, the job's progress,
the stop) and hands the same files to its agents and workers through the environment, so the
agents' streams and the workers' plan subscriptions are TLS too (with the client certificate
where the Core requires one). Without `--core` the launcher's own Core listens on loopback in
plaintext, and these flags are refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from wire import core_tls


def add_core_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """--core-tls-*: how this node reaches a Core that serves TLS (wire.core_tls); its agents and
    workers get the same files through the environment."""
    parser.add_argument(
        "--core-tls-ca",
        type=Path,
        metavar="PEM",
        help=f"with --core: the CA bundle of the Core's certificate; speak TLS (HTTPS, gRPC) to it "
        f"(default ${core_tls.CA_ENV}; without one: plaintext)",
    )
    parser.add_argument(
        "--core-tls-cert",
        type=Path,
        metavar="PEM",
        help=f"with --core: client certificate for a Core that requires one (mTLS; default ${core_tls.CERT_ENV})",
    )
    parser.add_argument(
        "--core-tls-key",
        type=Path,
        metavar="PEM",
        help=f"with --core: the client certificate's private key (default ${core_tls.KEY_ENV})",
    )


def core_tls_of(args: argparse.Namespace) -> core_tls.CoreTls | None:
    """The TLS files of the flags, else of the environment; None: plaintext (or no --core: the
    launcher's own embedded Core speaks plaintext on loopback). ValueError says what is wrong."""
    flags = (args.core_tls_ca, args.core_tls_cert, args.core_tls_key)
    if args.core is None:
        if any(f is not None for f in flags):
            raise ValueError(
                "--core-tls-ca/--core-tls-cert/--core-tls-key reach a remote Core: they need --core"
            )
        return None
    if all(f is None for f in flags):
        return core_tls.from_env()
    if args.core_tls_ca is None:
        raise ValueError("--core-tls-cert/--core-tls-key need --core-tls-ca (the CA bundle of the Core)")
    return core_tls.CoreTls(*flags).check()
