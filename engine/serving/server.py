"""An OpenAI-compatible HTTP server for one loaded pair (FastAPI + uvicorn).

One generation runs at a time on a single engine thread; requests wait in a bounded queue and get
503 with Retry-After when it is full. Bodies are validated at the edge: every 4xx carries an
OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` naming the field, rule and value.
Streamed and plain answers come from the same code path (``TextStream``), so at temperature 0 they
are identical. `autotune serve CONFIG.yaml` calls ``serve``; the engine never imports autotune.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from engine.config import EngineConfig, EngineInputError
from engine.decoding.decode import generate
from engine.decoding.prefix_cache import DEFAULT_PREFIX_CACHE_MB, PrefixCache
from engine.files import preview
from engine.serving.metrics import Metrics, Outcome
from engine.serving.openai_schema import (
    ApiError,
    ChatBody,
    CompletionBody,
    Job,
    RequestBody,
    chat_ids,
    completion_ids,
    json_body,
    make_job,
    parse_body,
)
from engine.serving.text import TextStream

DEFAULT_MAX_QUEUE = 32  # waiting requests beyond the one running
log = logging.getLogger("engine.serving")
ENDPOINTS = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/metrics")  # metric labels


# --- the engine thread ----------------------------------------------------------------------------


class _Stop(Exception):
    """Raised inside the decode loop's token hook to end a generation early; ``committed``: the ids
    the hook was given so far (the prefix cache keeps their positions: ``engine.generate``)."""

    def __init__(self, committed: list[int]) -> None:
        super().__init__()
        self.committed = list(committed)


class Runner:
    """The single engine thread and its bounded queue (admission counts waiting + running), and the
    pair's prefix cache (None: off), which only the engine thread touches."""

    def __init__(self, pair: Any, max_queue: int, prefix_cache: PrefixCache | None = None) -> None:
        self.pair = pair
        self.max_queue = max_queue
        self.prefix_cache = prefix_cache
        self.metrics = Metrics()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._lock = threading.Lock()
        self._admitted = 0
        self._running = 0
        self.closing = threading.Event()
        self.served = 0

    def depth(self) -> tuple[int, int]:
        with self._lock:
            return self._admitted - self._running, self._running

    def admit(self) -> None:
        with self._lock:
            if self.closing.is_set() or self._admitted >= self.max_queue + 1:
                raise ApiError(503, f"the server is busy: {self._admitted - self._running} requests are waiting "
                               f"(queue capacity {self.max_queue}); retry later", code="queue_full",
                               headers={"Retry-After": "1"})
            self._admitted += 1

    def release(self) -> None:
        """For an admitted request that never reached the engine (it failed validation first)."""
        with self._lock:
            self._admitted -= 1

    async def run(self, job: Job, sink: Callable[[str], None] | None = None,
                  cancelled: threading.Event | None = None) -> Outcome:
        try:
            future = self._executor.submit(self._generate, job, sink, cancelled)
        except RuntimeError:  # the executor was shut down: the server is stopping
            self.release()
            raise ApiError(503, "the server is shutting down", code="shutting_down") from None
        return await asyncio.wrap_future(future)

    def _generate(self, job: Job, sink: Callable[[str], None] | None, cancelled: threading.Event | None) -> Outcome:
        with self._lock:
            if self.closing.is_set():  # queued when the server began to stop
                self._admitted -= 1
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            self._running = 1
        pair = self.pair
        stream = TextStream(pair.tokenizer.decode, pair.stop_ids, job.stops)

        emitted: list[int] = []

        def on_tokens(ids: list[int]) -> None:
            emitted.extend(ids)  # committed by the engine before it calls the hook
            if self.closing.is_set() or (cancelled is not None and cancelled.is_set()):
                raise _Stop(emitted)
            delta = stream.push(ids)
            if delta and sink is not None:
                sink(delta)
            if stream.stopped_by == "string":
                raise _Stop(emitted)

        stats = None
        cache = self.prefix_cache
        try:
            stats = generate(pair, job.ids, job.cfg, job.max_tokens, on_tokens=on_tokens, prefix_cache=cache).stats
        except _Stop:
            pass
        finally:
            with self._lock:
                self._running = 0
                self._admitted -= 1
        tail = stream.finish()
        if tail and sink is not None:
            sink(tail)
        reason = "stop" if stream.stopped_by else "length"
        # (a generation cut short by _Stop has no stats; it stopped after its prefill, the cache's last)
        cached = stats.cached_tokens if stats is not None else cache.last_hit if cache is not None else 0
        outcome = Outcome(stream.text, reason, len(job.ids), stream.n_tokens, cached)
        self.metrics.record(outcome, stats)
        self.served += 1
        return outcome

    def close(self) -> None:
        self.closing.set()
        self._executor.shutdown(wait=True, cancel_futures=True)


# --- the app --------------------------------------------------------------------------------------


def _usage(o: Outcome) -> dict[str, Any]:
    """OpenAI's usage object: ``prompt_tokens_details.cached_tokens`` the prompt tokens the prefix cache gave."""
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": o.cached_tokens}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(pair: Any, cfg: EngineConfig, model_name: str, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB) -> FastAPI:
    """The FastAPI app serving ``pair`` with ``cfg``; requests may override temperature and seed.
    ``prefix_cache_mb``: the prefix cache's budget in MiB (``engine.decoding.prefix_cache``; 0: off)."""
    if pair.tokenizer is None:
        raise EngineInputError(f"target {pair.target_name!r} has no tokenizer: the server needs one to read text")
    if max_queue < 0:
        raise EngineInputError(f"max_queue must be >= 0, but got {max_queue}")
    if not 0 <= prefix_cache_mb < float("inf"):  # (NaN too)
        raise EngineInputError(f"prefix_cache_mb must be a finite number >= 0 (0: no prefix cache), but got "
                               f"{prefix_cache_mb}")
    # refused now, not at each request: a request with tools brings a grammar wherever cfg places one
    reason = pair.refusal(cfg, constrained=cfg.grammar != "off")
    if reason is not None:
        raise EngineInputError(f"the engine cannot serve draft_path='runtime' with verify={cfg.verify!r} on this "
                               f"pair: {reason}; draft_path='generic' or 'auto' can")
    runner = Runner(pair, max_queue, PrefixCache(int(prefix_cache_mb * 2**20)) if prefix_cache_mb > 0 else None)
    replies = _Replies(pair, cfg, runner, model_name)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.get_running_loop().run_in_executor(None, runner.close)

    app = FastAPI(title="autotune engine server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runner = runner

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next: Callable) -> Response:
        if api_key is not None and not _authorized(request.headers.get("authorization"), api_key):
            response: Response = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}).response()
        else:
            try:
                response = await call_next(request)
            except Exception as exc:  # a bug, not the client's body: still answered in JSON and counted
                log.exception("unhandled error on %s %s", request.method, request.url.path)
                response = ApiError(500, f"internal server error ({type(exc).__name__}); the server keeps running",
                                    code="internal_error").response()
        path = request.url.path
        runner.metrics.count_request(path if path in ENDPOINTS else "other", response.status_code)
        return response

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "autotune"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        waiting, running = runner.depth()
        cache = runner.prefix_cache
        return PlainTextResponse(runner.metrics.render(waiting, running, runner.max_queue,
                                                       cache.stats() if cache is not None else None),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse_body(await json_body(request), ChatBody)
        return await replies.respond(body, chat_ids(pair, body), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(await json_body(request), CompletionBody)
        return await replies.respond(body, completion_ids(pair, body), chat=False)

    return app


@dataclass
class _Replies:
    """A completion request's reply, whole (JSON) or streamed (server-sent events), for both
    endpoints: ``chat`` picks the chat or the text-completion shape."""

    pair: Any
    cfg: EngineConfig
    runner: Runner
    model_name: str

    async def respond(self, body: RequestBody, ids: list[int], chat: bool) -> Response:
        if body.model is not None and body.model != self.model_name:  # as OpenAI's API answers
            raise ApiError(404, f"the model {preview(body.model)} does not exist: this server serves "
                                f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")
        job = make_job(self.pair, self.cfg, body, ids)
        self.runner.admit()  # after validation: a bad request never takes a place in the queue
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if not body.stream:
            o = await self.runner.run(job)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": o.text},
                          "finish_reason": o.finish_reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": o.text, "finish_reason": o.finish_reason, "logprobs": None}
            return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                                 "choices": [choice], "usage": _usage(o)})
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(self.stream(job, head, chat, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @staticmethod
    def chunk_object(chat: bool) -> str:
        return "chat.completion.chunk" if chat else "text_completion"

    @classmethod
    def chunk(cls, head: dict[str, Any], chat: bool, delta: str | None, finish: str | None = None) -> dict[str, Any]:
        """One streamed chunk: a piece of text (``delta``), or the end with its ``finish`` reason."""
        if chat:
            d = {} if delta is None else {"content": delta}
            c = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            c = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return {**head, "object": cls.chunk_object(chat), "choices": [c]}

    async def stream(self, job: Job, head: dict[str, Any], chat: bool, include_usage: bool) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        cancelled = threading.Event()
        task = asyncio.ensure_future(self.runner.run(job, lambda d: loop.call_soon_threadsafe(queue.put_nowait, d),
                                                     cancelled))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            if chat:
                first = self.chunk(head, chat, "")
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _sse(first)
            while (delta := await queue.get()) is not None:
                yield _sse(self.chunk(head, chat, delta))
            try:
                o = await task
            except ApiError as exc:  # the headers are gone: report it in the stream
                yield _sse({"error": {"message": exc.message, "type": "server_error", "code": exc.code}})
                return
            yield _sse(self.chunk(head, chat, None, o.finish_reason))
            if include_usage:
                yield _sse({**head, "object": self.chunk_object(chat), "choices": [], "usage": _usage(o)})
            yield "data: [DONE]\n\n"
        finally:
            cancelled.set()  # the client went away: the engine stops at its next step


def _authorized(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


# --- running it -----------------------------------------------------------------------------------


def load_served(config_path: str) -> tuple[EngineConfig, dict[str, Any]]:
    """The EngineConfig and model section of an exported config (or a flat one with a model key)."""
    from engine.cli import read_config_file

    fields, model = read_config_file(config_path)
    cfg = EngineConfig.from_dict(fields, source=config_path)
    if not model.get("target"):
        raise EngineInputError(f"config file {config_path!r}: the server needs a 'model' section with a 'target' "
                               f"(as `autotune export --format engine` writes)")
    if not model.get("draft") and cfg.verify != "ar":
        raise EngineInputError(f"config file {config_path!r}: model.draft is needed for verify={cfg.verify!r}")
    return cfg, model


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this; without it a keep-alive client waits ~40 ms per response
    # (Nagle holding the body back for the ACK of the headers, which the client delays).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections made before uvicorn starts accepting wait in the backlog
    except OSError as exc:
        sock.close()
        raise EngineInputError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock


WARM_UP_TEXT = "Hello"


def warm_up(pair: Any, cfg: EngineConfig) -> dict[int, float] | None:
    """Before the first request: the adaptive step policy's cost table (``Pair.step_costs``: a few
    short generations per budget) measured now, kept on the pair for every request, so that no
    request waits for it; None for a config without the policy. Returns ms per step by budget."""
    if cfg.verify != "ddtree" or cfg.policy != "adaptive":
        return None
    return dict(pair.step_costs(cfg, pair.encode(WARM_UP_TEXT)).ms)


def serve(config_path: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = DEFAULT_MAX_QUEUE, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB) -> int:
    """Load the config's pair and serve it until Ctrl-C; returns the exit status 0.

    ``port`` 0 picks a free port; the address actually bound is printed on the ``serving:`` line.
    ``prefix_cache_mb``: the prefix cache's budget on the device in MiB (0: off; docs/serving.md).
    """
    if not 0 <= prefix_cache_mb < float("inf"):  # (NaN too)
        raise EngineInputError(f"prefix_cache_mb must be a finite number >= 0 (0: no prefix cache), but got "
                               f"{prefix_cache_mb}")
    import uvicorn

    from engine.api import load

    cfg, model = load_served(config_path)
    sock = _bind(host, port)  # before the model loads: a taken port fails in a second
    try:
        target, draft = str(model["target"]), str(model.get("draft") or "none")
        pair = load(target, draft, device=str(model.get("device", "auto")), dtype=str(model.get("dtype", "auto")),
                    # a native study's export serves native; a config that names its weights, those
                    weights=str(cfg.weights or model.get("weights", "dequantized")))
        name = str(model.get("name") or Path(target).name)
        app = create_app(pair, cfg, name, api_key=api_key, max_queue=max_queue, prefix_cache_mb=prefix_cache_mb)
        costs = warm_up(pair, cfg)
    except BaseException:
        sock.close()
        raise
    bound_host, bound_port = sock.getsockname()[:2]
    bound_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    runner: Runner = app.state.runner

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            runner.closing.set()  # running generations end at their next step, queued ones get 503
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    print(f"serving: http://{bound_host}:{bound_port}/v1", flush=True)
    print(f"model: {name}\nconfig: {config_path}\nverify: {cfg.verify}\ndevice: {pair.device}\n"
          f"weights: {pair.weights}\napi_key: {'required' if api_key else 'none'}\nqueue_capacity: {max_queue}\n"
          f"prefix_cache_mb: {prefix_cache_mb:g}", flush=True)
    if costs is not None:  # the adaptive policy's table, measured before the first request
        print("step_costs_ms: " + " ".join(f"{b}:{ms:.3g}" for b, ms in sorted(costs.items())), flush=True)
    if not api_key and not _loopback(host):
        print(f"warning: listening on {host} without an API key: anyone who can reach this machine can use it",
              file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down gracefully on Ctrl-C, then re-raises it
        pass
    finally:
        sock.close()
    m, pc = runner.metrics, runner.prefix_cache
    print(f"stopped: served {runner.served} generations\nprompt_tokens: {m.prompt_tokens}\n"
          f"completion_tokens: {m.completion_tokens}\n"
          f"acceptance_length: {m.step_tokens / m.steps if m.steps else 0.0:.4g}\n"
          f"prompt_tokens_cached: {pc.cached_tokens if pc is not None else 0}", flush=True)
    return 0
