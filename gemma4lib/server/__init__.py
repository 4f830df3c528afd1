"""An OpenAI-compatible endpoint over the engine: continuous batching, metrics, Ray Serve replicas.

`schemas` (the OpenAI bodies), `errors` (what a client did wrong, and its status), `text` (streamed
text, stop strings), `scheduler` (the one thread that owns the engine), `metrics`, `app` (the routes),
`launch` (uvicorn + SIGTERM drain), `ray_app` and `ray_proxy` (Ray Serve). Driving an endpoint (a
child process, load, lm-eval) is `gemma4lab.serving`.
"""
