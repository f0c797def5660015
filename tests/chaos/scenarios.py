"""The chaos suite's fault schedules (tests/chaos/test_chaos.py); `make chaos` runs seeded random
ones (`harness.chaos.random_scenario`). Every fault fires once every live worker has committed
its step."""

from __future__ import annotations

from harness.chaos import ChaosScenario, Fault

# Several ranks at once: two of one stage (DP ring neighbours' copies survive: ranks 4 and 6 of
# stage 1 = {4, 5, 6, 7}), then two of different stages.
SIMULTANEOUS = ChaosScenario(
    "simultaneous",
    pp=2,
    dp=4,
    global_batch=16,
    steps=10,
    faults=(Fault("kill", 2, (4, 6)), Fault("kill", 5, (1, 5))),
)
# A failure during a recovery (the second kill 50 ms after the first, while the survivors apply
# the first plan), then a collective that fails with every process alive.
CASCADING = ChaosScenario(
    "cascading",
    pp=2,
    dp=3,
    steps=10,
    faults=(Fault("kill", 2, (4, 1), gap_s=0.05), Fault("collective", 5, (0,))),
)
# The rendezvous store killed (the workers move to its standby and replay the step), then a
# whole node (workers and agents) holding all of stage 1, as torchrun's numbering places a
# PP=2 job on two nodes: stage 1's shards are backed up on node 0 (planners.backup), so its
# blocks move to stage 0 in place, from memory, with no step lost.
WHOLE_STAGE = ChaosScenario(
    "store-then-whole-stage",
    pp=2,
    dp=2,
    steps=10,
    checkpoint_every=2,
    nodes=((0, 1), (2, 3)),
    faults=(Fault("store", 1, ()), Fault("node", 4, (2, 3))),
)
# The leading Core of a two-Core control plane on etcd killed mid-training, then a worker: the new
# leader plans the recovery. The workers never need the Core between failures and train on
# through the takeover, so the run is long enough for the standby to lead again (a few seconds,
# more on a loaded machine); the kill fires as soon as the new leader sees every worker past
# step 10.
LEADER_CORE = ChaosScenario(
    "leader-core",
    pp=2,
    dp=2,
    steps=250,
    cores=2,
    faults=(Fault("core", 2, ()), Fault("kill", 10, (3,))),
)
SCENARIOS = (SIMULTANEOUS, CASCADING, WHOLE_STAGE, LEADER_CORE)
