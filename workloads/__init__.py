"""gpumigrate.workloads — the reference workloads that demo, tests and benchmarks migrate.

``model`` (the byte-level transformer: ``build_model``, ``generate``, ``weights_digest``),
``inference`` (the HTTP server) with ``serving`` (``ServingState``, ``SafePoint``, faults),
``training`` (``TrainingState``, ``run_steps``, ``train``) with ``lightning_job`` (Lightning parts),
``environment`` (facts for /v1/info), ``agent_hook`` (the
snapshot agent, written by the snapshot work). See README.md. Library code never imports this package.
"""
