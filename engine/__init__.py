"""The bundled ATOM-compatible engine worker: paged KV cache, continuous batching, prefix caching.

Run it with ``python -m engine.openai_server``. It never imports ``atomesh``: the gateway and the
engine meet over HTTP only.
"""
