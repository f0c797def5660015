"""A Core-like process that wins an election and then just holds it: the test SIGKILLs it.

Usage: python -m tests.registry.leader_process <registry-url> <key> <candidate-id> <ttl-s>
Prints "LEADER" once it leads, or "LOST" and exits 1 if it could not win within 10 s.
"""

from __future__ import annotations

import sys
import time

from core_service.registry import LeaderElection, open_registry


def main(argv: list[str]) -> int:
    url, key, candidate, ttl = argv[0], argv[1], argv[2], float(argv[3])
    registry = open_registry(url)
    election = LeaderElection(registry, key, candidate, ttl)
    if not election.campaign(timeout_s=10):
        print("LOST", flush=True)
        return 1
    print("LEADER", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
