"""qmc-serve's member limit and key on vLLM's ``/v1/realtime`` (a WebSocket) and ``/v1/systemone`` routes.

Both run the engine (the realtime route one streaming generation at a time per connection, the
structured-decision route one engine request per question) with the server's design through the
drop-in, so both count against ``--max-members-in-flight``. The middleware runs in a Starlette app
as vLLM's ``--middleware`` puts it, over stand-ins for vLLM's two routes, driven by Starlette's test
client (its WebSocket handshake offers ASGI's denial-response extension, as uvicorn does).
"""

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
from qmc_sampler.server.middleware import QMCServeMiddleware
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient, WebSocketDenialResponse

KEY = {"Authorization": "Bearer k3y"}
LIMIT = 8


def served(held: int = 0):
    """A client of an app with qmc-serve's middleware (a key, a limit of 8 members, ``held`` of them in
    flight), the middleware's state, and the paths vLLM's stand-in routes were reached on."""
    reached: list[str] = []

    async def realtime(websocket):  # stands in for vLLM's: accept, then serve until the client leaves
        reached.append("/v1/realtime")
        await websocket.accept()
        await websocket.send_json({"type": "session.created"})
        await websocket.receive_text()
        await websocket.close()

    async def systemone(request):
        reached.append("/v1/systemone")
        return JSONResponse({"object": "structured_decision"})

    app = Starlette(routes=[WebSocketRoute("/v1/realtime", realtime), Route("/v1/systemone", systemone,
                                                                            methods=["POST"])],
                    middleware=[Middleware(QMCServeMiddleware)])  # fmt: skip
    app.state.args = SimpleNamespace(api_key=["k3y"], api_server_count=1, max_members_in_flight=LIMIT,
                                     queue_timeout=0.0, max_body_bytes=1 << 16, sampler="lattice", max_n=8,
                                     invocations_without_key=False)  # fmt: skip
    app.state.engine_client = None
    app.middleware_stack = middleware = app.build_middleware_stack()  # built now, to reach our layer
    while not isinstance(middleware, QMCServeMiddleware):
        middleware = middleware.app
    server = middleware._server({"app": app})
    if held:
        asyncio.run(server.limiter.acquire(held))
    return TestClient(app), server, reached


def test_a_realtime_connection_holds_one_member_while_it_is_open():
    client, server, reached = served(held=LIMIT - 1)
    with client.websocket_connect("/v1/realtime", headers=KEY) as ws:
        assert ws.receive_json() == {"type": "session.created"}
        assert server.limiter.in_flight == LIMIT  # the connection's member
        with pytest.raises(WebSocketDenialResponse) as denied:  # a second connection does not fit
            with client.websocket_connect("/v1/realtime", headers=KEY):
                pass
        assert denied.value.status_code == 429 and denied.value.headers["retry-after"] == "1"
        assert "--max-members-in-flight" in denied.value.json()["error"]["message"]
        assert reached == ["/v1/realtime"]  # vLLM's route never saw the refused one
        ws.send_text("bye")
    assert server.limiter.in_flight == LIMIT - 1  # given back when the connection ended


def test_a_realtime_connection_needs_the_key():
    client, server, reached = served()
    for headers in ({}, {"Authorization": "Bearer nope"}):
        with pytest.raises(WebSocketDenialResponse) as denied:
            with client.websocket_connect("/v1/realtime", headers=headers):
                pass
        assert denied.value.status_code == 401
    assert reached == [] and server.limiter.in_flight == 0


@pytest.mark.parametrize(("held", "status"), [(LIMIT - 3, 200), (LIMIT - 2, 429)])
def test_a_structured_decision_counts_one_member_per_question(held, status):
    client, server, reached = served(held=held)
    body = {"state": "a ticket", "questions": {q: {"type": "yes_no"} for q in ("urgent", "spam", "refund")}}
    response = client.post("/v1/systemone", json=body, headers=KEY)
    assert response.status_code == status, response.text
    assert reached == (["/v1/systemone"] if status == 200 else [])
    assert server.limiter.in_flight == held


def test_a_sampler_field_on_systemone_is_refused_naming_the_route():
    client, _, reached = served()
    body = {"state": "s", "questions": {"q": {"type": "yes_no"}}, "sampler": "lattice"}
    response = client.post("/v1/systemone", json=body, headers=KEY)
    assert response.status_code == 400 and "/v1/systemone" in response.json()["error"]["message"]
    assert reached == []
