"""The embedded CPU engine (`--rollout-backend local`): SGLang's native HTTP API over a plain-torch Llama.

    cli.py          `python -m miles_aio.inference.local` (flags, exit 2 on bad ones)
    server.py       process lifecycle: load, bind, the ready line, route table, auth, shutdown
    handlers.py     /generate, abort, pause/continue, flush, health, model/server info
    weight_handlers.py  weight updates from disk and by broadcast, version stamps
    state.py        ServerConfig, the state handlers share, reply helpers
    engine.py       scheduler loop: continuous batching, pause/continue, abort, weight swaps, versions
    runner.py       one step on the compute thread; the prefix cache
    model.py        Llama forward over HF weight names, slot KV pool
    sampling.py     temperature/top-k/top-p/min-p and the logprob rule
    protocol.py     request parsing with SGLang's field names
    weights.py      checkpoint reading and update validation
    weight_sync.py  torch.distributed group + broadcast (SGLang's wire protocol)
    launch.py       `launch_local_engines`: start N engines as subprocesses, clean up on every exit path

Importing this package is cheap (no torch); import the submodules you need.
"""

from miles_aio.inference.local.launch import EngineStartError, launch_local_engines

__all__ = ["EngineStartError", "launch_local_engines"]
