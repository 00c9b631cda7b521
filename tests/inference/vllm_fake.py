"""`FakeVLLMServer`: a fake of the vLLM routes `VLLMClient` uses, at the HTTP seam (an httpx transport).

It behaves as vLLM 0.32 does where the client depends on it: `/pause?mode=abort` ends every request
(answered with its tokens so far, `finish_reason: "abort"`), `mode=keep` freezes them until `/resume`
or `/abort_requests`; a request that arrives while paused waits; `/abort_requests` of an id the server
does not know (yet) is a no-op. Every token it makes names the weights that made it: token id =
`TOKEN_BASE * weights + position`, so a test knows the truth that the client's versions must match.
Time passes by `asyncio.sleep` (`token_latency_s` per token, `network_latency_s` before a request
reaches the "server"), so the tests run on virtual time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

TOKEN_BASE = 1000
"""token // TOKEN_BASE: the weights generation (reloads so far) that produced the token."""


_TRANSFER_ROUTES = frozenset(
    {
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    }
)


@dataclass(eq=False)
class _Request:
    rid: str
    aborted: bool = False
    finish: str = "length"
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class FakeVLLMServer:
    """A fake vLLM server (dev mode) for one `VLLMClient`; `transport()` is what the client is given."""

    def __init__(self, *, token_latency_s: float = 0.01, network_latency_s: float = 0.0) -> None:
        self.token_latency_s = token_latency_s
        self.network_latency_s = network_latency_s
        self.paused: str | None = None
        self.weights = 0
        """Reloads so far (`/collective_rpc reload_weights`)."""
        self.loaded: list[str] = []
        self.version = "default"
        self.refuse_flushes = 0
        """The next this many `/reset_prefix_cache` answer {"success": false}."""
        self.fail_status: dict[str, int] = {}
        """path → HTTP status to answer instead (e.g. {"/pause": 500})."""
        self.disconnects = 0
        """The next this many calls are cut before any answer (httpx.RemoteProtocolError)."""
        self.weight_transfer = True
        """Started with `--weight-transfer-config`: False answers its routes as vLLM does without it."""
        self.transfer_group: dict[str, Any] | None = None
        """The `init_info` of the NCCL group the workers joined (`/init_weight_transfer_engine`)."""
        self.leaked_groups = 0
        """Joins while still in a group (vLLM would leak the old NCCL communicator)."""
        self.updating = False
        self.received: list[dict[str, Any]] = []
        """The `update_info` of each `/update_weights` (what the broadcast would have delivered)."""
        self.requests: dict[str, _Request] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        """(path, body or query) of every call, in order."""
        self._resumed = asyncio.Event()
        self._resumed.set()

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body: dict[str, Any] = json.loads(request.content) if request.content else {}
        self.calls.append((path, body or dict(request.url.params)))
        if self.disconnects:
            self.disconnects -= 1
            raise httpx.RemoteProtocolError("Server disconnected", request=request)
        if path in self.fail_status:
            return httpx.Response(self.fail_status[path], json={"error": {"message": "fake failure"}})
        q = request.url.params
        if path == "/v1/completions":
            return await self._complete(body)
        if path == "/pause":
            self.paused = q.get("mode", "abort")
            self._resumed.clear()
            if self.paused == "abort":
                for r in self.requests.values():
                    r.aborted = True
                    r.wake.set()
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            self.paused = None
            self._resumed.set()
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/abort_requests":
            ids = body.get("request_ids") or list(self.requests)
            for rid in ids:
                if (known := self.requests.get(rid)) is not None:
                    known.aborted = True
                    known.wake.set()
            return httpx.Response(200, json={"status": "aborted", "aborted": len(ids)})
        if path == "/reset_prefix_cache":
            ok = self.refuse_flushes == 0
            self.refuse_flushes = max(0, self.refuse_flushes - 1)
            return httpx.Response(200, json={"success": ok})
        if path == "/collective_rpc":
            assert body["method"] == "reload_weights", body
            self.weights += 1
            self.loaded.append(body["kwargs"]["weights_path"])
            return httpx.Response(200, json={"results": [None]})
        if path in _TRANSFER_ROUTES:
            return self._transfer(path, body)
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return httpx.Response(200, json={"success": True, "new_version": self.version})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0-fake"})
        if path == "/server_info":
            config = "model='m', tensor_parallel_size=1, enable_prefix_caching=True, seed=0"
            return httpx.Response(200, json={"vllm_config": config})
        return httpx.Response(404, json={"detail": "Not Found"})

    def _transfer(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """vLLM 0.32's weight-transfer routes, with the order its worker enforces (gpu_worker.py); a
        worker's RuntimeError is a 500 there."""

        def refuse(why: str) -> httpx.Response:
            return httpx.Response(500, json={"error": {"message": why}})

        if not self.weight_transfer:
            return refuse("Weight transfer not configured. Please set weight_transfer_config.")
        if path == "/init_weight_transfer_engine":
            # vLLM's worker replaces a communicator it still holds without destroying it
            self.leaked_groups += self.transfer_group is not None
            self.transfer_group = body["init_info"]
            return httpx.Response(200, json={"message": "Weight transfer initialized"})
        if path == "/shutdown_weight_transfer_engine":
            if self.updating:
                return refuse("Cannot shut down weight transfer during an active weight update.")
            self.transfer_group = None
            return httpx.Response(200, json={"message": "Weight transfer shut down"})
        if self.transfer_group is None:
            return refuse("Weight transfer engine not initialized.")
        if path == "/start_weight_update":
            if self.updating:
                return refuse("A weight update is already in progress.")
            self.updating = True
            return httpx.Response(200, json={"message": "Weight update started"})
        if not self.updating:
            return refuse(f"start_weight_update must be called before {path.strip('/')}.")
        if path == "/update_weights":
            self.received.append(body["update_info"])
            return httpx.Response(200, json={"message": "Weights updated"})
        self.updating = False  # /finish_weight_update
        self.weights += 1
        return httpx.Response(200, json={"message": "Weight update finished"})

    async def _complete(self, body: dict[str, Any]) -> httpx.Response:
        await asyncio.sleep(self.network_latency_s)  # on its way: unknown to /abort_requests until here
        rid = f"cmpl-{body.get('request_id', 'x')}-0"
        req = self.requests[rid] = _Request(rid)
        if body.get("stream"):
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, content=self._sse(req, body)
            )
        try:
            ids = [token async for token in self._tokens(req, body)]
        finally:
            del self.requests[rid]
        choice = {
            "index": 0,
            "text": "x" * len(ids),
            "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": ["x"] * len(ids)},
            "finish_reason": req.finish,
            "token_ids": ids,
        }
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
        }
        return httpx.Response(200, json={"id": rid, "choices": [choice], "usage": usage})

    async def _sse(self, req: _Request, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """vLLM's streamed completion: a chunk per token (delta `token_ids`, their logprobs), the finish
        reason on a last chunk (none at all for a request that made no token), the usage chunk, [DONE]."""

        def event(data: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(data)}\n\n".encode()

        def chunk(ids: list[int], finish: str | None) -> bytes:
            lps = {"token_logprobs": [-0.5] * len(ids), "tokens": ["x"] * len(ids)}
            choice = {
                "index": 0,
                "text": "x" * len(ids),
                "logprobs": lps,
                "finish_reason": finish,
                "token_ids": ids,
            }
            return event({"id": req.rid, "object": "text_completion", "choices": [choice]})

        made = 0
        try:
            async for token in self._tokens(req, body):
                made += 1
                yield chunk([token], None)
        finally:
            del self.requests[req.rid]
        if made:
            yield chunk([], req.finish)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": made, "total_tokens": 0}
        yield event({"id": req.rid, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    async def _tokens(self, req: _Request, body: dict[str, Any]) -> AsyncIterator[int]:
        """The tokens of one request as the fake makes them; `req.finish` says why it ended."""
        prompt: list[int] = body["prompt"]
        stop_ids = set(body.get("stop_token_ids") or [])
        made = 0
        req.finish = "length"
        while made < body["max_tokens"]:
            while not self._resumed.is_set() and not req.aborted:  # paused: frozen (or not yet run)
                await _first(self._resumed.wait(), req.wake.wait())
            if req.aborted:
                req.finish = "abort"
                return
            await asyncio.sleep(self.token_latency_s)
            if _aborted(req):  # aborted during this step: its token is not made
                req.finish = "abort"
                return
            if not self._resumed.is_set():
                continue  # paused during this step (keep): the step is redone after the resume
            token = TOKEN_BASE * self.weights + (len(prompt) + made) % TOKEN_BASE
            made += 1
            yield token
            if token in stop_ids:
                req.finish = "stop"
                return


def _aborted(req: _Request) -> bool:
    """`req.aborted`, read after an await (a plain read there would look unchangeable to mypy)."""
    return req.aborted


async def _first(*aws: Any) -> None:
    """Wait until the first of `aws` is done; cancel the others (all owned by one TaskGroup)."""
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(a, name="fake-vllm-wait") for a in aws]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if t not in done:
                t.cancel()
