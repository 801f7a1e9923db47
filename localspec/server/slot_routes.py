"""llama-server's slot actions (`POST /slots/{id_slot}?action=save|restore|erase`, with `--slot-save-path`) and the
host-RAM prompt cache's lines in /metrics.

Request and reply shapes are llama-server's (tools/server/README.md): `{"filename": NAME}` in, `{id_slot, filename,
n_saved, n_written, timings: {save_ms}}`, `{id_slot, filename, n_restored, n_read, timings: {restore_ms}}` and
`{id_slot, n_erased}` out. As there, an action on a busy slot waits until its generation ends (`Worker.in_slot`).
Both models' cells are saved (`Engine.snapshot`), in localspec's checked format (slot_file.py): a file another
model, KV type, slot count or version wrote, a damaged one, a name that is not one safe name in the save folder
(slot_file.check_name: no dotfiles, no paths) and a save over a file that is not a slot file are a 400 naming what
differs, and the slot is left as it was. Files are read and written off the engine thread; only
the copy into or out of the models' cells runs there.
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from localspec.errors import WriteError
from localspec.rounds.prompt_cache import SlotState
from localspec.rounds.slot_file import ModelIdentity, SlotFileError, identity, path_in, save_path_in
from localspec.rounds.slot_file import read as read_slot_file
from localspec.rounds.slot_file import write as write_slot_file
from localspec.server.errors import ApiError
from localspec.server.handling import Backend, ServerState, guarded, read_body
from localspec.server.llama_routes import _validate
from localspec.server.schema import _Strict, parse_body

ACTIONS = ("save", "restore", "erase")


class SlotFileRequest(_Strict):
    filename: str


def add_slot_routes(app: FastAPI, state: ServerState) -> None:
    async def slot_action(request: Request) -> JSONResponse:
        body = await read_body(request)  # before `pick`, which then watches for the client leaving
        backend = await state.pick(request.query_params.get("model"), request)
        if state.slot_save_path is None:
            raise ApiError(501, "This server does not support slots action. Start it with `--slot-save-path` "
                                "(preset key server.slot_save_path)", kind="not_supported_error",
                           code="slot_save_disabled")
        slot = _slot_id(request.path_params["id_slot"], backend.worker.slots)
        action = request.query_params.get("action")
        if action not in ACTIONS:
            raise ApiError(400, f"Invalid action {action!r}: ?action= one of {', '.join(ACTIONS)}", param="action",
                           code="invalid_value")
        if action == "erase":  # (llama-server reads no body for it)
            return await _erase(backend, slot)
        data = parse_body(body)
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object with a filename")
        name = _validate(SlotFileRequest, data).filename
        try:
            path = (save_path_in if action == "save" else path_in)(state.slot_save_path, name)
        except SlotFileError as exc:
            raise ApiError(400, f"Invalid filename: {exc}", param="filename", code="invalid_value") from None
        if action == "save":
            return await _save(backend, slot, name, path)
        return await _restore(backend, slot, name, path)

    app.add_api_route("/slots/{id_slot}", guarded(slot_action), methods=["POST"])


def _slot_id(text: str, slots: int) -> int:
    # ASCII digits, a few: str.isdigit() also holds for "²", which int() refuses, and int() refuses 4,301 digits.
    if not (text.isascii() and text.isdecimal() and len(text) <= 9) or int(text) >= slots:
        raise ApiError(400, f"Invalid slot ID {text!r}: this server has {slots} slot(s), 0..{slots - 1}",
                       param="id_slot", code="invalid_value")
    return int(text)


async def _in_slot(backend: Backend, slot: int, action: Any) -> Any:
    """The action's result, or its exception (a 503 when the server shuts down first)."""
    return await asyncio.wrap_future(backend.worker.in_slot(slot, action))


def identities(backend: Backend) -> list[ModelIdentity]:
    """The served models' identities, in the engine's state order (each file fingerprinted once: slot_file)."""
    return [identity(m) for m in backend.worker.engine.state_models()]


async def _save(backend: Backend, slot: int, name: str, path: Path) -> JSONResponse:
    t0 = time.perf_counter()
    models = await anyio.to_thread.run_sync(identities, backend)
    state: SlotState = await _in_slot(backend, slot, lambda: backend.worker.engine.snapshot(slot))
    try:
        written = await anyio.to_thread.run_sync(functools.partial(write_slot_file, path, state, models))
    except WriteError as exc:
        raise ApiError(500, f"Unable to save slot: {exc}", kind="server_error", code="write_failed") from None
    return JSONResponse({"id_slot": slot, "filename": name, "n_saved": state.models[0].n_tokens,
                         "n_written": written, "timings": {"save_ms": _ms(t0)}})


async def _restore(backend: Backend, slot: int, name: str, path: Path) -> JSONResponse:
    t0 = time.perf_counter()
    engine, model = backend.worker.engine, backend.model
    models = await anyio.to_thread.run_sync(identities, backend)
    try:
        loaded = await anyio.to_thread.run_sync(functools.partial(
            read_slot_file, path, models, n_vocab=model.n_vocab, n_ctx=engine.n_ctx))
    except SlotFileError as exc:
        # The path inside the save folder is the server's business: the client named the file.
        message = str(exc).replace(str(path), name)
        raise ApiError(400, f"Unable to restore slot: {message}", param="filename", code="invalid_value") from None
    try:
        restored = await _in_slot(backend, slot, lambda: engine.restore(slot, loaded.state, loaded.parts))
    except SlotFileError as exc:  # (a drafter's part that does not fit: checked before any cell changed)
        raise ApiError(400, f"Unable to restore slot: {name}: {exc}", param="filename", code="invalid_value") from None
    if not restored:
        raise ApiError(400, f"Unable to restore slot: llama.cpp refused the state in {name} (the slot is empty now)",
                       param="filename", code="invalid_value")
    return JSONResponse({"id_slot": slot, "filename": name, "n_restored": loaded.state.models[0].n_tokens,
                         "n_read": loaded.nbytes, "timings": {"restore_ms": _ms(t0)}})


async def _erase(backend: Backend, slot: int) -> JSONResponse:
    erased = await _in_slot(backend, slot, lambda: backend.worker.engine.erase(slot))
    return JSONResponse({"id_slot": slot, "n_erased": erased})


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)
