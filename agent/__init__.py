"""ElasWave agent: a daemon beside each training worker (docs/architecture.md ("Processes", "The Core's decisions", "Promises and rules"); ElasWave §3.2).

Run it with ``elaswave agent`` (``agent.cli``). What other parts use:

- ``agent.local_metrics.StepMetricsClient`` — the executor's per-step report to its agent;
- ``agent.daemon.Agent`` / ``agent.config.AgentConfig`` — the daemon itself, for embedding;
- ``agent.worker.EXIT_CODE_UNKNOWN`` — WorkerExit.exit_code when a foreign pid's status is lost.

Modules are imported on use, so importing the metrics client does not pull in grpc or etcd.
"""
