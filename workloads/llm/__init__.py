"""The reference LLM server: a seeded Llama model, continuous batching over a KV cache, OpenAI-compatible HTTP.

``python -m gpumigrate.workloads.llm``. Modules: ``model`` (the model and the byte tokenizer),
``kvcache`` (the cache and its written regions), ``forward`` (the passes over the cache),
``requests`` (one request's state), ``engine`` (the loop, its step boundary, export/import),
``streams`` (published text and its followers), ``openai_api`` (the HTTP contract), ``handover``
(continuation endpoint and relay), ``migration`` (the SDK's in-flight hooks), ``server`` and ``main``.
Design and formats: DESIGN.md beside this file.
"""
