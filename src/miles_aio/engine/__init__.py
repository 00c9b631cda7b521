"""The embedded CPU engine: a server program of its own, speaking SGLang's HTTP API over a plain-torch Llama.

`python -m miles_aio.engine --model-path DIR` (`--rollout-backend local` starts these through
`miles_aio.inference.local_launch`). Nothing here imports the controller side (`miles_aio.inference`); both
sides share only neutral modules: the wire protocol (`miles_aio.weight_broadcast` for torch.distributed weight
updates) and the chat-template renderer (`miles_aio.chat_template`, which the agent session server uses too).

    cli.py              `python -m miles_aio.engine` (flags, exit 2 on bad ones)
    server.py           process lifecycle: load, bind, the ready line, route table, auth, shutdown
    handlers.py         /generate, abort, pause/continue, flush, health, model/server info
    openai.py           /v1/completions, /v1/chat/completions, /v1/models (OpenAI-compatible)
    weight_handlers.py  weight updates from disk and by broadcast, version stamps
    state.py            ServerConfig, the state handlers share, reply helpers
    core.py             scheduler loop: continuous batching, pause/continue, abort, weight swaps, versions
    runner.py           one step on the compute thread; the prefix cache
    model.py            Llama forward over HF weight names, slot KV pool
    sampling.py         temperature/top-k/top-p/min-p, penalties, logit bias and the logprob rule
    protocol.py         request parsing with SGLang's field names
    spans.py            per-token weight versions as SGLang's spans (the SGLang stub's too; no torch)
    weights.py          checkpoint reading and update validation

Importing this package is cheap (no torch); import the submodules you need.
"""
