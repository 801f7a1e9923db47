"""llama-server's own endpoints, in its field names and shapes (the pinned llama.cpp's tools/server/README.md):
/tokenize, /detokenize, /apply-template, /props, /slots, /metrics, the native /completion and /infill.

They go through the same guards as OpenAI's routes (API key, body size limit, OpenAI-shaped errors, CORS) and the
one path to the worker (handling.run_request); only the reply's shape is llama-server's. Fields are as strict as
everywhere else: an unknown one is a 400 naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field, ValidationError, field_validator

from localspec import __version__
from localspec.config import ContextSettings, Drafting, Preset, Sampling
from localspec.errors import LocalspecError
from localspec.llama.model import LlamaModel
from localspec.llama.vision import MARKER, runs
from localspec.server.errors import ApiError
from localspec.server.fim import fim_prompt
from localspec.server.handling import (
    Backend,
    Reply,
    ServerState,
    build_prompt,
    completion_prompt,
    completion_tokens,
    guarded,
    json_text,
    read_body,
    run_request,
)
from localspec.server.schema import (
    ChatRequest,
    CompletionRequest,
    _explain,
    _Strict,
    parse,
    parse_body,
    speculative_name,
)
from localspec.server.worker import FINISH_LENGTH, JobResult, SlotView, timings

SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]  # sampling.py's fixed order, in llama's names


# -- request bodies ------------------------------------------------------------------------------------------


class TokenizeRequest(_Strict):
    content: str
    model: str | None = None  # which pair, where several are served (llama-server's router reads it too)
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int]
    model: str | None = None


class ExtraChunk(_Strict):
    text: str
    filename: str = "tmp"


class InfillRequest(CompletionRequest):
    """/infill: the code around the gap, other files' text as context, and an optional start of the middle."""

    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""  # type: ignore[assignment]  # here: text after FIM_MID (the start of the middle)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError("expected a string (the start of the middle)")
        return value


def _validate(cls: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc, cls) from None


# -- llama-server's shapes -----------------------------------------------------------------------------------


def generation_params(s: Sampling, d: Drafting, max_tokens: int | None, seed: int,
                      context: ContextSettings | None = None) -> dict[str, Any]:
    """llama-server's `params` object (its `generation_settings`), for the settings localspec has; the samplers
    it lacks show their off value, which is all a request may ask of them. `seed` -1: a random one each."""
    n_predict = -1 if max_tokens is None else max_tokens
    return {
        "n_predict": n_predict, "max_tokens": n_predict, "seed": seed,
        "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
        "repeat_last_n": s.repeat_last_n, "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
        "typical_p": 1.0, "top_n_sigma": -1.0, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "xtc_probability": 0.0, "dry_multiplier": 0.0, "mirostat": 0, "n_keep": context.n_keep if context else 0,
        "n_discard": context.n_discard if context else 0,
        "ignore_eos": False, "n_probs": 0, "min_keep": 0, "samplers": SAMPLERS,
        "speculative.n_max": d.n_draft, "speculative.n_min": 0, "speculative.p_min": d.p_min,
        "speculative.type": speculative_type(d),
        "timings_per_token": False, "post_sampling_probs": False, "lora": [],
    }


def speculative_type(d: Drafting) -> str:
    """Who drafts under these settings, in llama-server's `speculative.type` names."""
    if d.n_draft == 0:
        return "none"
    return speculative_name(d.drafter)


def _stop_type(result: JobResult) -> str:
    if result.stop_string is not None:
        return "word"
    return "limit" if result.finish_reason == FINISH_LENGTH else "eos"


class NativeReply(Reply):
    """llama-server's /completion shape: `content`, `stop`, `tokens_predicted`, `timings`, ... (no OpenAI
    envelope, no `[DONE]` at the end of a stream)."""

    done_marker = False
    usage_chunks = False

    def __init__(self, state: ServerState, model: LlamaModel, prompt: list[int]) -> None:
        super().__init__(state.model_id, chat=False)
        self.state = state
        self.model = model
        self.prompt = prompt
        self.settings: dict[str, Any] = {}

    def settle(self, preset: Preset, max_tokens: int) -> None:
        self.settings = generation_params(preset.sampling, preset.draft, max_tokens, preset.sampling.seed,
                                          preset.context)

    def chunk(self, payload: dict[str, Any] | str, timings: dict[str, Any] | None = None, index: int = 0,
              logprobs: Sequence[Any] = ()) -> str:  # no logprobs: refused on these routes (_native_request)
        out: dict[str, Any] = {"index": index, "content": payload, "tokens": [], "stop": False}
        if timings is not None:
            out["timings"] = timings
        return json_text(out)

    def final_chunk(self, result: JobResult, index: int = 0) -> str:
        return json_text(self._final(result, "", index))  # the text went out in the chunks before

    def whole(self, results: list[JobResult]) -> Any:
        """One result as an object; several choices (`n_cmpl`) as an array of them, as llama-server does."""
        out = [self._final(result, result.text, index) for index, result in enumerate(results)]
        return out[0] if len(out) == 1 else out

    def _final(self, result: JobResult, content: str, index: int) -> dict[str, Any]:
        s = result.stats
        return {
            "index": index, "content": content, "tokens": [], "id_slot": result.slot, "stop": True,
            "model": self.model_id, "tokens_predicted": s.tokens, "tokens_evaluated": s.prompt_tokens,
            "generation_settings": {"n_ctx": self.model.n_ctx, **self.settings},
            "prompt": prompt_text(self.model, self.prompt), "has_new_line": "\n" in result.text,
            "truncated": s.context_shifts > 0, "stop_type": _stop_type(result),
            "stopping_word": result.stop_string or "",
            "tokens_cached": s.prompt_tokens - result.prompt_n, "timings": result.timings(),
        }


def prompt_text(model: LlamaModel, prompt: list[int]) -> str:
    """The prompt as text (special tokens included), each picture as the marker it was sent with."""
    return "".join(MARKER if is_picture else model.detokenize(prompt[start:end], special=True)
                   for is_picture, start, end in runs(prompt))


# -- the routes ----------------------------------------------------------------------------------------------


def add_llama_routes(app: FastAPI, state: ServerState) -> None:
    async def body_of(request: Request) -> Any:
        return parse_body(await read_body(request))

    async def tokenize(request: Request) -> JSONResponse:
        req = _validate(TokenizeRequest, await body_of(request))
        model = (await state.pick(req.model or request.query_params.get("model"), request)).model
        ids = await anyio.to_thread.run_sync(
            functools.partial(model.tokenize, req.content, add_special=req.add_special,
                              parse_special=req.parse_special))
        if not req.with_pieces:
            return JSONResponse({"tokens": ids})
        return JSONResponse({"tokens": [{"id": t, "piece": _piece(model.piece(t, special=True))} for t in ids]})

    async def detokenize(request: Request) -> JSONResponse:
        req = _validate(DetokenizeRequest, await body_of(request))
        model = (await state.pick(req.model or request.query_params.get("model"), request)).model
        completion_tokens(model, req.tokens, param="tokens")  # checks the ids
        return JSONResponse({"content": model.detokenize(req.tokens, special=True)})

    async def apply_template(request: Request) -> JSONResponse:
        req = parse(ChatRequest, await body_of(request))
        backend = await state.pick(req.model, request)
        return JSONResponse({"prompt": await _render(backend, req)})

    async def props(request: Request) -> JSONResponse:
        backend = await state.pick(request.query_params.get("model"), request)  # llama-server's router: ?model=
        return JSONResponse(_props(state, backend))

    async def slots(request: Request) -> JSONResponse:
        if not state.slots:  # llama-server's words and status
            raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           kind="not_supported_error", code="slots_disabled")
        backend = await state.pick(request.query_params.get("model"), request)
        views = backend.worker.slot_views()
        if request.query_params.get("fail_on_no_slot") and all(v.busy for v in views):
            raise ApiError(503, "no slot is free", kind="unavailable_error", code="no_slot_available")
        return JSONResponse([_slot(backend, v) for v in views])

    async def metrics(request: Request) -> PlainTextResponse:
        if not state.metrics:
            raise ApiError(501, "metrics are off: start the server with --metrics (preset key server.metrics)",
                           kind="not_supported_error", code="metrics_disabled")
        backend = await state.pick(request.query_params.get("model"), request)
        return PlainTextResponse(_prometheus(backend), media_type="text/plain; version=0.0.4",
                                 headers={"Process-Start-Time-Unix": str(process_start_unix())})

    async def completion(request: Request) -> Any:
        req = _native_request(parse(CompletionRequest, await body_of(request)))
        backend = await state.pick(req.model, request)
        prompt = await completion_prompt(backend, req, request)
        return await run_request(state, backend, request, req, prompt, chat=False,
                          reply=NativeReply(state, backend.model, prompt))

    async def infill(request: Request) -> Any:
        req = _native_request(parse(InfillRequest, await body_of(request)))
        if req.suffix:
            raise ApiError(400, "suffix: /infill takes the code after the gap as input_suffix", param="suffix",
                           code="invalid_value")
        backend = await state.pick(req.model, request)
        for text, param in ((req.input_prefix, "input_prefix"), (req.input_suffix, "input_suffix"),
                            (req.prompt, "prompt")):
            backend.limits.check_text(text, param)  # before tokenizing it
        extra = [(chunk.filename, chunk.text) for chunk in req.input_extra]

        def build(cancelled: Callable[[], bool]) -> list[int]:
            return fim_prompt(backend.model, req.input_prefix, req.input_suffix, req.prompt, extra)

        prompt = await build_prompt(backend, build, request)
        return await run_request(state, backend, request, req, prompt, chat=False,
                          reply=NativeReply(state, backend.model, prompt))

    for path, handler in (("/tokenize", tokenize), ("/detokenize", detokenize), ("/apply-template", apply_template),
                          ("/completion", completion), ("/infill", infill)):
        app.add_api_route(path, guarded(handler), methods=["POST"])
    for path, handler in (("/props", props), ("/slots", slots), ("/metrics", metrics)):
        app.add_api_route(path, guarded(handler), methods=["GET"])


def _native_request(req: CompletionRequest) -> CompletionRequest:
    """/completion and /infill: no OpenAI logprobs (the native reply has no place for them; llama-server's n_probs
    is refused by name). The model's name is checked as on the OpenAI routes (`ServerState.pick`)."""
    if req.logprobs not in (None, 0, False):
        raise ApiError(400, "logprobs: llama-server's /completion shape has no OpenAI logprobs; use /v1/completions",
                       param="logprobs", code="unsupported_parameter")
    return req


async def _render(backend: Backend, req: ChatRequest) -> str:
    if backend.template is None:
        raise ApiError(400, f"chat is unavailable: {backend.template_error}", param="messages",
                       code="no_chat_template")
    messages = [m.as_template_message() for m in req.messages]
    try:
        return await anyio.to_thread.run_sync(backend.template.render, messages)
    except LocalspecError as exc:  # the template refused this conversation
        raise ApiError(400, str(exc), param="messages", code="invalid_value") from None


def _piece(raw: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not valid UTF-8 on their own (llama-server's rule)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _props(state: ServerState, backend: Backend) -> dict[str, Any]:
    model, worker = backend.model, backend.worker
    engine = worker.engine
    totals = worker.stats.totals
    draft = engine.draft
    drafting = backend.preset.draft
    # The server's default drafter, from the engine's drafters (drafters.build): one these models cannot run
    # means plain decoding (engine.Stream).
    speculates = drafting.n_draft > 0 and drafting.drafter in engine.drafters
    return {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": backend.n_ctx, "speculative": speculates,
            "is_processing": False,
            "params": generation_params(backend.preset.sampling, backend.preset.draft, state.max_tokens,
                                        -1 if state.seed is None else state.seed, backend.preset.context),
        },
        "total_slots": worker.slots,
        "model_alias": backend.model_id or state.model_id,
        "model_path": str(model.path),
        "modalities": {"vision": getattr(model, "projector", None) is not None, "video": False, "audio": False},
        "endpoint_slots": state.slots,
        "endpoint_props": False,
        "endpoint_metrics": state.metrics,
        "chat_template": model.metadata("tokenizer.chat_template") or "",
        "chat_template_caps": {},
        "bos_token": model.token_text(model.bos) if model.bos >= 0 else "",
        "eos_token": model.token_text(model.eos) if model.eos >= 0 else "",
        "build_info": f"localspec-{__version__}",
        "is_sleeping": False,
        # localspec's own: the speculative half of the server.
        "localspec": {
            "draft_model": str(draft.path) if draft is not None else None,
            "drafter": drafting.drafter if speculates else "none",
            "drafters": sorted(engine.drafters),  # what a request's speculative.type may choose from
            "speculative.n_max": backend.preset.draft.n_draft,
            "speculative.p_min": backend.preset.draft.p_min,
            "speculative.adaptive": backend.preset.draft.adaptive,
            "slots_batched": engine.batches_slots,
            "fim": all(model.fim_tokens()[k] is not None for k in ("pre", "suf", "mid")),
            "draft_n": totals.drafted,
            "draft_n_accepted": totals.accepted,
            "acceptance_rate": round(totals.acceptance_rate, 4),
            "mean_accepted": round(totals.mean_accepted, 4),
        },
    }


def _slot(backend: Backend, view: SlotView) -> dict[str, Any]:
    """One slot in llama-server's /slots shape, plus localspec's context and acceptance figures."""
    out: dict[str, Any] = {"id": view.slot, "id_task": view.task_id, "n_ctx": backend.n_ctx,
                           "speculative": bool(backend.worker.engine.drafters), "is_processing": view.busy,
                           "n_tokens": view.n_tokens}
    if view.job is None or view.stats is None:
        return out
    s, job = view.stats, view.job
    processed = min(s.prompt_tokens, s.prompt_tokens_processed + 1) if s.prompt_tokens else 0
    out.update({
        "n_prompt_tokens": s.prompt_tokens,
        "n_prompt_tokens_processed": processed,
        "n_prompt_tokens_cache": s.prompt_tokens - processed,
        "params": {**generation_params(job.sampling, job.drafting, job.max_tokens, job.sampling.seed, job.context),
                   "stop": list(job.stops), "timings_per_token": job.timings_per_token},
        # Idle, llama-server's n_remain is -1 (its slot forgets the limit on release); localspec keeps the last
        # request's other figures until the next one.
        "next_token": [{"has_next_token": view.busy,
                        "n_remain": max(0, job.max_tokens - s.tokens) if view.busy else -1, "n_decoded": s.tokens}],
        "timings": timings(s),
    })
    return out


def _prometheus(backend: Backend) -> str:
    """Prometheus' text format, llama-server's metric names (`llamacpp:`) plus localspec's own. Hand-written:
    a dozen lines of text, where prometheus_client would bring a registry and a dependency for them."""
    worker = backend.worker
    stats, t = worker.stats, worker.stats.totals
    counters = [
        # Counted as each reply's timings count them (prompt_n, cache_n): their sums over the served requests.
        ("llamacpp:prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
         stats.prompt_n),
        ("llamacpp:prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", stats.cache_n),
        ("llamacpp:prompt_seconds_total", "Total time spent processing prompts", t.prefill_s),
        ("llamacpp:tokens_predicted_total", "Number of generation tokens processed", t.tokens),
        ("llamacpp:tokens_predicted_seconds_total", "Total time spent generating tokens", t.decode_s),
        ("llamacpp:n_decode_total",
         "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
         worker.decodes),
        ("llamacpp:n_tokens_max", "Largest observed sequence length (prompt + generation)", stats.max_sequence),
        ("llamacpp:spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", t.drafted),
        ("llamacpp:spec_decode_num_accepted_tokens_total",
         "Speculative: Total draft tokens accepted by the target model", t.accepted),
        ("llamacpp:spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
         stats.draft_rounds),
    ]
    gauges = [
        ("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", t.prefill_tps),
        ("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s", t.decode_tps),
        ("llamacpp:requests_processing", "Number of requests processing", stats.running),
        ("llamacpp:requests_deferred", "Number of requests deferred", worker.queued),
        ("llamacpp:n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         stats.busy_slot_decodes / max(worker.decodes, 1)),
        ("localspec:draft_acceptance_ratio", "Accepted draft tokens / drafted tokens, all requests",
         t.acceptance_rate),
        ("localspec:draft_mean_accepted", "Accepted draft tokens per round, all requests", t.mean_accepted),
        ("localspec:slots", "Slots (--parallel)", worker.slots),
        ("localspec:slots_busy", "Slots generating now", stats.running),
    ]
    for name, help_text, kind, value in prompt_cache_metrics(backend):
        (counters if kind == "counter" else gauges).append((name, help_text, value))
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in items:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]
    lines += ["# HELP localspec:requests_total Requests ended, by outcome", "# TYPE localspec:requests_total counter"]
    for outcome in ("served", "cancelled", "failed", "rejected"):
        lines.append(f'localspec:requests_total{{outcome="{outcome}"}} {getattr(stats, outcome)}')
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


@functools.cache
def process_start_unix() -> int:
    """When this process started, in whole seconds since the Unix epoch: llama-server's /metrics header
    `Process-Start-Time-Unix` (front-ends read it to tell a restart, whose counters start again, from a drop)."""
    import time

    import psutil

    try:
        return int(psutil.Process().create_time())
    except (psutil.Error, OSError):  # a sandbox hiding /proc: the first /metrics request's time, fixed from then
        return int(time.time())


def prompt_cache_metrics(backend: Backend) -> list[tuple[str, str, str, float]]:
    """The prompt cache's lines for /metrics: (name, help, counter|gauge, value); zeros when it is off."""
    cache = backend.worker.engine.prompt_cache
    if cache is None:
        values = dict.fromkeys(("hits", "misses", "restored_tokens", "stored", "evicted", "skipped", "entries",
                                "tokens", "nbytes", "limit", "shared_bytes"), 0)
    else:
        values = vars(cache.counters())
    return [
        ("localspec:prompt_cache_hits_total", "Prompts restored from the host-RAM prompt cache", "counter",
         values["hits"]),
        ("localspec:prompt_cache_misses_total", "Slots given to another prompt with no cached state that serves it",
         "counter", values["misses"]),
        ("localspec:prompt_cache_tokens_restored_total", "Prompt tokens restored from the cache instead of decoded",
         "counter", values["restored_tokens"]),
        ("localspec:prompt_cache_stored_total", "Slot states kept in the cache", "counter", values["stored"]),
        ("localspec:prompt_cache_evicted_total", "Cached states removed to stay within the budget", "counter",
         values["evicted"]),
        ("localspec:prompt_cache_skipped_total", "Slot states larger than the whole budget, not kept", "counter",
         values["skipped"]),
        ("localspec:prompt_cache_entries", "Slot states in the cache", "gauge", values["entries"]),
        ("localspec:prompt_cache_tokens", "Tokens the cached states hold", "gauge", values["tokens"]),
        ("localspec:prompt_cache_bytes", "Host RAM the cached states take", "gauge", values["nbytes"]),
        ("localspec:prompt_cache_limit_bytes", "The cache's budget (server.cache_ram; 0 = off), one for the "
         "whole server: several pairs' caches share it, within models_budget", "gauge", values["limit"]),
        ("localspec:prompt_cache_shared_bytes", "Host RAM every loaded pair's cache takes together (this budget's "
         "use)", "gauge", values["shared_bytes"]),
    ]
