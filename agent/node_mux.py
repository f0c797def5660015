"""A node multiplexer: the agents of one node connect to it as they would to the Core, and it
carries all their Connect streams to the leading Core over one ConnectNode stream.

    python -m agent.node_mux --core core-0:50051 --core core-1:50051 --listen 127.0.0.1:50061 \
        [--tls-ca ca.pem [--tls-cert node.pem --tls-key node.key]]

Agents on the node name the multiplexer as their only Core (``elaswave agent --core
127.0.0.1:50061``); nothing else about them changes. Each agent still registers with its own
job token and worker token (forwarded per channel, checked by the Core per channel), so the
multiplexer cannot widen what any worker may do; what it saves is the Core's per-message gRPC
work, since up to `linger` seconds of its agents' reports share one message (docs/control-plane.md,
"Fan-in"). An agent whose local stream breaks has its channel ended at once, which the Core
treats as that worker's stream closing without a Leave. When the stream to the Core fails, every
agent's stream fails with its status (a standby's leader hint included), the agents reconnect
with their own backoff, and the multiplexer opens its next stream to the hinted or next Core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import grpc.aio

from agent.backoff import AddressRotation, parse_leader_hint
from agent.config import Address, parse_address
from agent.core_link import WORKER_TOKEN_METADATA
from agent.node_link import DEFAULT_LINGER_S, ChannelEnded, NodeChannel, NodeLink
from wire import core_tls
from wire.v1 import agent_pb2_grpc

log = logging.getLogger("elaswave.agent.node_mux")


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name.lower() == key and isinstance(value, str):
            return value
    return None


class NodeMux(agent_pb2_grpc.AgentServiceServicer):
    def __init__(
        self,
        cores: Sequence[Address],
        linger_s: float = DEFAULT_LINGER_S,
        tls: core_tls.CoreTls | None = None,
    ) -> None:
        self.linger_s = linger_s
        self.tls = tls  # to the Core; its agents still connect to it on the node, in plaintext
        self._rotation = AddressRotation(tuple(cores))
        self._link: NodeLink | None = None
        self._channel: grpc.aio.Channel | None = None

    def link(self) -> NodeLink:
        """The stream to the Core, opened again (to the hinted or next Core) once it failed."""
        if self._link is not None and self._link.failed is None:
            return self._link
        if self._link is not None:
            failed = self._link.failed
            self._rotation.failed(parse_leader_hint(failed.details) if failed else None)
            asyncio.ensure_future(self._close(self._link, self._channel))
        address = str(self._rotation.current())
        if self.tls is None:
            self._channel = grpc.aio.insecure_channel(address)
        else:
            self._channel = grpc.aio.secure_channel(address, self.tls.grpc_credentials())
        self._link = NodeLink(self._channel, self.linger_s)
        return self._link

    @staticmethod
    async def _close(link: NodeLink, channel: grpc.aio.Channel | None) -> None:
        await link.close()
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        if self._link is not None:
            await self._close(self._link, self._channel)
            self._link = None

    async def Connect(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("body") != "register":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be register")
            return
        authorization = _metadata(context, "authorization") or ""
        job_token = authorization[len("Bearer ") :].strip() if authorization.startswith("Bearer ") else None
        channel = self.link().open(first.register, job_token, _metadata(context, WORKER_TOKEN_METADATA))
        forward = asyncio.ensure_future(self._forward(context, channel))
        try:
            while True:
                await context.write(await channel.read())
        except ChannelEnded as ended:
            if ended.code != grpc.StatusCode.OK:  # OK: the Core closed it after the agent's Leave
                await context.abort(ended.code, ended.details)
        finally:
            forward.cancel()
            channel.end()  # no-op when already over; else the agent went away without a Leave

    async def ConnectNode(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a node multiplexer does not serve ConnectNode")

    @staticmethod
    async def _forward(context: grpc.aio.ServicerContext, channel: NodeChannel) -> None:
        """The agent's reports, as they come, onto its channel; its stream's end ends the channel."""
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    channel.end()
                    return
                channel.write(msg)


async def serve(
    cores: Sequence[Address], listen: str, linger_s: float, tls: core_tls.CoreTls | None = None
) -> None:
    mux = NodeMux(cores, linger_s, tls)
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(mux, server)
    if server.add_insecure_port(listen) == 0:
        raise SystemExit(f"node_mux: cannot listen on {listen}")
    await server.start()
    log.info("node multiplexer on %s for cores %s", listen, ", ".join(map(str, cores)))
    try:
        await server.wait_for_termination()
    finally:
        await mux.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--core", action="append", required=True, help="a Core's host:port (repeatable)")
    parser.add_argument("--listen", default="127.0.0.1:50061", help="address the node's agents connect to")
    parser.add_argument(
        "--linger", type=float, default=DEFAULT_LINGER_S, help="seconds a report may wait to share a message"
    )
    parser.add_argument(
        "--tls-ca", type=Path, help=f"PEM CA bundle of the Core: TLS to it (default ${core_tls.CA_ENV})"
    )
    parser.add_argument(
        "--tls-cert", type=Path, help=f"PEM client certificate for mTLS (default ${core_tls.CERT_ENV})"
    )
    parser.add_argument("--tls-key", type=Path, help=f"PEM client key for mTLS (default ${core_tls.KEY_ENV})")
    args = parser.parse_args(argv)
    try:
        cores = [parse_address(text, "--core") for text in args.core]
        if args.tls_ca is None and args.tls_cert is None and args.tls_key is None:
            tls = core_tls.from_env()
        elif args.tls_ca is None:
            raise ValueError("--tls-cert/--tls-key need --tls-ca")
        else:
            tls = core_tls.CoreTls(args.tls_ca, args.tls_cert, args.tls_key).check()
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 <= args.linger <= 1:
        parser.error(f"--linger must be within 0..1 s, got {args.linger}")
    logging.basicConfig(level=logging.INFO)
    asyncio.run(serve(cores, args.listen, args.linger, tls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
