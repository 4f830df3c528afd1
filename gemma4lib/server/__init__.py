"""An OpenAI-compatible endpoint over the engine: continuous batching, metrics, Ray Serve replicas.

Modules, one idea each: `schemas` (the OpenAI request and response bodies), `errors` (what a client
did wrong, and its HTTP status), `text` (tokens to streamed text, stop strings), `scheduler` (the one
thread that owns the engine), `metrics` (Prometheus), `app` (the FastAPI routes), `launch` (engine +
uvicorn + SIGTERM drain), `ray_app` (the same app as a Ray Serve deployment, on the loopback),
`ray_proxy` (what Serve's proxy answers for a replica that died: 503 in OpenAI's shape). Driving an
endpoint (a child process, load, lm-eval) is `gemma4lab.serving`.
"""
