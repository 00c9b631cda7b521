"""What a run exposes to the network, and a config that cannot work, refused before anything starts.

* `--sglang-api-key` reaches the embedded engines a run starts: they refuse requests without it (or with
  a wrong one), and the run's router sends it.
* Spawned trainer ranks (all on this machine) listen on loopback only: the torch.distributed rendezvous
  store at MASTER_PORT (torch binds its own store to every interface) and gloo's pair sockets. Checked
  on the rank processes' own listening sockets, read from /proc as `ss -ltnp` does.
* An unwritable `--save` exits 2 naming the flag before any process starts. The tests run as root, whom
  permission bits do not stop, so "unwritable" is what stops root too: a path under a regular file, a
  regular file, /proc.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_aio.inference.engines import open_engines
from miles_aio.models.tiny import build_tiny_llama
from miles_aio.trainer.actor import TrainerActor
from miles_aio.trainer.rank_main import LOCAL_RENDEZVOUS_ENV, loopback_rendezvous
from tests.helpers import make_config
from tests.trainer.helpers import tiny_model, train_cfg

pytestmark = pytest.mark.procs

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def _hex_address(field: str) -> tuple[str, int]:
    """`0100007F:1F90` (IPv4) or 32 hex digits (IPv6: four host-order words), a port: /proc/net/tcp's."""
    addr, port = field.split(":")
    raw = b"".join(bytes.fromhex(addr[i : i + 8])[::-1] for i in range(0, len(addr), 8))
    return str(ipaddress.ip_address(raw)), int(port, 16)


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == _LISTEN and cols[9] in inodes:
                found.add(_hex_address(cols[1]))
    return found


def _cmdlines() -> list[bytes]:
    out = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out.append(path.read_bytes())
        except OSError:  # the process exited meanwhile
            continue
    return out


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(i.decode().split("=", 1) for i in items if b"=" in i)


def test_proc_net_addresses_decode() -> None:
    """The decoder the loopback checks rely on (a wrong decoder would pass anything or nothing)."""
    assert _hex_address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _hex_address("00000000:0050") == ("0.0.0.0", 80)
    assert _hex_address("00000000000000000000000001000000:0016") == ("::1", 22)
    assert _hex_address("00000000000000000000000000000000:0016") == ("::", 22)


@pytest.mark.timeout(90)
def test_spawned_ranks_rendezvous_and_gloo_listen_on_loopback_only(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "model")
    seen: dict[int, set[tuple[str, int]]] = {}
    ports: dict[int, int] = {}

    async def main() -> None:
        cfg = train_cfg(model, actor_num_gpus_per_node=2, trainer_num_threads=1)
        async with TrainerActor.open(cfg, run_dir=tmp_path / "run") as actor:
            for rank, pid in enumerate(actor.pids):
                seen[rank] = listening_sockets(pid)
                ports[rank] = int(_environ(pid)["MASTER_PORT"])

    asyncio.run(main())
    assert len(seen) == 2
    assert ("127.0.0.1", ports[0]) in seen[0], seen  # rank 0 hosts the store, at MASTER_PORT
    for rank, sockets in seen.items():
        exposed = {s for s in sockets if not ipaddress.ip_address(s[0]).is_loopback}
        assert not exposed, f"rank {rank} listens off loopback: {sorted(exposed)}"


@given(
    flag=st.sampled_from([None, "1", "0", ""]),
    addr=st.sampled_from([None, "127.0.0.1", "localhost", "::1", "10.0.0.7", "node-3", "0.0.0.0"]),
    torchrun=st.booleans(),
)
def test_only_actor_spawned_ranks_at_a_loopback_address_pin_the_store(
    flag: str | None, addr: str | None, torchrun: bool
) -> None:
    env: dict[str, str] = {"TORCHELASTIC_USE_AGENT_STORE": "True"} if torchrun else {}
    if flag is not None:
        env[LOCAL_RENDEZVOUS_ENV] = flag
    if addr is not None:
        env["MASTER_ADDR"] = addr
    expect = flag == "1" and addr in ("127.0.0.1", "localhost", "::1")
    assert loopback_rendezvous(env) is expect
    plain: Mapping[str, str] = {k: v for k, v in env.items() if k != LOCAL_RENDEZVOUS_ENV}
    assert not loopback_rendezvous(plain)  # torchrun's ranks (no flag) keep torch's own rendezvous


@pytest.mark.timeout(90)
def test_embedded_engines_enforce_the_run_api_key_and_the_router_sends_it(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model", alphabet="0123456789", hidden_size=32, num_heads=2)
    cfg = make_config(tmp_path / "run", sglang_api_key="s3cret-key", rollout_num_gpus=1)

    async def main() -> None:
        async with open_engines(cfg, model_path=model) as router, httpx.AsyncClient() as http:
            (client,) = router.clients
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                resp = await http.get(f"{client.url}/model_info", headers=headers)
                assert resp.status_code == 401, resp.text
            assert (await http.get(f"{client.url}/health")).status_code == 200  # probes stay open
            info = await client.server_info()  # the router's client: authenticated
            assert info, info
            # The key is in the engines' environment, not on their command lines (world-readable).
            engines = [c for c in _cmdlines() if b"miles_aio.engine" in c]
            assert engines, "no engine process found"
            assert not [c for c in engines if b"s3cret-key" in c], engines

    asyncio.run(main())


@pytest.mark.parametrize("where", ["under-a-file", "a-file", "proc"])
def test_an_unwritable_save_dir_exits_2_naming_save_before_anything_starts(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from miles_aio.recipe import main
    from recipes.quickstart import RECIPE

    (tmp_path / "file").write_text("not a directory")
    save = {
        "under-a-file": tmp_path / "file" / "checkpoints",
        "a-file": tmp_path / "file",
        "proc": Path("/proc/miles-aio-no-such-dir/checkpoints"),
    }[where]
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(RECIPE, ["--run-dir", str(run_dir), "--save", str(save), "--num-rollout", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--save" in err and "not a writable directory" in err, err
    assert not run_dir.exists()  # nothing started: not even the warm start's model was built
