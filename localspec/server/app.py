"""The HTTP app: `create_app(state)` wires the guard, CORS, OpenAI's routes (here) and llama-server's
(llama_routes.py) over one `ServerState`, and the error handlers that make every error OpenAI-shaped JSON:
`{"error": {"message", "type", "param", "code"}}`.

It answers at once; `state.attach(backend)` makes it serve once the models are loaded (until then /health says
503 and generation routes answer 503 "loading"). What the routes share (state, errors, the path of a request to
the worker and back) is in handling.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from localspec import __version__
from localspec.llama.vision import data_uri_bytes, decode_picture
from localspec.server import errors
from localspec.server.errors import ApiError
from localspec.server.guard import Cors, Guard
from localspec.server.handling import (
    Backend,
    ServerState,
    build_prompt,
    check_pictures_sent,
    completion_prompt,
    guarded,
    read_body,
    run_request,
)
from localspec.server.llama_routes import add_llama_routes
from localspec.server.router import ReleaseLeases, add_router_routes
from localspec.server.schema import ChatRequest, CompletionRequest, parse, parse_body
from localspec.server.slot_routes import add_slot_routes
from localspec.server.tools import messages_for_template, parse_tools
from localspec.sessions.chat import encode_messages

if TYPE_CHECKING:
    from localspec.rounds.engine import Engine
    from localspec.rounds.scores import ScoringModel

__all__ = ["Backend", "ServerState", "create_app"]


def create_app(state: ServerState, cors_origins: tuple[str, ...] = ()) -> FastAPI:
    app = FastAPI(title="localspec", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.localspec = state
    app.add_middleware(ReleaseLeases)  # innermost: a request's pair is let go once its response has been sent
    app.add_middleware(Guard, state=state)  # before every route
    # Outermost, as llama-server's: preflights answered before the guard, refusals carrying the allowed origin.
    app.add_middleware(Cors, origins=cors_origins)
    errors.install(app)  # every error answers in OpenAI's shape, through errors.api_error
    add_llama_routes(app, state)  # llama-server's own: /completion, /infill, /tokenize, /props, /slots, /metrics, ...
    add_slot_routes(app, state)  # POST /slots/{id}?action=save|restore|erase
    add_router_routes(app, state)  # POST /models/load, /models/unload (several pairs)

    def _per_call(model: Any) -> float | None:
        calls = getattr(model, "sequence_calls", 0)
        return round(model.sequences_decoded / calls, 2) if calls else None

    async def health() -> JSONResponse:
        if state.router is not None:
            return JSONResponse(state.router.health())
        if state.backend is None:
            status = "error" if state.load_error else "loading"
            return JSONResponse({"status": status, "message": state.load_error}, status_code=503)
        stats, worker = state.backend.worker.stats, state.backend.worker
        return JSONResponse({"status": "ok", "model": state.model_id, "busy": stats.busy, "running": stats.running,
                             "slots": worker.slots, "slots_batched": worker.engine.batches_slots,
                             # what decided it (logits, the worst model): a multi-sequence batch against each
                             # sequence alone, and one sequence at two batch widths (LlamaModel's probe at load)
                             "slots_batch_error": max(m.sequence_batch_error for m in worker.engine.models),
                             "width_noise": max(m.width_noise for m in worker.engine.models),
                             # ... and per model: the target's slots may take turns beside a draft that shares
                             # batches, which decides how the other slots are drafted (Schedule._take_turns)
                             # (a "warning" where the model's width alone moves its rows past the cap)
                             # (`sequences_per_call`: the slots a llama_decode held, over the decodes of several)
                             "slot_batches": {name: {"shared": m.batches_sequences,
                                                     "error": m.sequence_batch_error, "width_noise": m.width_noise,
                                                     "sequences_per_call": _per_call(m),
                                                     **({"warning": m.batch_warning} if m.batch_warning else {})}
                                              for name, m in _named_models(worker.engine)},
                             "rounds_tok_s": {str(n): rates for n, rates in worker.engine.load.summary().items()},
                             # `[draft] stand_aside`: rounds served without drafting because it was priced below
                             # plain decoding, and why the last reply's drafting stood aside (null: it drafted)
                             "drafting": {"stood_aside_rounds": stats.totals.stood_aside,
                                          "aside": stats.last.aside if stats.last is not None else None},
                             "queued": worker.queued,
                             "served": stats.served, "cancelled": stats.cancelled, "failed": stats.failed,
                             "rejected": stats.rejected})

    async def models(request: Request) -> JSONResponse:
        if state.router is not None:  # llama-server's router shape: each pair with its status
            return JSONResponse({"object": "list", "data": state.router.listing(state.created)})
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "localspec"}
            for name in state.served]})

    async def chat_completions(request: Request) -> Any:
        req = parse(ChatRequest, parse_body(await read_body(request)))
        backend = await state.pick(req.model, request)
        if backend.template is None:
            raise ApiError(400, f"chat is unavailable: {backend.template_error}", param="messages",
                           code="no_chat_template")
        tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        messages, variables = messages_for_template([m.as_template_message() for m in req.messages], tools,
                                                    backend.template.reads_tools)
        backend.limits.check_messages([m["content"] for m in messages])  # before the template renders them all

        sent = [(f"messages[{i}] picture {j + 1}", uri) for i, m in enumerate(req.messages)
                for j, uri in enumerate(m.pictures)]
        check_pictures_sent(backend, len(sent), "messages", sent[0][0] if sent else "")

        def build(cancelled: Callable[[], bool]) -> list[int]:
            assert backend.template is not None
            pictures = [decode_picture(data_uri_bytes(uri, name), name, backend.preset.images) for name, uri in sent]
            return encode_messages(backend.model, backend.template, messages, control_tokens=state.control_tokens,
                                   limit=backend.n_ctx, cancelled=cancelled, variables=variables, pictures=pictures)

        prompt = await build_prompt(backend, build, request)
        return await run_request(state, backend, request, req, prompt, chat=True, tools=tools)

    async def completions(request: Request) -> Any:
        req = parse(CompletionRequest, parse_body(await read_body(request)))
        backend = await state.pick(req.model, request)
        prompt = await completion_prompt(backend, req, request)
        return await run_request(state, backend, request, req, prompt, chat=False)

    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/models", guarded(models), methods=["GET"])
        app.add_api_route(f"{prefix}/chat/completions", guarded(chat_completions), methods=["POST"])
        app.add_api_route(f"{prefix}/completions", guarded(completions), methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/health", health, methods=["GET"])
    return app


def _named_models(engine: Engine) -> list[tuple[str, ScoringModel]]:
    """The engine's models as /health names them: "target", then "draft" (any further model: "draft2", ...)."""
    names = ["target", *("draft" if i == 0 else f"draft{i + 1}" for i in range(len(engine.models) - 1))]
    return list(zip(names, engine.models, strict=True))
