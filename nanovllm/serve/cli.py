"""``nanovllm serve MODEL [options]`` and ``python -m nanovllm.serve MODEL [options]``
(chapter 10).

Options on the command line override the YAML file given with ``--config`` (see
``config.py`` for its fields); ``--option NAME=VALUE`` sets any other ``EngineConfig``
field (the value is read as YAML: ``--option enforce_eager=true``); ``--speculative-config``
takes vLLM's JSON (speculative decoding). A bad option or config field exits with status 2
and a message naming it.
"""

from __future__ import annotations

import argparse
import json
import sys

from nanovllm.serve.config import ConfigError, load_config


def json_value(text: str) -> object:
    """A flag's JSON value, e.g. ``--speculative-config '{"method": "ngram", ...}'``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from None


# (flag, config field, type, help)
ENGINE_FLAGS = (
    ("--dtype", "dtype", str, "float32, bfloat16 or float16 (default: bf16 on GPU, fp32 on CPU)"),
    ("--quantization", "quantization", str, "int8 or fp8 weights (chapter 08)"),
    ("--tensor-parallel-size", "tensor_parallel_size", int, "GPUs per replica"),
    ("--max-num-seqs", "max_num_seqs", int, "sequences in one batch"),
    ("--max-model-len", "max_model_len", int, "longest prompt + completion, in tokens"),
    ("--load-format", "load_format", str, "safetensors, or dummy (random weights)"),
    ("--policy", "policy", str, "the scheduler's policy: fcfs, priority, fair or mixed"),
    ("--speculative-config", "speculative_config", json_value, "speculative decoding, vLLM's "
     "JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"),
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="a Hugging Face model folder (or in --config)")
    parser.add_argument("--config", help="a deployment's YAML file (nanovllm/serve/config.py)")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000)")
    parser.add_argument("--served-model-name", help="the model name clients send")
    parser.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                        help="accept this API key (repeatable); none: no authentication")
    for flag, dest, kind, text in ENGINE_FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, help=text)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="any other EngineConfig field (repeatable)")
    parser.add_argument("--max-queue-depth", type=int,
                        help="sequences that may wait beyond --max-num-seqs; then 429 with "
                        "Retry-After (default 1024)")
    parser.add_argument("--max-body-bytes", type=int,
                        help="a larger request body is refused unread with 413 (default 16 MiB)")
    parser.add_argument("--header-timeout", type=float,
                        help="seconds a connection gets to send a request's headers; then it "
                        "is closed (default 10)")
    parser.add_argument("--requests-per-second", type=float, help="per key (default: no limit)")
    parser.add_argument("--tokens-per-minute", type=int, help="per key (default: no limit)")
    parser.add_argument("--grace-period", type=float,
                        help="seconds requests in flight get after SIGTERM, while new ones "
                        "get 503; then exit 0 (default 30)")
    parser.add_argument("--log-level", help="uvicorn's log level (default info)")
    parser.add_argument("--in-process-engine", dest="engine_process", action="store_const",
                        const=False, help="step the engine on a thread of the server's own "
                        "process (default: an engine-core process of its own)")


def config_from_args(args: argparse.Namespace):
    import yaml

    engine = {}
    for item in args.option:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--option expects NAME=VALUE, got {item!r}")
        engine[name.strip()] = yaml.safe_load(value)
    limits = {"requests_per_second": args.requests_per_second,
              "tokens_per_minute": args.tokens_per_minute}
    fields = ("model", "host", "port", "served_model_name", "api_keys", "max_queue_depth",
              "max_body_bytes", "header_timeout", "grace_period", "log_level", "engine_process",
              *(dest for _, dest, _, _ in ENGINE_FLAGS))
    overrides = {name: getattr(args, name) for name in fields}
    overrides["engine"] = engine or None
    overrides["limits"] = {k: v for k, v in limits.items() if v is not None} or None
    return load_config(args.config, **overrides)


def run(args: argparse.Namespace) -> int:
    from nanovllm.serve.server import serve  # (imports the engine: after parsing, for --help)

    try:
        config = config_from_args(args)
        serve(config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # EngineConfig's checks (values of engine options)
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``nanovllm`` command: ``nanovllm serve MODEL [options]``."""
    parser = argparse.ArgumentParser(prog="nanovllm", description="nanovllm's command line")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser(
        "serve", help="an OpenAI-compatible server", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ))
    return run(parser.parse_args(argv))


def serve_main(argv: list[str] | None = None) -> int:
    """``python -m nanovllm.serve MODEL [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm.serve", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(parser)
    return run(parser.parse_args(argv))
