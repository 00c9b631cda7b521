"""Formats of the trainer: the controller ↔ rank channel (handshake bytes, message frames, batches) and
the files ranks write (HF model directories, optimizer state). No socket I/O here.

Handshake (fixed-size raw bytes; nothing is parsed before the peer has proven it holds the secret):

    controller → rank   HELLO    = b"MAIO1" ‖ server_nonce[32]
    rank → controller   RESPONSE = client_nonce[32] ‖ rank:u32 ‖ HMAC(secret, "rank" ‖ sn ‖ cn ‖ rank)[32]
    controller → rank   PROOF    = HMAC(secret, "controller" ‖ cn ‖ sn)[32]

HMAC-SHA256 with a per-run random secret: the rank proves itself before the controller decodes a frame,
and the controller proves itself before the rank does (a rank executes what it is told, so it must not
obey an impostor). Fresh nonces on both sides make replayed transcripts useless.

Frames after the handshake: `header_len:u32 ‖ blob_len:u64 ‖ header (UTF-8 JSON) ‖ blob`. The header is
a JSON object; its `"tensors"` entry lists `[name, dtype, shape, offset, nbytes]` of raw tensor bytes in
the blob (little-endian, C order, each 64-byte aligned). No pickle anywhere: decoding never runs code.

Messages are typed: one frozen msgspec Struct per command, its `op` tag in the header, its fields the
rest of the header, at most one field of tensors (`Tensors`) in the blob. Controller → rank: a
`Request[R]` subclass per command (`InitRequest`, `TrainRequest`, `LogprobsRequest`, `GetWeightsRequest`,
`WeightMetaRequest`, `SaveHFRequest`, `BcastInitRequest`, `BcastBucketRequest`, `BcastDestroyRequest`,
`SaveRequest`, `LoadRequest`, `RemoveHFRequest`, `ShutdownRequest`; the union `AnyRequest`), where `R` is
the `Reply` it is answered with (`op: "ok"`), so `TrainerActor` sends a `TrainRequest` and gets a
`TrainReply`. Rank → controller: that reply, a `Heartbeat` (no reply to anything: the rank is alive), or a
`RankFailure` (`op: "error"`: type, message, traceback; the rank exits non-zero right after). Decoding
(`decode_request`, `decode_as`) validates every field's type with msgspec: a malformed message is a
`ProtocolError`, and nothing in it runs code.

Files: weights are HF directories (config/tokenizer copied from the initial checkpoint +
`model.safetensors`, HF names), written to a temporary sibling and renamed. Optimizer state is
safetensors (tensors keyed `fqn\nkey`) plus JSON (param groups, scalars): a checkpoint loads no pickle.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
import os
import secrets
import shutil
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final, Generic, TypeVar, cast, get_args

import msgspec
import torch
from safetensors.torch import load_file, save_file

from miles_aio._durable import fsync_dir, fsync_path
from miles_aio.trainer.losses import TrainRow

__all__ = [
    "BATCH_FIELDS",
    "FRAME_PREFIX",
    "HELLO_LEN",
    "MAX_BLOB_BYTES",
    "MAX_HEADER_BYTES",
    "PROOF_LEN",
    "RESPONSE_LEN",
    "SECRET_ENV",
    "AnyRequest",
    "BcastBucketRequest",
    "BcastDestroyRequest",
    "BcastInitRequest",
    "BcastReply",
    "GetWeightsRequest",
    "Heartbeat",
    "InitReply",
    "InitRequest",
    "LoadReply",
    "LoadRequest",
    "LogprobsReply",
    "LogprobsRequest",
    "Message",
    "ProtocolError",
    "RankFailure",
    "RemoveHFRequest",
    "Reply",
    "Request",
    "SaveHFRequest",
    "SaveRequest",
    "ShutdownRequest",
    "Tensors",
    "TrainReply",
    "TrainRequest",
    "WeightMetaReply",
    "WeightMetaRequest",
    "WeightsReply",
    "Wire",
    "check_proof",
    "check_response",
    "controller_proof",
    "decode_as",
    "decode_batch",
    "decode_frame",
    "decode_request",
    "encode_batch",
    "encode_frame",
    "hello",
    "load_optim_state",
    "new_secret",
    "parse_frame_prefix",
    "prune_snapshots",
    "rank_response",
    "read_hf_dir",
    "remove_hf_dir",
    "reply_to",
    "save_optim_state",
    "secret_from_env",
    "to_wire",
    "weight_buckets",
    "write_hf_dir",
]

SECRET_ENV: Final = "MILES_AIO_TRAINER_SECRET"
"""Environment variable carrying the run's secret (hex) to rank processes."""
_MAGIC: Final = b"MAIO1"
_NONCE: Final = 32
_MAC: Final = 32
HELLO_LEN: Final = len(_MAGIC) + _NONCE
RESPONSE_LEN: Final = _NONCE + 4 + _MAC
PROOF_LEN: Final = _MAC
FRAME_PREFIX: Final = struct.Struct("!IQ")
MAX_HEADER_BYTES: Final = 64 * 1024**2
MAX_BLOB_BYTES: Final = 1 << 40
_ALIGN: Final = 64


class ProtocolError(Exception):
    """A malformed handshake or frame (the connection is dropped)."""


@dataclass(slots=True)
class Message:
    """One frame: a JSON header and named tensors."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def op(self) -> str:
        return str(self.header.get("op", ""))


# -- secrets and handshake -------------------------------------------------------------------------------
def new_secret() -> bytes:
    return secrets.token_bytes(32)


def secret_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    raw = (os.environ if env is None else env).get(SECRET_ENV)
    if not raw:
        return None
    try:
        secret = bytes.fromhex(raw)
    except ValueError as exc:
        raise ProtocolError(f"{SECRET_ENV} must be hex") from exc
    if len(secret) < 16:
        raise ProtocolError(f"{SECRET_ENV} must hold at least 16 bytes")
    return secret


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def hello() -> tuple[bytes, bytes]:
    """(server_nonce, the HELLO bytes to send)."""
    nonce = secrets.token_bytes(_NONCE)
    return nonce, _MAGIC + nonce


def rank_response(secret: bytes, hello_bytes: bytes, rank: int) -> tuple[bytes, bytes]:
    """Rank side: (client_nonce, the RESPONSE bytes) for a HELLO."""
    if len(hello_bytes) != HELLO_LEN or not hello_bytes.startswith(_MAGIC):
        raise ProtocolError("not a miles_aio controller (bad hello)")
    server_nonce = hello_bytes[len(_MAGIC) :]
    client_nonce = secrets.token_bytes(_NONCE)
    rank_bytes = struct.pack("!I", rank)
    return client_nonce, client_nonce + rank_bytes + _mac(
        secret, b"rank", server_nonce, client_nonce, rank_bytes
    )


def check_response(secret: bytes, server_nonce: bytes, response: bytes) -> tuple[int, bytes]:
    """Controller side: verify a RESPONSE (constant time) → (rank, client_nonce); ProtocolError if bad."""
    if len(response) != RESPONSE_LEN:
        raise ProtocolError("short handshake response")
    client_nonce, rank_bytes, mac = response[:_NONCE], response[_NONCE : _NONCE + 4], response[_NONCE + 4 :]
    if not hmac.compare_digest(mac, _mac(secret, b"rank", server_nonce, client_nonce, rank_bytes)):
        raise ProtocolError("handshake MAC mismatch (wrong secret)")
    (rank,) = struct.unpack("!I", rank_bytes)  # only now, after the MAC held
    return rank, client_nonce


def controller_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _mac(secret, b"controller", client_nonce, server_nonce)


def check_proof(secret: bytes, hello_bytes: bytes, client_nonce: bytes, proof: bytes) -> None:
    """Rank side: raise ProtocolError unless the controller proved it holds the secret."""
    server_nonce = hello_bytes[len(_MAGIC) :]
    if not hmac.compare_digest(proof, controller_proof(secret, server_nonce, client_nonce)):
        raise ProtocolError("the controller could not prove the secret")


# -- frames ------------------------------------------------------------------------------------------------
def encode_frame(
    header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None
) -> list[bytes | memoryview]:
    """A message as buffers to write in order (tensor bytes are not copied into one big buffer)."""
    entries: list[list[Any]] = []
    chunks: list[bytes | memoryview] = []
    offset = 0
    for name, t in (tensors or {}).items():
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        pad = -offset % _ALIGN
        if pad:
            chunks.append(bytes(pad))
            offset += pad
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes])
        if nbytes:
            # A uint8 view exposes the raw bytes of any dtype (bf16 included, which numpy lacks).
            chunks.append(t.reshape(-1).view(torch.uint8).numpy().data)  # no copy
        offset += nbytes
    head = json.dumps({**header, "tensors": entries}, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    return [FRAME_PREFIX.pack(len(head), offset), head, *chunks]


def parse_frame_prefix(prefix: bytes) -> tuple[int, int]:
    head_len, blob_len = FRAME_PREFIX.unpack(prefix)
    if head_len > MAX_HEADER_BYTES or blob_len > MAX_BLOB_BYTES:
        raise ProtocolError(f"frame too large: header {head_len} B, blob {blob_len} B")
    return head_len, blob_len


def decode_frame(head: bytes, blob: bytearray) -> Message:
    """Parse a header and rebuild its tensors over `blob` (zero-copy; `blob` must stay alive)."""
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise ProtocolError(f"bad frame header: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not an object")
    tensors: dict[str, torch.Tensor] = {}
    for entry in header.pop("tensors", []):
        try:
            name, dtype_name, shape, offset, nbytes = entry
            shape, offset, nbytes = [int(d) for d in shape], int(offset), int(nbytes)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"bad tensor entry {entry!r}") from exc
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"unknown dtype {dtype_name!r}")
        if offset < 0 or offset + nbytes > len(blob):
            raise ProtocolError(f"tensor {name!r} lies outside the frame")
        if min(shape, default=0) < 0 or math.prod(shape) * dtype.itemsize != nbytes:
            raise ProtocolError(f"tensor {name!r}: {nbytes} bytes for shape {shape} of {dtype_name}")
        if nbytes == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(blob, dtype=torch.uint8, count=nbytes, offset=offset)
        tensors[name] = raw.view(dtype).reshape(shape)
    return Message(header, tensors)


# -- typed messages --------------------------------------------------------------------------------------
Tensors = dict[str, torch.Tensor]
"""Named tensors: the type of a message's one field that travels in the frame's blob, not its header."""


class Reply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="op", tag="ok"):
    """A rank's answer to one request (`op: "ok"`); this base class itself is the empty answer."""


R = TypeVar("R", bound=Reply)


class Request(
    msgspec.Struct, Generic[R], frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="op"
):
    """A command to the ranks; `R` is its reply type (`reply_type`, taken from the class's base)."""

    reply_type: ClassVar[type[Reply]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        (base,) = cls.__orig_bases__  # type: ignore[attr-defined]  # Request[SomeReply]
        (reply,) = get_args(base)
        if not (isinstance(reply, type) and issubclass(reply, Reply)):
            raise TypeError(f"{cls.__name__}: a request names its reply type, as Request[SomeReply]")
        cls.reply_type = reply

    @property
    def op(self) -> str:
        return str(type(self).__struct_config__.tag)

    def decode_reply(self, msg: Message) -> R:
        """This request's reply, from a rank's `ok` frame."""
        return decode_as(msg, cast("type[R]", self.reply_type))


def reply_to(req: Request[R], reply: R) -> R:
    """`reply`, checked by mypy to be the reply type `req` is answered with (the ranks' dispatch uses it)."""
    return reply


class InitReply(Reply, frozen=True):
    dp_rank: int
    dp_size: int
    shard_source: int
    """The rank that receives this rank's training shard from the controller and passes it on to the
    other ranks of its model-parallel group (itself when it is that rank, or has no group)."""
    wrapper: str
    device: str
    threads: int


class TrainReply(Reply, frozen=True):
    metrics: dict[str, float]


class LogprobsReply(Reply, frozen=True):
    logps: Tensors
    """Row i's response-token log-probs under the name str(i)."""


class WeightsReply(Reply, frozen=True):
    weights: Tensors
    """Every HF tensor (on rank 0; other ranks send none)."""


class WeightMetaReply(Reply, frozen=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    master_address: str
    master_port: int
    """A free port on rank 0's host for the weight-update group it will host."""


class BcastReply(Reply, frozen=True):
    failed: str | None = None
    """Why the weight-update group's rendezvous or broadcast failed on rank 0 (the rank lives on)."""


class LoadReply(Reply, frozen=True):
    step: int


class InitRequest(Request[InitReply], frozen=True, tag="init"):
    config: str
    """`TrainConfig.to_json()`."""


class TrainRequest(Request[TrainReply], frozen=True, tag="train"):
    step: int
    num_tokens: list[float]
    """Loss-mask tokens of each optimizer step over all ranks (the loss is a global token mean)."""
    batch: Tensors
    """This rank's shard (`encode_batch`)."""


class LogprobsRequest(Request[LogprobsReply], frozen=True, tag="logprobs"):
    batch: Tensors


class GetWeightsRequest(Request[WeightsReply], frozen=True, tag="get_weights"):
    pass


class WeightMetaRequest(Request[WeightMetaReply], frozen=True, tag="weight_meta"):
    master_address: str | None = None
    """The address the engines dial for the group (default: rank 0's own)."""


class SaveHFRequest(Request[Reply], frozen=True, tag="save_hf"):
    """Rank 0 writes an HF model directory (a disk sync, an export)."""

    path: str
    keep: int = 0
    """Prune the parent directory to this many snapshots afterwards (0: prune nothing)."""


class BcastInitRequest(Request[BcastReply], frozen=True, tag="bcast_init"):
    backend: str
    master_address: str
    master_port: int
    world_size: int
    group_name: str
    timeout_s: float
    protocol: str = "torch"
    """"torch": SGLang's torch.distributed group (`weight_broadcast`); "vllm": vLLM's own NCCL group
    (`trainer.vllm_transfer`)."""


class BcastBucketRequest(Request[BcastReply], frozen=True, tag="bcast_bucket"):
    names: list[str]


class BcastDestroyRequest(Request[Reply], frozen=True, tag="bcast_destroy"):
    pass


class SaveRequest(Request[Reply], frozen=True, tag="save"):
    step: int
    directory: str


class LoadRequest(Request[LoadReply], frozen=True, tag="load"):
    directory: str


class RemoveHFRequest(Request[Reply], frozen=True, tag="remove_hf"):
    paths: list[str]


class ShutdownRequest(Request[Reply], frozen=True, tag="shutdown"):
    pass


AnyRequest = (
    InitRequest
    | TrainRequest
    | LogprobsRequest
    | GetWeightsRequest
    | WeightMetaRequest
    | SaveHFRequest
    | BcastInitRequest
    | BcastBucketRequest
    | BcastDestroyRequest
    | SaveRequest
    | LoadRequest
    | RemoveHFRequest
    | ShutdownRequest
)
"""Every command a rank obeys (its loop matches on this union; mypy checks that none is left out)."""
_REQUESTS: Final[dict[str, type[AnyRequest]]] = {
    str(cls.__struct_config__.tag): cls for cls in get_args(AnyRequest)
}


class Heartbeat(msgspec.Struct, frozen=True, tag_field="op", tag="heartbeat"):
    """Rank → controller, unprompted, every --trainer-heartbeat-timeout-s / 6: the rank is alive."""


class RankFailure(msgspec.Struct, frozen=True, kw_only=True, tag_field="op", tag="error"):
    """Rank → controller: the exception a rank is about to exit with."""

    type: str = ""
    message: str = ""
    traceback: str = ""


Wire = Request[Any] | Reply | Heartbeat | RankFailure
"""Anything sent over the channel."""


@functools.cache
def _tensor_field(cls: type[msgspec.Struct]) -> str | None:
    names = [f.name for f in msgspec.structs.fields(cls) if f.type == Tensors]
    if len(names) > 1:
        raise TypeError(f"{cls.__name__}: at most one field of tensors per message, got {names}")
    return names[0] if names else None


def to_wire(msg: Wire) -> tuple[dict[str, Any], Tensors]:
    """A message as a frame's header (its `op` tag and JSON fields) and tensors (its `Tensors` field)."""
    cls = type(msg)
    tensor_field = _tensor_field(cls)
    config = cls.__struct_config__
    header: dict[str, Any] = {} if config.tag_field is None else {config.tag_field: config.tag}
    tensors: Tensors = {}
    for f in msgspec.structs.fields(cls):
        value = getattr(msg, f.name)
        if f.name == tensor_field:
            tensors = value
        else:
            header[f.encode_name] = msgspec.to_builtins(value)
    return header, tensors


S = TypeVar("S", bound=msgspec.Struct)


def decode_as(msg: Message, cls: type[S]) -> S:
    """A frame as a message of type `cls`: every field type-checked, its tag too; ProtocolError if not."""
    obj: dict[str, Any] = dict(msg.header)
    tensor_field = _tensor_field(cls)
    if tensor_field is not None:
        obj[tensor_field] = msg.tensors
    elif msg.tensors:
        raise ProtocolError(f"{msg.op!r}: a {cls.__name__} carries no tensors, got {sorted(msg.tensors)}")
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed {msg.op!r} message ({cls.__name__}): {exc}") from exc


def decode_request(msg: Message) -> AnyRequest:
    """A controller's frame as the command it names (ProtocolError for an unknown or malformed one)."""
    cls = _REQUESTS.get(msg.op)
    if cls is None:
        raise ProtocolError(f"unknown command {msg.op!r}")
    return decode_as(msg, cls)


# -- training batches ------------------------------------------------------------------------------------
BATCH_FIELDS: Final = {
    "tokens": torch.int64,
    "lengths": torch.int64,
    "response_lengths": torch.int64,
    "loss_mask": torch.float32,
    "rollout_logp": torch.float32,
    "advantages": torch.float64,
    "opt_steps": torch.int64,
}
"""The flat tensors of an encoded shard, in order, and their dtypes."""


def encode_batch(rows: Sequence[TrainRow]) -> dict[str, torch.Tensor]:
    """A rank's shard as flat tensors (ids, lengths, per-token arrays concatenated), `BATCH_FIELDS`."""
    if not rows:
        raise ValueError("empty shard")
    return {
        "tokens": torch.cat([r.tokens.to(torch.int64) for r in rows]),
        "lengths": torch.tensor([r.tokens.numel() for r in rows], dtype=torch.int64),
        "response_lengths": torch.tensor([r.response_length for r in rows], dtype=torch.int64),
        "loss_mask": torch.cat([r.loss_mask.to(torch.float32) for r in rows]),
        "rollout_logp": torch.cat([r.rollout_logp.to(torch.float32) for r in rows]),
        "advantages": torch.tensor([r.advantage for r in rows], dtype=torch.float64),
        "opt_steps": torch.tensor([r.opt_step for r in rows], dtype=torch.int64),
    }


def decode_batch(t: Mapping[str, torch.Tensor]) -> list[TrainRow]:
    try:
        lengths, resp = t["lengths"].tolist(), t["response_lengths"].tolist()
        tokens = torch.split(t["tokens"], lengths)
        masks = torch.split(t["loss_mask"], resp)
        logps = torch.split(t["rollout_logp"], resp)
        advs, steps = t["advantages"].tolist(), t["opt_steps"].tolist()
        return [
            TrainRow(tokens[i], resp[i], masks[i], logps[i], advs[i], steps[i]) for i in range(len(lengths))
        ]
    except (KeyError, RuntimeError) as exc:
        raise ProtocolError(f"malformed batch: {exc}") from exc


# -- disk formats (checkpoints and weight snapshots; safetensors + JSON, no pickle) -----------------------
_WEIGHT_FILES: Final = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEXES: Final = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def write_hf_dir(
    tensors: Mapping[str, torch.Tensor], out: Path, *, source: Path, durable: bool = False
) -> None:
    """An HF model directory at `out`: `source`'s config/tokenizer files + `model.safetensors`, written
    to a temporary sibling and renamed, so a reader (an engine) never sees a half-written snapshot.
    `durable` (a checkpoint's model) fsyncs every file and the renames, so that it survives a crash."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, tmp / f.name)
    contiguous = {k: v.detach().contiguous() for k, v in tensors.items()}
    # transformers refuses safetensors files without the "format" marker
    save_file(contiguous, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if durable:
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_dir(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    if durable:
        fsync_dir(out.parent)


def remove_hf_dir(out: Path) -> None:
    """Delete what `write_hf_dir(..., out)` wrote, finished or not (its temporary sibling too)."""
    shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)


def read_hf_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors directory (single file or shards)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def prune_snapshots(directory: Path, keep: int) -> None:
    """Delete all but the `keep` newest snapshot directories under `directory`."""
    snaps = [p for p in directory.iterdir() if p.is_dir() and not p.name.endswith(".tmp")]
    snaps.sort(key=lambda p: p.stat().st_mtime)
    for old in snaps[: max(0, len(snaps) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def save_optim_state(state: Mapping[str, Any], stem: Path) -> None:
    """A full optimizer state dict as `<stem>.safetensors` (tensors, keyed `param\\nkey`) and
    `<stem>.json` (param groups and non-tensor state)."""
    flat: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                flat[f"{param}\n{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(param), {})[key] = value
    save_file(flat, str(stem.with_suffix(".safetensors")))
    rest = {"param_groups": state["param_groups"], "scalars": scalars}
    stem.with_suffix(".json").write_text(json.dumps(rest))


def load_optim_state(stem: Path) -> dict[str, Any]:
    """Inverse of `save_optim_state` (parameter keys come back as strings)."""
    rest = json.loads(stem.with_suffix(".json").read_text())
    state: dict[str, dict[str, Any]] = {param: dict(v) for param, v in rest["scalars"].items()}
    for key, value in load_file(str(stem.with_suffix(".safetensors"))).items():
        param, name = key.split("\n", 1)
        state.setdefault(param, {})[name] = value
    return {"state": state, "param_groups": rest["param_groups"]}


def weight_buckets(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], limit: int
) -> list[list[str]]:
    """Tensor names in order, grouped so each group holds ≤ `limit` bytes (a bigger tensor goes alone)."""
    out: list[list[str]] = [[]]
    size = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        nbytes = getattr(torch, dtype).itemsize * math.prod(shape)
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return out
