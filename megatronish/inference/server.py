"""Megatron-LM's text-generation REST API on Flask: ``PUT /api`` with a JSON object.

Rank 0 serves HTTP; every request is validated there (a bad one is answered ``400 {"error": "<field>: ..."}``
without touching the model), tokenized, queued, and taken by rank 0's main thread one at a time: it
broadcasts the request to every rank (the followers wait in :func:`follow`), all ranks generate together, and
the handler thread answers. Concurrent requests therefore wait in the queue; a batch never mixes two requests.

Request fields (Megatron's): ``prompts`` (list of strings, required), ``tokens_to_generate`` (int >= 0,
default 64), ``temperature`` (0 < t <= 100), ``top_k`` (0..1000; 1 is greedy), ``top_p`` (0..1, not with
``top_k``), ``logprobs`` (bool), ``add_BOS`` (bool), ``random_seed`` (int >= 0), ``stop_token`` (token id; default
end-of-document), ``stop_on_eol`` / ``stop_on_double_eol`` (bool), ``no_log`` (bool); and ``stop_strings`` (list
of strings, ours). Response: ``text`` (prompt + generation), ``segments`` (each token's text), ``logprobs``
(per prompt, of every token after the first; ``null`` unless asked), ``tokens``.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import asdict

from ..parallel import comm_log as comm
from .text import TextRequest, generate_text, tokenize_prompts

__all__ = ["RequestError", "GenerationServer", "broadcast_from_rank0", "create_app", "follow", "parse_request"]

_FIELDS = ("prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "logprobs", "add_BOS", "random_seed",
           "stop_token", "stop_strings", "stop_on_eol", "stop_on_double_eol", "no_log")
_MEGATRON_UNSUPPORTED = ("top_p_decay", "top_p_bound", "prevent_newline_after_colon", "beam_width",
                         "length_penalty")
_RENAMED = {"max_len": "tokens_to_generate", "sentences": "prompts"}


class RequestError(ValueError):
    """A bad request: answered 400 with this one-line message."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_request(body, tokenizer, *, max_prompts: int, max_sequence: int) -> tuple[TextRequest, list[list[int]]]:
    """Validate a request body (the parsed JSON) -> the request and its prompts' tokens; raise
    :class:`RequestError` naming the field and the fix."""
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
    take("logprobs", lambda v: isinstance(v, bool), "true or false")
    if req.tokens_to_generate == 0 and not req.logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be true (it scores the prompts)")
    take("temperature", lambda v: _is_number(v) and 0.0 < v <= 100.0, "a number in (0, 100]")
    take("top_k", lambda v: _is_int(v) and 0 <= v <= 1000, "an integer in [0, 1000]")
    take("top_p", lambda v: _is_number(v) and 0.0 <= v <= 1.0, "a number in [0, 1]")
    if req.top_p > 0 and req.top_k > 1:
        raise RequestError("top_k and top_p cannot both be set; drop one (top_k 1 is greedy)")
    take("add_BOS", lambda v: isinstance(v, bool), "true or false")
    take("random_seed", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    take("stop_token", _is_int, "a token id (an integer; -1 for none)")
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
        self.result: dict | None = None
        self.error: str | None = None


def create_app(submit, tokenizer, *, max_prompts: int, max_sequence: int, log=print):
    """The Flask app: ``PUT /api`` validates, then ``submit(req, tokens) -> response dict`` (blocking)."""
    from flask import Flask, jsonify, request

    app = Flask("megatronish.inference")
    app.json.sort_keys = False

    @app.put("/api")
    def api():
        body = request.get_json(silent=True, force=True)
        if body is None:
            return jsonify(error="the request body is not valid JSON; send a JSON object such as "
                                 "{\"prompts\": [\"Hello\"], \"tokens_to_generate\": 16}"), 400
        try:
            req, tokens = parse_request(body, tokenizer, max_prompts=max_prompts, max_sequence=max_sequence)
        except RequestError as e:
            return jsonify(error=str(e)), 400
        t0 = time.perf_counter()
        try:
            response = submit(req, tokens)
        except RuntimeError as e:
            return jsonify(error=f"generation failed: {e}"), 500
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

    def __init__(self, session, host: str, port: int):
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self.session = session
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.app = create_app(self.submit, session.tokenizer, max_prompts=session.generator.max_batch,
                              max_sequence=session.generator.max_sequence)
        self.httpd = make_server(host, port, self.app, threaded=True)
        self.port = self.httpd.server_port

    def submit(self, req: TextRequest, tokens: list[list[int]]) -> dict:
        job = _Job(req, tokens)
        self.jobs.put(job)
        job.done.wait()
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
