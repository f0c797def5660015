"""An agent's side of the zygote for tests/agent/test_zygote.py: start one worker, report.

    python zygote_client.py SOCKET [--signal-after S SIGNUM] -- COMMAND...

Prints `PID <pid>` (or `COLD` when the zygote declined) then `RESULT <exit code>`."""

import asyncio
import os
import signal
import sys
from pathlib import Path

from agent.worker import ForkedWorker


async def main() -> None:
    args = sys.argv[1:]
    zygote, rest = Path(args[0]), args[1:]
    signal_after = None
    if rest[0] == "--signal-after":
        signal_after, rest = (float(rest[1]), int(rest[2])), rest[3:]
    command = rest[1:]  # after "--"
    worker = await ForkedWorker.start(zygote, command, dict(os.environ))
    if worker is None:
        print("COLD", flush=True)
        return
    print(f"PID {worker.pid}", flush=True)
    if signal_after is not None:
        await asyncio.sleep(signal_after[0])
        worker.send_signal(signal.Signals(signal_after[1]))
    status = await worker.wait()
    print(f"RESULT {status.exit_code}", flush=True)


asyncio.run(main())
