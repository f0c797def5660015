"""ElasWave: elastic-native hybrid-parallel LLM training.

This package holds the command line (`elaswave ...`) and the generated gRPC stubs
(`elaswave.v1`). The parts live in sibling packages: `core_service`, `agent`, `executor`,
`planners`.
"""

__version__ = "0.1.0"
