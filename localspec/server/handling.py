"""What every route shares, OpenAI's and llama-server's alike: the server's state (`ServerState`, the loaded
`Backend`), `guarded` (a route's bug answered as errors.py's 500), and the one path of a generation request: its
prompt built off the event loop (`build_prompt`), its jobs queued on the worker (`run_request`), their output
streamed as SSE or collected into one JSON body in a reply's shape (`Reply`: OpenAI's; llama_routes.NativeReply:
llama-server's). Errors are errors.py's `ApiError`.
A client that leaves cancels its jobs, whether it was streaming or waiting for JSON.

Routes live in app.py (OpenAI's) and llama_routes.py (llama-server's); both import from here, never from each
other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from localspec import __version__, drafters
from localspec.config import Preset, key_metadata
from localspec.errors import ConfigError, LocalspecError, TooManyTokens, UsageError
from localspec.llama.model import LlamaModel
from localspec.llama.vision import data_uri_bytes, decode_picture
from localspec.rounds.engine import Engine
from localspec.rounds.events import GenerationStats
from localspec.server.errors import ApiError, client_gone, context_exceeded, internal, shutting_down
from localspec.server.fim import fim_prompt
from localspec.server.guard import MIN_BODY_BYTES, PROBE_BYTES_KEY, GuardSettings, PromptLimits, picture_room
from localspec.server.schema import (
    FIELD_OF_KEY,
    MAX_TOKENS_LIMIT,
    ChatRequest,
    CompletionRequest,
    MultimodalPrompt,
    speculative_name,
)
from localspec.server.structured import (
    TokenLogprob,
    chat_logprobs,
    chat_shape,
    completion_logprobs,
    completion_shape,
    request_constraint,
)
from localspec.server.tools import ToolRequest, ToolScanner, split_reply
from localspec.server.worker import (
    FINISH_CANCELLED,
    Delta,
    Failed,
    Finished,
    Item,
    Job,
    JobResult,
    Worker,
    timings,
)
from localspec.sessions.chat import BuildCancelled, ChatTemplate

MAX_BODY_BYTES = 64 << 20  # far above any prompt a context can hold, far below trouble
SHUTDOWN_GRACE_S = 5.0  # a cancelled job stops at the engine's next check: well within this


@dataclass
class Backend:
    """A loaded pair, ready to serve: the worker owns the engine; the target's tokenizer makes prompts."""

    worker: Worker
    model: LlamaModel
    preset: Preset
    template: ChatTemplate | None
    template_error: str | None  # why chat is unavailable (no template), told to each chat request
    n_ctx: int
    limits: PromptLimits
    model_id: str | None = None  # the pair's name where several are served (replies name it)

    @classmethod
    def build(cls, engine: Engine, model: LlamaModel, preset: Preset, queue: int) -> Backend:
        try:
            template, problem = ChatTemplate.for_model(model), None
        except LocalspecError as exc:
            template, problem = None, str(exc)
        # Every slot count draws plain decoding's tokens on the host, from the request's seed: the same seed, the
        # same text, whatever --parallel is (llama.cpp's device draws exist for one slot only).
        engine.draw_on_device = False
        worker = Worker(engine, queue)
        worker.start()
        return cls(worker=worker, model=model, preset=preset, template=template, template_error=problem,
                   n_ctx=engine.n_ctx, limits=PromptLimits(engine.n_ctx, model.max_piece_bytes,
                                                           picture_room(preset.images, model)))


class Pairs(Protocol):
    """Several pairs behind one endpoint (server/router.py's PairRouter)."""

    async def acquire(self, name: str | None, scope: MutableMapping[str, Any],
                      receive: Callable[[], Awaitable[Any]] | None = None) -> Backend: ...

    def listing(self, created: int) -> list[dict[str, Any]]: ...

    def health(self) -> dict[str, Any]: ...

    def body_limit(self) -> int: ...


@dataclass
class ServerState:
    """What the routes read: fixed settings, and the backend once loaded."""

    model_id: str
    aliases: tuple[str, ...] = ()  # other names requests may give as `model` (--model-alias)
    api_key: str | None = None
    max_tokens: int | None = None  # the server's cap per reply (None: until the end of the turn/context)
    seed: int | None = None  # for requests that give none (None: a random one each)
    control_tokens: bool = False  # chat content may carry control tokens (off: tokenized as text)
    guard: GuardSettings = field(default_factory=GuardSettings)
    metrics: bool = False  # serve /metrics (llama-server's --metrics)
    slot_save_path: Path | None = None  # where POST /slots/{id}?action=save|restore keeps files (None: refused)
    slots: bool = True  # serve /slots (llama-server's --slots / --no-slots)
    strict_model: bool = False  # a request's `model` must be one of `served` (else any name means the one model)
    backend: Backend | None = None
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    router: Pairs | None = None  # several pairs: each request's `model` picks one (backend stays None)

    def attach(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def served(self) -> tuple[str, ...]:
        return (self.model_id, *self.aliases)

    def check_model(self, name: str | None) -> None:
        """One model is served, so any name means it, as llama-server answers (OpenAI-SDK apps send their own,
        "gpt-3.5-turbo"). With `strict_model` a name that is not served gets OpenAI's 404 instead, so a front-end
        pointed at the wrong server is told."""
        if name is None or name in self.served or not self.strict_model:
            return
        raise ApiError(404, f"model {name!r} is not served here; this server serves "
                            f"{', '.join(repr(n) for n in self.served)} (a front-end that insists on its own name: "
                            f"localspec serve --model-alias {name})", param="model", code="model_not_found")

    async def pick(self, name: str | None, request: Request) -> Backend:
        """The backend a request's `model` names: the one pair (`check_model`), or with several the router's,
        loaded if need be and held until the response has been sent. The route has read its body: with several
        pairs the wait for one watches `request.receive` for the client leaving."""
        if self.router is not None:
            return await self.router.acquire(name, request.scope, request.receive)
        self.check_model(name)
        return self.ready()

    def ready(self) -> Backend:
        if self.backend is None:
            reason = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise ApiError(503, reason, kind="server_error", code="model_loading", headers={"Retry-After": "1"})
        return self.backend

    def body_limit(self) -> int:
        if self.router is not None:
            return self.router.body_limit()
        return self.backend.limits.body_bytes if self.backend is not None else MIN_BODY_BYTES



# -- request handling ----------------------------------------------------------------------------------------


async def completion_prompt(backend: Backend, req: CompletionRequest, request: Request) -> list[int]:
    """A completion request's prompt tokens (its `prompt`, with `suffix` fill-in-the-middle), text bounded before
    it is tokenized."""
    source = req.prompt
    if isinstance(source, MultimodalPrompt):
        return await picture_prompt(backend, source, request, req.suffix)
    if isinstance(source, str):
        backend.limits.check_text(source, "prompt")
    if req.suffix:
        backend.limits.check_text(req.suffix, "suffix")

    def build(cancelled: Callable[[], bool]) -> list[int]:
        return completion_tokens(backend.model, source, suffix=req.suffix, limit=backend.n_ctx)

    return await build_prompt(backend, build, request)


def check_pictures_sent(backend: Backend, n: int, param: str, first: str) -> None:
    """A request's pictures: no more than `[images] max_images`, and a projector to read them (`first`: the first
    picture's name); each a 400 naming `param`."""
    most = backend.preset.images.max_images
    if n > most:
        raise ApiError(400, f"{param}: {n} pictures; a request may carry {most} ([images] max_images)", param=param,
                       code="invalid_value")
    if n and getattr(backend.model, "projector", None) is None:
        raise ApiError(400, f"{first}: this model reads no pictures (the server was started without --mmproj)",
                       param=param, code="invalid_value")


async def picture_prompt(backend: Backend, source: MultimodalPrompt, request: Request,
                         suffix: str | None) -> list[int]:
    """llama-server's {prompt_string, multimodal_data}: the text with a picture where each marker is, through the
    target's projector; a bad picture, too many, or a model without a projector is a 400 naming it."""
    if suffix:
        raise ApiError(400, "suffix: fill-in-the-middle takes no pictures", param="suffix", code="invalid_value")
    check_pictures_sent(backend, len(source.multimodal_data), "prompt.multimodal_data", "prompt.multimodal_data")
    images = backend.preset.images
    backend.limits.check_text(source.prompt_string, "prompt.prompt_string")

    def build(cancelled: Callable[[], bool]) -> list[int]:
        pictures = [decode_picture(data_uri_bytes(";base64," + data, name), name, images)
                    for name, data in ((f"prompt.multimodal_data[{i}]", d)
                                       for i, d in enumerate(source.multimodal_data))]
        tokens = backend.model.projector.tokenize(source.prompt_string, pictures, add_special=True,
                                                  parse_special=True)
        if len(tokens) > backend.n_ctx:
            raise TooManyTokens(f"the prompt has {len(tokens)} tokens", len(tokens))
        return tokens

    return await build_prompt(backend, build, request)


def completion_tokens(model: LlamaModel, source: str | list[int], param: str = "prompt",
                      suffix: str | None = None, limit: int | None = None) -> list[int]:
    """A completion prompt's tokens: its ids (checked), or its text with BOS. With `suffix` (fill-in-the-middle on
    /v1/completions, as llama-cpp-python and Ollama have it) the prompt is the code before the gap. `limit`: raise
    TooManyTokens past that many (see LlamaModel.tokenize)."""
    if suffix:
        if not isinstance(source, str):
            raise ApiError(400, "suffix: fill-in-the-middle needs a text prompt (the code before the gap)",
                           param="suffix", code="invalid_value")
        return fim_prompt(model, source, suffix, param="suffix")
    if isinstance(source, list):
        n_vocab = model.n_vocab
        bad = next((t for t in source if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary (0..{n_vocab - 1})",
                           param=param, code="invalid_value")
        return list(source)
    # Special tokens in the text are parsed, as llama.cpp's server does: front-ends that apply a chat
    # template themselves (SillyTavern's text completion) send `<start_of_turn>` and expect a token.
    return model.tokenize(source, add_special=True, parse_special=True, limit=limit)


def guarded(handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
    """An unexpected exception becomes a logged line and an OpenAI-shaped 500 here, inside the route: past it,
    Starlette would re-raise it to uvicorn, which prints a traceback."""

    @functools.wraps(handler)
    async def run(request: Request) -> Any:
        try:
            return await handler(request)
        except ApiError:
            raise
        except Exception as exc:
            raise internal(request.url.path, exc) from None

    return run


async def read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", code="too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def build_prompt(backend: Backend, build: Callable[[Callable[[], bool]], list[int]],
                       request: Request) -> list[int]:
    """Template rendering and tokenization off the event loop (a long prompt takes a while), then the checks.
    `build` asks its argument between steps whether the client has left, and stops if so."""
    gone = asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.create_task(watch())
    try:
        prompt = await anyio.to_thread.run_sync(build, gone.is_set)
    except BuildCancelled:
        raise client_gone() from None
    except TooManyTokens as exc:
        raise ApiError(400, f"the prompt has {'' if exc.exact else 'at least '}{exc.tokens} tokens "
                            f"and the context holds {backend.n_ctx}: prompt and reply must fit",
                       **context_exceeded(exc.tokens, backend.n_ctx)) from None
    except LocalspecError as exc:  # e.g. a chat template that refuses this conversation
        raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
    finally:
        watcher.cancel()
    if not prompt:
        raise ApiError(400, "the prompt is empty (this model adds no BOS token)", param="prompt", code="invalid_value")
    if len(prompt) >= backend.n_ctx:
        # OpenAI's code, llama.cpp's type and numbers (its web UI reads them).
        raise ApiError(400, f"the prompt has {len(prompt)} tokens and the context holds {backend.n_ctx}: "
                            "prompt and reply must fit", **context_exceeded(len(prompt), backend.n_ctx))
    return prompt


def _job_settings(state: ServerState, backend: Backend,
                  req: ChatRequest | CompletionRequest) -> tuple[Preset, int]:
    """The request's fields over the server's preset: one Sampling for target and draft, one Drafting."""
    if req.seed is not None and req.seed >= 0:
        seed = req.seed
    else:  # absent or -1: the server's --seed, else random per request (a preset's fixed seed would repeat replies)
        seed = state.seed if state.seed is not None else secrets.randbits(32)
    overrides = req.preset_overrides()
    names = {key: FIELD_OF_KEY.get(key, key) for key in overrides}  # errors name the request's field
    try:
        preset = backend.preset.with_overrides(seed=seed, flags=names, **overrides)
    except ConfigError as exc:  # the schema checks the same ranges; this is the backstop
        raise ApiError(400, str(exc), code="invalid_value") from None
    # The engine stops at a full context by itself; with context shift a reply goes on past it (llama-server's
    # n_predict -1 too), until the end of its turn or a limit.
    room = MAX_TOKENS_LIMIT if preset.context.context_shift else backend.n_ctx
    limits = [n for n in (req.limit(), state.max_tokens) if n is not None]
    return preset, min([*limits, room])


def _check_drafter(engine: Engine, preset: Preset) -> None:
    """A `speculative.type` the loaded models cannot run is a 400 naming those they can, never plain decoding in
    its place (the available ones come from the drafter registry: `Engine.drafters`)."""
    try:
        engine.check_drafter(preset.draft)
    except UsageError:
        asked = preset.draft.drafter
        why = drafters.unavailable(asked, engine.target, engine.draft) or "these models cannot run it"
        available = [f"{speculative_name(name)}" + (f" ({name})" if speculative_name(name) != name else "")
                     for name in engine.drafters] + [speculative_name(None)]
        raise ApiError(400, f"speculative.type: {speculative_name(asked)!r} (drafter {asked!r}) is not available: "
                       f"{why}; this server can run {', '.join(available)}", param="speculative.type",
                       code="unsupported_value") from None


async def run_request(state: ServerState, backend: Backend, request: Request, req: ChatRequest | CompletionRequest,
               prompt: list[int], *, chat: bool, tools: ToolRequest | None = None, reply: Reply | None = None) -> Any:
    """Queue the request's jobs (one per choice, `n`); stream the reply as SSE or return it as one JSON body
    (`reply`: the shape, OpenAI's by default). Choice i samples with seed + i; the choices run in as many slots
    as are free, and otherwise one after the other (each reusing the prompt the one before left cached)."""
    preset, max_tokens = _job_settings(state, backend, req)
    _check_drafter(backend.worker.engine, preset)
    logprobs = chat_logprobs(req.logprobs, req.top_logprobs) if chat else completion_logprobs(req.logprobs)
    constraint = request_constraint(req.response_format, req.grammar)
    if tools is not None and constraint is not None:
        raise ApiError(400, "tools with response_format or grammar: give one of them", param="tools",
                       code="invalid_value")
    if req.choices > 1 and (tools is not None or logprobs is not None):
        # A reply's tool-call scanner and logprob offsets are one choice's: not kept per choice (yet).
        raise ApiError(400, "n > 1 with tools or logprobs is not supported: one choice per request there",
                       param="n", code="unsupported_parameter")
    try:
        if tools is not None:
            constraint = tools.constraint()  # a parameters schema the converter cannot read fails here
        # One grammar per choice: a job's engine stream owns (and advances) its own. Off the event loop: the
        # first grammar over a model reads its vocabulary's texts (`TokenPrefixes`, ~0.5 s at 152k tokens).
        made = constraint
        grammars = await anyio.to_thread.run_sync(lambda: [made.grammar(backend.model) if made is not None else None
                                                           for _ in range(req.choices)])
    except LocalspecError as exc:  # GBNF that does not parse
        param = "tools" if tools is not None else "grammar" if req.grammar is not None else "response_format"
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None
    worker = backend.worker
    if req.slot is not None and req.slot >= worker.slots:
        raise ApiError(400, f"id_slot: slot {req.slot} does not exist (this server has {worker.slots}: "
                            f"0..{worker.slots - 1}, -1 = any)", param="id_slot", code="invalid_value")
    n = req.choices
    if n > worker.queue_size + worker.slots:
        raise ApiError(400, f"n: {n} choices do not fit this server's {worker.slots} slot(s) and queue of "
                            f"{worker.queue_size} (--parallel, --queue)", param="n", code="invalid_value")
    loop = asyncio.get_running_loop()
    items: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()

    def sink_of(index: int) -> Callable[[Item], None]:
        def sink(item: Item) -> None:  # runs on the worker thread
            loop.call_soon_threadsafe(items.put_nowait, (index, item))

        return sink

    seed_limit = key_metadata("seed")["range"][1] + 1
    jobs = [Job(prompt=prompt, sampling=dataclasses.replace(preset.sampling,
                                                            seed=(preset.sampling.seed + i) % seed_limit),
                drafting=preset.draft, max_tokens=max_tokens, stops=req.stop, sink=sink_of(i), slot=req.slot,
                timings_per_token=bool(req.timings_per_token), grammar=grammars[i], logprobs=logprobs,
                context=preset.context)
            for i in range(n)]
    worker.submit_all(jobs)  # or the 503 that says why not
    reply = reply or Reply(state.model_id, chat, logprobs is not None, tools is not None)
    reply.model_id = backend.model_id or reply.model_id
    reply.settle(preset, max_tokens)
    if req.stream:
        # What the connection may send to find out whether a client that half-closed is still there (guard._probe).
        request.scope[PROBE_BYTES_KEY] = b": are you there?\n\n"
        # On shutdown the worker cancels the job and the stream ends with an error event; the grace period lets
        # it get there before sse-starlette would cut the connection mid-response.
        return EventSourceResponse(_stream(reply, items, worker, jobs, req.include_usage), sep="\n",
                                   shutdown_grace_period=SHUTDOWN_GRACE_S)
    return JSONResponse(reply.whole(await _collect(request, items, worker, jobs)))


async def _collect(request: Request, items: asyncio.Queue[tuple[int, Item]], worker: Worker,
                   jobs: list[Job]) -> list[JobResult]:
    """Wait for every choice's whole reply; a client that leaves meanwhile cancels the jobs."""

    async def cancel_on_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for job in jobs:
                    worker.cancel(job)
                # A job cancelled while queued never reports back: end the wait here.
                items.put_nowait((0, Failed(client_gone())))
                return

    watcher = asyncio.create_task(cancel_on_disconnect())
    results: dict[int, JobResult] = {}
    try:
        while len(results) < len(jobs):
            index, item = await items.get()
            if isinstance(item, Finished):
                if item.result.finish_reason == FINISH_CANCELLED:
                    raise shutting_down("the request was cancelled: the server is shutting down")
                results[index] = item.result
            elif isinstance(item, Failed):
                raise item.error
        return [results[i] for i in range(len(jobs))]
    finally:
        watcher.cancel()
        for job in jobs:
            worker.cancel(job)  # a no-op when it finished; stops it when this handler was cancelled


async def _stream(reply: Reply, items: asyncio.Queue[tuple[int, Item]], worker: Worker, jobs: list[Job],
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE data lines, each choice's chunks with its `index`. sse-starlette cancels this generator when the client
    disconnects (or the server shuts down); the `finally` then cancels the jobs."""
    results: dict[int, JobResult] = {}
    try:
        if reply.chat:
            for index in range(len(jobs)):
                yield reply.chunk({"role": "assistant", "content": ""}, index=index)
        failed = False
        while len(results) < len(jobs) and not failed:
            index, item = await items.get()
            if isinstance(item, Delta):
                for chunk in reply.delta_chunks(item, index=index):
                    yield chunk
            elif isinstance(item, Failed):
                yield json_text(item.error.body)
                failed = True
            elif item.result.finish_reason == FINISH_CANCELLED:
                yield json_text(shutting_down("the request was cancelled: the server is shutting down").body)
                failed = True
            else:
                results[index] = item.result
                for chunk in reply.delta_chunks(Delta(""), final=True, index=index):
                    yield chunk
                yield reply.final_chunk(item.result, index)
        if include_usage and reply.usage_chunks and not failed:
            yield reply.usage_chunk([results[i] for i in range(len(jobs))])
        if reply.done_marker:
            yield "[DONE]"
    except Exception as exc:  # a bug: tell the client and log one line, as guarded does for JSON routes
        yield json_text(internal("stream", exc).body)
    finally:
        for job in jobs:
            worker.cancel(job)


# -- response shapes -----------------------------------------------------------------------------------------


def json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class Reply:
    """OpenAI's shapes for one reply: chat.completion(.chunk) or text_completion, with one choice per job."""

    done_marker = True  # the stream ends with `data: [DONE]`
    usage_chunks = True  # stream_options.include_usage adds a usage chunk

    def __init__(self, model_id: str, chat: bool, logprobs: bool = False, tools: bool = False) -> None:
        self.model_id = model_id
        self.chat = chat
        self.logprobs = logprobs
        self.tools = ToolScanner() if tools else None  # streaming: <tool_call> blocks → delta.tool_calls
        self.sent_chars = 0  # completions' text_offset
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.fingerprint = f"localspec-{__version__}"

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                "system_fingerprint": self.fingerprint}

    def _choice(self, payload: dict[str, Any] | str, finish: str | None, whole: bool = False,
                index: int = 0, logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
        shaped = None
        if self.logprobs and logprobs is not None:
            shaped = chat_shape(list(logprobs)) if self.chat else completion_shape(list(logprobs), self.sent_chars)
        if self.chat:
            key = "message" if whole else "delta"
            return {"index": index, key: payload, "logprobs": shaped, "finish_reason": finish}
        self.sent_chars += len(payload) if isinstance(payload, str) else 0
        return {"index": index, "text": payload, "logprobs": shaped, "finish_reason": finish}

    def settle(self, preset: Preset, max_tokens: int) -> None:
        """The job's settings, once known (llama-server's shape reports them)."""

    def chunk(self, payload: dict[str, Any] | str, timings: dict[str, Any] | None = None, index: int = 0,
              logprobs: Sequence[TokenLogprob] = ()) -> str:
        extra = {"timings": timings} if timings is not None else {}
        return json_text({**self._head(True), "choices": [self._choice(payload, None, index=index, logprobs=logprobs)],
                      **extra})

    def delta_chunks(self, delta: Delta, final: bool = False, index: int = 0) -> list[str]:
        """The chunks for one Delta of text: its content (and logprobs, timings), and with tools the pieces of
        calls as they are written."""
        if not self.chat:
            if delta.text or delta.logprobs or not final:
                return [self.chunk(delta.text, delta.timings, index, logprobs=delta.logprobs)]
            return []
        if self.tools is None:
            return [] if final else [self.chunk({"content": delta.text}, delta.timings, index, logprobs=delta.logprobs)]
        pieces = self.tools.feed(delta.text) + (self.tools.flush() if final else [])
        if not pieces and delta.logprobs:
            pieces = [""]
        # The delta's timings and logprobs ride on its first chunk.
        return [self.chunk({"content": p} if isinstance(p, str) else {"tool_calls": [p.openai()]},
                           delta.timings if i == 0 else None, index, logprobs=delta.logprobs if i == 0 else ())
                for i, p in enumerate(pieces)]

    def final_chunk(self, result: JobResult, index: int = 0) -> str:
        empty: dict[str, Any] | str = {} if self.chat else ""
        # A call cut short (max_tokens, a stop string) keeps the reason it was cut.
        tools = self.tools
        finish = "tool_calls" if tools is not None and tools.calls and not tools.unfinished else result.finish_reason
        return json_text({**self._head(True), "choices": [self._choice(empty, finish, index=index)],
                      "timings": result.timings()})

    def usage_chunk(self, results: list[JobResult]) -> str:
        # The timings again: llama.cpp's clients read them from the last chunk.
        return json_text({**self._head(True), "choices": [], "usage": _usage(results), "timings": _timings(results)})

    def whole(self, results: list[JobResult]) -> Any:
        choices = []
        for index, result in enumerate(results):
            payload: dict[str, Any] | str = ({"role": "assistant", "content": result.text} if self.chat
                                             else result.text)
            finish = result.finish_reason
            if self.tools is not None:
                content, calls, unfinished = split_reply(result.text)
                if calls:
                    payload = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    finish = result.finish_reason if unfinished else "tool_calls"
            choices.append(self._choice(payload, finish, whole=True, index=index, logprobs=result.logprobs))
        return {**self._head(False), "choices": choices, "usage": _usage(results), "timings": _timings(results)}


def _usage(results: list[JobResult]) -> dict[str, Any]:
    """OpenAI's usage: the prompt once, the completions of every choice."""
    prompt = results[0].stats.prompt_tokens
    completion = sum(r.stats.tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": prompt - results[0].prompt_n}}


def _timings(results: list[JobResult]) -> dict[str, Any]:
    """One choice's timings; several choices' summed (their counts and seconds add up)."""
    return results[0].timings() if len(results) == 1 else timings(GenerationStats.total(r.stats for r in results))

