"""The logic behind ``tools/run_text_generation_server.py`` and ``tools/generate.py``: flags -> configs ->
model from the checkpoint -> serve, or generate once. User errors are one ``error:`` line, exit 2."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys

from ..arguments import exit_on_config_error
from ..parallel.dims import ConfigError
from .server import GenerationServer, RequestError, ServerLimits, broadcast_from_rank0, follow, parse_request
from .setup import build_generation_parser, configs_for_generation, load_generator
from .text import generate_text

__all__ = ["generate_main", "server_main"]


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); choose another "
                              "--port or --host") from None


def _server_limits(args) -> ServerLimits:
    try:
        return ServerLimits.from_args(args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def server_main(argv=None) -> None:
    parser = build_generation_parser("run_text_generation_server.py",
                                     "Serve text generation from a checkpoint over HTTP (Megatron-LM's PUT /api).",
                                     server=True)
    args = parser.parse_args(argv)
    cfg = exit_on_config_error(lambda: configs_for_generation(args, _world_size()), once_per_node=True)
    limits = exit_on_config_error(lambda: _server_limits(args))
    if int(os.environ.get("RANK", "0")) == 0:
        exit_on_config_error(lambda: _check_port(args.host, args.port))
    session = exit_on_config_error(lambda: load_generator(cfg, args))
    try:
        if session.parallel.rank == 0:
            GenerationServer(session, args.host, args.port, limits).serve_forever()
        else:
            follow(session)
    except KeyboardInterrupt:
        pass


def _read_prompts(args) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    if args.prompt_file in (None, "-"):
        lines = sys.stdin.read().splitlines()
    else:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ConfigError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
    return [line for line in lines if line.strip()]


def generate_main(argv=None) -> None:
    parser = build_generation_parser("generate.py", "Generate text from a checkpoint (prompts from --prompts, "
                                     "--prompt-file or standard input).", cli=True)
    args = parser.parse_args(argv)
    cfg = exit_on_config_error(lambda: configs_for_generation(args, _world_size()), once_per_node=True)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    prompts = exit_on_config_error(lambda: _read_prompts(args)) if rank0 else None
    with contextlib.redirect_stdout(sys.stderr):  # standard output carries the generations only
        session = exit_on_config_error(lambda: load_generator(cfg, args))
    prompts = broadcast_from_rank0(prompts, session)
    if not prompts:
        _fail("no prompts: pass --prompts, --prompt-file, or text on standard input (one prompt per line)")
    gen = session.generator
    body = {"tokens_to_generate": args.num_tokens_to_generate, "temperature": args.temperature,
            "top_k": args.top_k, "top_p": args.top_p, "logprobs": args.return_log_probs,
            "random_seed": args.seed, "stop_strings": args.stop_strings}
    if args.no_stop_at_eod:
        body["stop_token"] = -1
    for start in range(0, len(prompts), gen.max_batch):
        chunk = prompts[start: start + gen.max_batch]
        try:
            req, tokens = parse_request({"prompts": chunk, **body}, session.tokenizer, max_prompts=gen.max_batch,
                                        max_sequence=gen.max_sequence)
        except RequestError as e:
            _fail(_as_flag(str(e), start))
        out = generate_text(gen, session.tokenizer, req, tokens)
        if session.parallel.rank != 0:
            continue
        for i, text in enumerate(out["text"]):
            if args.return_log_probs:
                print(json.dumps({"prompt": chunk[i], "text": text, "tokens": out["tokens"][i],
                                  "logprobs": out["logprobs"][i]}), flush=True)
            else:
                print(text, flush=True)


def _fail(message: str) -> None:
    """Exit 2 with ``error: message`` (printed once per node; every rank reaches the same decision)."""

    def fail():
        raise ConfigError(message)

    exit_on_config_error(fail, once_per_node=True)


def _as_flag(message: str, offset: int) -> str:
    """A request error in the command line's words."""
    for field, flag in (("tokens_to_generate", "--num-tokens-to-generate"), ("stop_strings", "--stop-strings")):
        message = message.replace(field, flag)
    if message.startswith("prompts["):
        i = int(message[len("prompts["): message.index("]")])
        message = f"prompt {offset + i + 1}" + message[message.index("]") + 1:]
    return message
