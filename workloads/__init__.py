"""gpumigrate.workloads — the reference workloads that demo, tests and benchmarks migrate.

``model`` (the byte-level transformer: ``build_model``, ``generate``, ``weights_digest``),
``inference`` (the HTTP server) with ``serving`` (``ServingState``, faults),
``training`` (``TrainingState``, ``run_steps``, ``train``) with ``lightning_job`` (Lightning parts),
``launch`` (start them on a local host, with gpumigrate's environment contract), ``contract``
(their flags over that contract), ``environment`` (facts for /v1/info). The migration agent comes
from the public SDK, ``gpumigrate.agent``, as in any user's program. See README.md. Library code
never imports this package.
"""
