#!/usr/bin/env python
"""Client of tools/run_text_generation_server.py, as Megatron-LM's: asks for a prompt and a number of tokens,
sends ``PUT /api``, prints the response. Standard library only.

    python tools/text_generation_cli.py localhost:5000
    python tools/text_generation_cli.py localhost:5000 --prompt "The Python" --tokens-to-generate 32 --top_k 1
"""
import argparse
import json
import sys
import urllib.error
import urllib.request

from megatronish.errors import CommandLineParser  # standard library only, like this client


def _url(address: str) -> str:
    url = address if "://" in address else f"http://{address}"
    return url if url.rstrip("/").endswith("/api") else url.rstrip("/") + "/api"


def put(url: str, body: dict, timeout: float = 600.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                 headers={"Content-Type": "application/json; charset=UTF-8"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {"error": e.reason}


def _ask(url: str, prompt: str, tokens: int, extra: dict) -> bool:
    try:
        status, answer = put(url, {"prompts": [prompt], "tokens_to_generate": tokens, **extra})
    except (urllib.error.URLError, OSError) as e:
        print(f"error: cannot reach {url} ({getattr(e, 'reason', e)}); is the server running?", file=sys.stderr)
        return False
    if status != 200:
        print(f"Error {status}: {answer.get('error', answer)}")
        return True
    print("Megatron Response: ")
    print(answer["text"][0])
    return True


def main(argv=None) -> int:
    p = CommandLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="the server: host:port (the /api path is added) or a full URL")
    p.add_argument("--prompt", default=None, help="send this prompt once and exit (default: ask in a loop)")
    p.add_argument("--tokens-to-generate", type=int, default=64)
    p.add_argument("--top_k", "--top-k", dest="top_k", type=int, default=None,
                   help="send top_k (1: greedy; default: the server's, which samples from the whole vocabulary)")
    args = p.parse_args(argv)
    url = _url(args.url)
    extra = {} if args.top_k is None else {"top_k": args.top_k}
    if args.prompt is not None:
        return 0 if _ask(url, args.prompt, args.tokens_to_generate, extra) else 1
    while True:
        try:
            prompt = input("Enter prompt: ")
            raw = input("Enter number of tokens to generate: ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        try:
            tokens = int(raw)
        except ValueError:
            print(f"Error: the number of tokens must be an integer, got {raw!r}")
            continue
        if not _ask(url, prompt, tokens, extra):
            return 1


if __name__ == "__main__":
    sys.exit(main())
