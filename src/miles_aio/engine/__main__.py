"""`python -m miles_aio.engine --model-path DIR`: see `cli.py`."""

import os
import sys

from miles_aio.engine.cli import main

# The tokenizers library forks a thread pool per process; one engine process needs none of it.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.exit(main())
