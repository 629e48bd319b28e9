"""Megatron-LM's text-generation REST API on Flask: ``PUT /api`` with a JSON object.

Rank 0 serves HTTP; every request is validated there (a bad one is answered ``400 {"error": "<field>: ..."}``
without touching the model), tokenized, queued, and taken by rank 0's main thread one at a time: it
broadcasts the request to every rank (the followers wait in :func:`follow`), all ranks generate together, and
the handler thread answers. Concurrent requests therefore wait in the queue; a batch never mixes two requests.

Limits (:class:`ServerLimits`, each a flag): the body's size (413), prompts per request, ``tokens_to_generate``
and the request's total tokens (400, naming the field), the queue's length (429 when full), how long a request
may wait for its answer (504; one still queued then is dropped), how long a connection may stay silent (a slow
or vanished client holds only its own handler thread, never the ranks), and an optional API key (401 without
it). Every error answer is one JSON line ``{"error": ...}``.

Request fields (Megatron's): ``prompts`` (list of strings, required), ``tokens_to_generate`` (int >= 0,
default 64), ``temperature`` (0 < t <= 100), ``top_k`` (0..1000; 1 is greedy), ``top_p`` (0..1, not with
``top_k``), ``logprobs`` (bool), ``add_BOS`` (bool), ``random_seed`` (int >= 0), ``stop_token`` (token id; default
end-of-document), ``stop_on_eol`` / ``stop_on_double_eol`` (bool), ``no_log`` (bool); and ``stop_strings`` (list
of strings, ours). Response: ``text`` (prompt + generation), ``segments`` (each token's text), ``logprobs``
(per prompt, of every token after the first; ``null`` unless asked), ``tokens``.
"""
from __future__ import annotations

import hmac
import json
import logging
import queue
import random
import threading
import time
from dataclasses import asdict, dataclass

from ..parallel import comm_log as comm
from .text import TextRequest, generate_text, tokenize_prompts

__all__ = ["RequestError", "GenerationServer", "ServerLimits", "add_server_args", "broadcast_from_rank0", "create_app",
           "follow", "parse_request"]

_FIELDS = ("prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "logprobs", "add_BOS", "random_seed",
           "stop_token", "stop_strings", "stop_on_eol", "stop_on_double_eol", "no_log")
_MEGATRON_UNSUPPORTED = ("top_p_decay", "top_p_bound", "prevent_newline_after_colon", "beam_width",
                         "length_penalty")
_RENAMED = {"max_len": "tokens_to_generate", "sentences": "prompts"}


class RequestError(ValueError):
    """A bad request: answered 400 with this one-line message."""


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server, and how long anything may wait (one flag each; see
    :func:`add_server_args`). ``api_key`` None: no key is asked for."""

    max_request_bytes: int = 1 << 20
    max_tokens_to_generate: int = 1024
    max_request_tokens: int = 16384
    max_queued_requests: int = 64
    request_timeout: float = 600.0
    client_timeout: float = 30.0
    api_key: str | None = None

    @classmethod
    def from_args(cls, args) -> "ServerLimits":
        """The limits from the flags; a bad value raises one ``ValueError`` line per flag."""
        errors = [f"{flag} must be > 0, got {getattr(args, dest)}" for flag, dest in _LIMIT_FLAGS
                  if not getattr(args, dest) > 0]
        if args.api_key is not None and not args.api_key.strip():
            errors.append("--api-key is empty; give a key or drop the flag")
        if errors:
            raise ValueError("\n".join(errors))
        return cls(**{dest: getattr(args, dest) for _, dest in _LIMIT_FLAGS}, api_key=args.api_key)


_LIMIT_FLAGS = (("--max-request-bytes", "max_request_bytes"), ("--max-tokens-to-generate", "max_tokens_to_generate"),
                ("--max-request-tokens", "max_request_tokens"), ("--max-queued-requests", "max_queued_requests"),
                ("--request-timeout", "request_timeout"), ("--client-timeout", "client_timeout"))


_LIMIT_HELP = {
    "max_request_bytes": (int, "largest request body in bytes; larger ones are answered 413"),
    "max_tokens_to_generate": (int, "largest tokens_to_generate a request may ask for (400 above)"),
    "max_request_tokens": (int, "most tokens one request may hold: its prompts' tokens plus tokens_to_generate per "
                                "prompt (400 above)"),
    "max_queued_requests": (int, "requests waiting for the model at most; more are answered 429"),
    "request_timeout": (float, "seconds a request may wait for its answer (queued and generating); then 504"),
    "client_timeout": (float, "seconds a connection may stay silent while sending its request or taking the answer"),
}


def add_server_args(g) -> None:
    """The server's limit flags, into the argument group ``g`` (defaults: :class:`ServerLimits`')."""
    defaults = ServerLimits()
    for flag, dest in _LIMIT_FLAGS:
        kind, text = _LIMIT_HELP[dest]
        g.add_argument(flag, type=kind, default=getattr(defaults, dest), help=f"{text} (default %(default)s)")
    g.add_argument("--api-key", default=None,
                   help="require this key (header 'Authorization: Bearer KEY' or 'X-API-Key: KEY'); 401 without it")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_request(body, tokenizer, *, max_prompts: int, max_sequence: int, limits: ServerLimits | None = None
                  ) -> tuple[TextRequest, list[list[int]]]:
    """Validate a request body (the parsed JSON) -> the request and its prompts' tokens; raise
    :class:`RequestError` naming the field and the fix. ``limits``: the server's bounds on ``tokens_to_generate``
    and the request's total tokens (None: only the model's context bounds them)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object, e.g. {\"prompts\": [\"Hello\"], "
                           "\"tokens_to_generate\": 16}")
    for key in body:
        if key in _RENAMED:
            raise RequestError(f"{key} is no longer used; replace it with {_RENAMED[key]}")
        if key in _MEGATRON_UNSUPPORTED:
            raise RequestError(f"{key} is not supported by this server; drop it")
        if key not in _FIELDS:
            raise RequestError(f"unknown field {key!r}; the fields are {', '.join(_FIELDS)}")
    if "prompts" not in body:
        raise RequestError("prompts is required: a list of strings")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts must be a list of strings")
    if not prompts:
        raise RequestError("prompts is empty; give at least one prompt")
    if len(prompts) > max_prompts:
        raise RequestError(f"prompts has {len(prompts)} prompts; at most {max_prompts} per request "
                           "(--inference-max-requests)")
    req = TextRequest(prompts=list(prompts))

    def take(name, check, what):
        if name in body:
            if not check(body[name]):
                raise RequestError(f"{name} must be {what}, got {body[name]!r}")
            setattr(req, name, body[name])

    take("tokens_to_generate", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    if limits is not None and req.tokens_to_generate > limits.max_tokens_to_generate:
        raise RequestError(f"tokens_to_generate is {req.tokens_to_generate}; this server generates at most "
                           f"{limits.max_tokens_to_generate} (--max-tokens-to-generate)")
    take("logprobs", lambda v: isinstance(v, bool), "true or false")
    if req.tokens_to_generate == 0 and not req.logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be true (it scores the prompts)")
    take("temperature", lambda v: _is_number(v) and 0.0 < v <= 100.0, "a number in (0, 100]")
    take("top_k", lambda v: _is_int(v) and 0 <= v <= 1000, "an integer in [0, 1000]")
    take("top_p", lambda v: _is_number(v) and 0.0 <= v <= 1.0, "a number in [0, 1]")
    if req.top_p > 0 and req.top_k > 1:
        raise RequestError("top_k and top_p cannot both be set; drop one (top_k 1 is greedy)")
    take("add_BOS", lambda v: isinstance(v, bool), "true or false")
    take("random_seed", lambda v: _is_int(v) and 0 <= v < 2 ** 63, "an integer >= 0 (below 2**63)")
    take("stop_token", lambda v: _is_int(v) and -1 <= v < 2 ** 63, "a token id (an integer; -1 for none)")
    take("stop_strings", lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
         "a list of non-empty strings")
    for name, text in (("stop_on_eol", "\n"), ("stop_on_double_eol", "\n\n")):
        if name in body:
            if not isinstance(body[name], bool):
                raise RequestError(f"{name} must be true or false, got {body[name]!r}")
            if body[name]:
                req.stop_strings = list(req.stop_strings) + [text]
    if "no_log" in body and not isinstance(body["no_log"], bool):
        raise RequestError(f"no_log must be true or false, got {body['no_log']!r}")
    if "random_seed" not in body:
        req.random_seed = random.randrange(2 ** 31)
    if any(not p for p in prompts) and not req.add_BOS:
        raise RequestError("an empty prompt needs add_BOS=true")
    try:
        tokens = tokenize_prompts(tokenizer, req.prompts, req.add_BOS)
    except ValueError as e:
        raise RequestError(f"prompts: {str(e).splitlines()[0]}") from None
    vocab = getattr(tokenizer, "vocab_size", None)
    for i, t in enumerate(tokens):
        bad = [x for x in t if not 0 <= x < vocab] if vocab is not None else []
        if bad:
            raise RequestError(f"prompts[{i}] holds token id {bad[0]}, outside the vocabulary of {vocab} tokens")
    total = sum(len(t) + req.tokens_to_generate for t in tokens)
    if limits is not None and total > limits.max_request_tokens:
        raise RequestError(f"prompts: the request holds {total} tokens (prompt tokens plus tokens_to_generate per "
                           f"prompt); this server takes at most {limits.max_request_tokens} per request "
                           "(--max-request-tokens): send fewer or shorter prompts")
    for i, t in enumerate(tokens):
        if len(t) + req.tokens_to_generate > max_sequence:
            raise RequestError(f"prompts[{i}] has {len(t)} tokens; with tokens_to_generate={req.tokens_to_generate} "
                               f"that exceeds the context of {max_sequence} tokens: shorten the prompt or lower "
                               "tokens_to_generate")
    return req, tokens


class _Job:
    def __init__(self, req: TextRequest, tokens: list[list[int]]):
        self.req, self.tokens = req, tokens
        self.done = threading.Event()
        self.cancelled = False  # its client stopped waiting: skipped if still queued
        self.result: dict | None = None
        self.error: str | None = None


class QueueFull(RuntimeError):
    """The request queue is full: answered 429."""


class RequestTimeout(RuntimeError):
    """The request waited longer than ``--request-timeout``: answered 504."""


def _key_of(request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):].strip()
    return request.headers.get("X-API-Key")


def _error(message: str, status: int):
    from flask import jsonify

    return jsonify(error=message), status


def create_app(submit, tokenizer, *, max_prompts: int, max_sequence: int, limits: ServerLimits | None = None,
               log=print):
    """The Flask app: ``PUT /api`` checks the key and the body's size, validates, then
    ``submit(req, tokens) -> response dict`` (blocking; raises :class:`QueueFull`, :class:`RequestTimeout`, or
    ``RuntimeError`` for a failed generation)."""
    from flask import Flask, jsonify, request

    limits = limits or ServerLimits()
    app = Flask("megatronish.inference")
    app.json.sort_keys = False
    app.config["MAX_CONTENT_LENGTH"] = limits.max_request_bytes  # a longer body (even chunked) is refused: 413

    @app.errorhandler(413)
    def too_large(_):
        return _error(f"request body: larger than {limits.max_request_bytes} bytes (--max-request-bytes); send a "
                      "smaller request", 413)

    @app.errorhandler(400)
    def bad(_):
        return _error("the request could not be read; send a JSON object such as {\"prompts\": [\"Hello\"]}", 400)

    @app.errorhandler(405)
    def method(_):
        return _error("method not allowed: send PUT /api with a JSON object", 405)

    @app.put("/api")
    def api():
        if limits.api_key is not None:
            key = _key_of(request)
            if key is None or not hmac.compare_digest(key.encode("utf-8", "replace"),
                                                      limits.api_key.encode("utf-8")):
                return _error("api key: missing or wrong; send the header 'Authorization: Bearer KEY'", 401)
        raw = request.get_data(cache=False)  # 413 past --max-request-bytes
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        if body is None:
            return _error("the request body is not valid JSON; send a JSON object such as "
                          "{\"prompts\": [\"Hello\"], \"tokens_to_generate\": 16}", 400)
        try:
            req, tokens = parse_request(body, tokenizer, max_prompts=max_prompts, max_sequence=max_sequence,
                                        limits=limits)
        except RequestError as e:
            return _error(str(e), 400)
        t0 = time.perf_counter()
        try:
            response = submit(req, tokens)
        except QueueFull as e:
            return _error(str(e), 429)
        except RequestTimeout as e:
            return _error(str(e), 504)
        except RuntimeError as e:
            return _error(f"generation failed: {e}", 500)
        if not body.get("no_log"):
            log(f"request from {request.remote_addr}: {len(req.prompts)} prompt(s), tokens_to_generate="
                f"{req.tokens_to_generate}, {time.perf_counter() - t0:.2f} s")
        return jsonify(response)

    return app


def broadcast_from_rank0(obj, session):
    """``obj`` of rank 0 on every rank (pickled over the context's gloo ``io`` group)."""
    if session.parallel.world_size > 1:
        box = [obj]
        comm.broadcast_object_list(box, src=0, group=session.parallel.io_group)
        return box[0]
    return obj


class GenerationServer:
    """Rank 0: the HTTP server in a thread, generation in the calling (main) thread, one request at a time."""

    def __init__(self, session, host: str, port: int, limits: ServerLimits | None = None):
        from werkzeug.serving import WSGIRequestHandler, make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self.session = session
        self.limits = limits = limits or ServerLimits()
        self.jobs: queue.Queue[_Job] = queue.Queue(maxsize=limits.max_queued_requests)
        self.app = create_app(self.submit, session.tokenizer, max_prompts=session.generator.max_batch,
                              max_sequence=session.generator.max_sequence, limits=limits)
        # each connection's socket times out after --client-timeout silent seconds: a slow or vanished client
        # frees its handler thread (the ranks never wait on a client)
        handler = type("TimedRequestHandler", (WSGIRequestHandler,), {"timeout": limits.client_timeout})
        self.httpd = make_server(host, port, self.app, threaded=True, request_handler=handler)
        self.port = self.httpd.server_port

    def submit(self, req: TextRequest, tokens: list[list[int]]) -> dict:
        job = _Job(req, tokens)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server is busy: {self.limits.max_queued_requests} requests are already waiting "
                            "(--max-queued-requests); retry later") from None
        if not job.done.wait(self.limits.request_timeout):
            job.cancelled = True
            raise RequestTimeout(f"no answer within {self.limits.request_timeout:g} s (--request-timeout); the "
                                 "server is busy, retry later or ask for fewer tokens")
        if job.error is not None:
            raise RuntimeError(job.error)
        return job.result

    def serve_forever(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True).start()
        print(f"serving text generation on http://{self.httpd.host}:{self.port}/api (PUT)", flush=True)
        try:
            while True:
                try:
                    job = self.jobs.get(timeout=0.5)
                except queue.Empty:
                    continue
                if job.cancelled:  # its client has been answered 504 already
                    continue
                broadcast_from_rank0((asdict(job.req), job.tokens), self.session)
                try:
                    job.result = generate_text(self.session.generator, self.session.tokenizer, job.req, job.tokens)
                except Exception as e:  # answered 500; the server keeps serving
                    job.error = f"{type(e).__name__}: {e}"
                job.done.set()
        finally:
            self.httpd.shutdown()
            broadcast_from_rank0(None, self.session)


def follow(session) -> None:
    """Ranks other than 0: generate each request rank 0 broadcasts, until it broadcasts ``None``."""
    while True:
        msg = broadcast_from_rank0(None, session)
        if msg is None:
            return
        fields, tokens = msg
        try:
            generate_text(session.generator, session.tokenizer, TextRequest(**fields), tokens)
        except Exception:  # rank 0 fails the same way and answers 500; keep following
            pass
