"""The OpenAI-compatible HTTP API over an ``AsyncEngine`` (chapter 10).

    POST /v1/completions        text completions (streamed with "stream": true)
    POST /v1/chat/completions   chat, through the model's chat template
    GET  /v1/models             the one model served
    POST /tokenize, /detokenize vLLM's token helpers
    GET  /health                200 while serving; 503 when shutting down or the engine died
    GET  /metrics               Prometheus text (``metrics.py``)

``build_app(engine, config)`` returns the FastAPI application; ``server.py`` runs it with
uvicorn. Handlers run on the event loop and never block it: the engine steps on its own
thread and hands tokens over through asyncio queues (``AsyncEngine.stream``), and the
tokenizer runs on worker threads (``prompts.py``). With API keys configured, the
interactive docs (``/docs``, ``/openapi.json``) are off: they would describe the server to
anyone. Every error answer is counted in ``/metrics`` by its code.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.serve.admission import Admission
from nanovllm.serve.config import ServeConfig
from nanovllm.serve.errors import APIError, bad_request
from nanovllm.serve.metrics import CONTENT_TYPE, ServerMetrics
from nanovllm.serve.protocol import (
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    conversation,
    dump,
)
from nanovllm.serve.serving import OpenAIServing

logger = logging.getLogger("nanovllm.serve")


def build_app(engine: AsyncEngine, config: ServeConfig) -> FastAPI:
    """The application serving ``engine`` (which the caller starts and shuts down)."""
    core = engine.engine
    metrics = ServerMetrics(core, config.served_model_name)
    admission = Admission(config, core.config.max_num_seqs)
    serving = OpenAIServing(engine, config, admission, metrics)
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if config.api_keys else {}
    app = FastAPI(title="nanovllm", summary="An OpenAI-compatible server for nanovllm.", **docs)
    app.state.serving, app.state.metrics, app.state.config = serving, metrics, config
    _error_handlers(app, metrics)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        serving.authenticate(request)
        card = ModelCard(id=config.served_model_name, root=config.served_model_name,
                         max_model_len=serving.max_model_len)  # (never the model's path)
        return dump(ModelList(data=[card]))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        serving.authenticate(request)
        body: TokenizeRequest = await serving.parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Send either 'prompt' or 'messages'.", "prompt")
        if body.prompt is not None:
            tokens = await serving.prompts.encode(body.prompt, special=body.add_special_tokens)
        else:
            tokens = await serving.prompts.encode_chat(conversation(body.messages))
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        serving.authenticate(request)
        body: DetokenizeRequest = await serving.parse(request, DetokenizeRequest)
        vocab = core.model_config.vocab_size
        if serving.tokenizer is None:
            raise bad_request("This model has no tokenizer.")
        if not all(0 <= t < vocab for t in body.tokens):
            raise bad_request(f"Token ids must be in [0, {vocab}).", "tokens")
        return {"prompt": await serving.prompts.off_loop(
            lambda: serving.tokenizer.decode(body.tokens))}

    @app.get("/health")
    async def health() -> Response:
        if serving.draining or not engine.is_running:
            status = "draining" if serving.draining else "engine stopped"
            return JSONResponse({"status": status}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error leaves in OpenAI's shape, including FastAPI's own (404, 405, 422), and
    is counted."""

    def answer(err: APIError) -> Response:
        metrics.reject(err.reason)
        return err.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        return answer(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return answer(APIError(err.status_code, str(err.detail), code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> Response:
        return answer(bad_request(str(err.errors()[:1])))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> Response:
        logger.exception("unhandled error in %s", request.url.path)
        return answer(APIError(500, f"Internal error: {type(err).__name__}: {err}",
                               "internal_error"))
