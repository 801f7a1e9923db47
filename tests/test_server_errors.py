"""The server has one error type (server/errors.py's `ApiError`) and one JSON error shape, OpenAI's
`{"error": {"message", "type", "param", "code"}}`: no other exception class in localspec/server is answered to a
client, no module but errors.py builds an error body or an error status, and every error path answers in that shape
(the real app and guard over a scripted model, tests/helpers_serve.FakeTextModel)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from localspec.server.app import create_app
from localspec.server.guard import GuardSettings
from localspec.server.handling import ServerState
from tests.helpers_serve import fake_backend

SERVER = Path(__file__).resolve().parents[1] / "localspec" / "server"
# Statuses set outside errors.py that are not errors: /health's llama-server shape while the models load.
STATUS_OUTSIDE_ERRORS = {("app.py", "health")}
ERROR_FIELDS = {"message", "type", "param", "code"}
LLAMA_EXTRA_FIELDS = {"n_prompt_tokens", "n_ctx"}  # context_exceeded's, beside OpenAI's


def _exception_bases(tree: ast.Module) -> set[str]:
    """Names of classes in this module that derive from an exception (by the base's name)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                if name.endswith(("Error", "Exception")) or name in ("Exception", "BaseException"):
                    found.add(node.name)
    return found


def _enclosing_functions(tree: ast.Module) -> dict[ast.AST, str]:
    owner: dict[ast.AST, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                owner[inner] = node.name  # ast.walk goes outside in: the innermost function is the last
    return owner


def error_vocabulary_outside_errors_py(server: Path) -> list[str]:
    """Every place in `server` that defines, builds or answers an error other than through errors.py."""
    wrong = []
    for path in sorted(server.glob("*.py")):
        if path.name == "errors.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name in sorted(_exception_bases(tree)):
            wrong.append(f"{path.name}: exception class {name} (the server's one error type is errors.ApiError)")
        owner = _enclosing_functions(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                callee = node.func.id if isinstance(node.func, ast.Name) else \
                    node.func.attr if isinstance(node.func, ast.Attribute) else ""
                if callee == "error_body":
                    wrong.append(f"{path.name}:{node.lineno}: builds an error body (ApiError(...).body does)")
                status = [k for k in node.keywords if k.arg == "status_code"]
                if status and (path.name, owner.get(node, "")) not in STATUS_OUTSIDE_ERRORS:
                    wrong.append(f"{path.name}:{node.lineno}: sets an HTTP status (raise ApiError instead)")
            if isinstance(node, ast.Dict) and [k.value for k in node.keys if isinstance(k, ast.Constant)] == ["error"]:
                wrong.append(f"{path.name}:{node.lineno}: an {{'error': ...}} literal (ApiError(...).body is one)")
    return wrong


def test_no_error_vocabulary_outside_errors_py() -> None:
    assert error_vocabulary_outside_errors_py(SERVER) == []


def test_the_error_vocabulary_check_finds_another_error_type(tmp_path: Path) -> None:
    (tmp_path / "errors.py").write_text("class ApiError(Exception):\n    pass\n")
    (tmp_path / "route.py").write_text(
        "class RequestError(ValueError):\n    pass\n\n"
        "def answer(JSONResponse):\n    return JSONResponse({'error': {'message': 'no'}}, status_code=400)\n")
    found = error_vocabulary_outside_errors_py(tmp_path)
    assert any("RequestError" in line for line in found)
    assert any("sets an HTTP status" in line for line in found)
    assert any("literal" in line for line in found)


@pytest.fixture
def client() -> Iterator[TestClient]:
    backend = fake_backend(n_ctx=256)
    state = ServerState(model_id="fake", guard=GuardSettings(), strict_model=True)
    state.attach(backend)
    try:
        with TestClient(create_app(state), base_url="http://localhost", raise_server_exceptions=False) as c:
            yield c
    finally:
        backend.worker.shutdown(timeout=30)


def _one_shape(response, status: int) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= ERROR_FIELDS and set(error) - ERROR_FIELDS <= LLAMA_EXTRA_FIELDS, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    return error


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "param"), [
    ("GET", "/nowhere", {}, 404, None),  # Starlette's routing
    ("GET", "/v1/chat/completions", {}, 405, None),
    ("POST", "/v1/chat/completions", {"content": b"{}", "headers": {"Content-Type": "text/plain"}}, 415,
     "Content-Type"),  # the guard
    ("POST", "/v1/chat/completions", {"content": b"{", "headers": {"Content-Type": "application/json"}}, 400, None),
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "temprature": 1}}, 400, "temprature"),  # the schema
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "tools": "f"}}, 400, "tools"),  # tools.py
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "grammar": 5}}, 400, "grammar"),  # structured.py
    ("POST", "/v1/chat/completions", {"json": {**CHAT, "model": "other"}}, 404, "model"),  # handling.py
    ("POST", "/v1/completions", {"json": {"prompt": [99], "max_tokens": 2}}, 400, "prompt"),
    ("POST", "/v1/completions", {"json": {"prompt": "x " * 400, "max_tokens": 2}}, 400, None),  # context
    ("POST", "/infill", {"json": {"input_prefix": "a", "input_suffix": "b", "suffix": "c"}}, 400, "suffix"),
    ("GET", "/metrics", {}, 501, None),
    ("POST", "/slots/0?action=save", {"json": {"filename": "a.bin"}}, 501, None),  # slot_routes.py
    ("POST", "/models/load", {"json": {"model": "x"}}, 501, None),  # router.py
])
def test_every_error_path_answers_in_the_one_shape(client: TestClient, method: str, path: str, kwargs: dict,
                                                   status: int, param: str | None) -> None:
    error = _one_shape(client.request(method, path, **kwargs), status)
    assert error["param"] == param


def test_a_prompt_too_long_carries_llama_cpps_numbers(client: TestClient) -> None:
    error = _one_shape(client.post("/v1/completions", json={"prompt": list(range(1, 10)) * 40, "max_tokens": 2}),
                       400)
    assert error["code"] == "context_length_exceeded" and error["n_ctx"] == 256


def test_a_bug_in_a_route_is_a_500_in_the_one_shape(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = client.app.state.localspec.backend  # type: ignore[attr-defined]

    def broken(*args: object, **kwargs: object) -> list[int]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(backend.model, "tokenize", broken)
    error = _one_shape(client.post("/tokenize", json={"content": "hi"}), 500)
    assert (error["type"], error["code"], error["message"]) == ("server_error", "internal_error",
                                                                 "internal error: RuntimeError")


def test_the_guard_and_a_loading_server_answer_in_the_one_shape() -> None:
    state = ServerState(model_id="fake", api_key="k")  # no backend: still loading
    with TestClient(create_app(state), base_url="http://localhost") as client:
        assert _one_shape(client.post("/v1/completions", json={"prompt": "x"}), 401)["type"] == \
            "authentication_error"
        error = _one_shape(client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Api-Key": "k"}), 503)
        assert error["code"] == "model_loading"
    with TestClient(create_app(ServerState(model_id="fake")), base_url="http://evil.example") as client:
        assert _one_shape(client.get("/v1/models"), 403)["param"] == "Host"


def test_a_server_shutting_down_answers_in_the_one_shape() -> None:
    backend = fake_backend(n_ctx=256)
    state = ServerState(model_id="fake")
    state.attach(backend)
    backend.worker.shutdown(timeout=30)  # submits now fail with the worker's 503
    with TestClient(create_app(state), base_url="http://localhost") as client:
        error = _one_shape(client.post("/v1/chat/completions", json=CHAT), 503)
        assert (error["type"], error["code"]) == ("server_error", "shutdown")  # as a slot action's, a failed job's
        stream = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert stream.status_code == 503 and set(stream.json()["error"]) == ERROR_FIELDS

