"""Recovery policies and their estimators: Chameleon's eq. (8) choice among ElasWave,
re-parallelisation, rerouting (ReCycle) and replica dropping (TorchFT), with the step-time
(eq. 9-13) and memory (eq. 14) estimators, Kuhn-Munkres weight-transfer matching, coloured
all-reduce rounds and a cache of precomputed plans. Pure functions over frozen dataclasses."""
