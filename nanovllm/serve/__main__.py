"""``python -m nanovllm.serve MODEL [options]``: see ``nanovllm/serve/cli.py``."""

import sys

from nanovllm.serve.cli import serve_main

sys.exit(serve_main())
