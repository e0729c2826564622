"""An OpenAI-compatible server over the async engine (chapter 10).

    nanovllm serve ~/.cache/nanovllm/SmolLM2-135M-Instruct --port 8000
    python -m nanovllm.serve MODEL --config deployment.yaml

One concept per module:

- ``config.py``     a deployment's YAML file, checked field by field
- ``cli.py``        the command line
- ``server.py``     uvicorn, graceful shutdown on SIGTERM, a server on a background thread
- ``app.py``        the routes (``build_app``)
- ``serving.py``    a request's path: key, body, prompt, admission, engine, answer
- ``body.py``       a request's body: JSON only, size capped before reading
- ``caps.py``       caps on a request's fields, checked before tokenizing
- ``prompts.py``    prompts to token ids on worker threads, off the event loop
- ``connections.py`` a deadline for a connection's request headers
- ``protocol.py``   OpenAI's request and response bodies (pydantic)
- ``response_format.py`` a request's output constraint: JSON schema, regex, ...
- ``formats.py``    engine outputs -> OpenAI's objects
- ``streaming.py``  server-sent events
- ``admission.py``  API keys, per-key token buckets, queue depth
- ``metrics.py``    Prometheus metrics
- ``errors.py``     errors in OpenAI's shape

In code (a notebook, a test): ``ServerThread(build_app(AsyncEngine(...), config))``.
"""

from nanovllm.serve.app import build_app
from nanovllm.serve.config import ConfigError, ServeConfig, load_config
from nanovllm.serve.server import ServerThread, serve

__all__ = ["ConfigError", "ServeConfig", "ServerThread", "build_app", "load_config", "serve"]
