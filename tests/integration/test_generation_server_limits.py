"""The text-generation server under abuse, on 127.0.0.1 only: ``tools/run_text_generation_server.py`` at TP 2 with
small limits and an API key gets 2,000 fuzzed request bodies (hypothesis, derandomized) and then 64 concurrent
clients, some of which send slowly, stall, or hang up. Every answer is 200/400/401/413/429 with one JSON line,
the server and both ranks keep serving, and the greedy answers equal ``tools/generate.py``'s for the same
checkpoint."""
import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatronish.checkpoint.offline import write_checkpoint
from megatronish.convert import hf_state_dict_to_ours, model_config_from_hf
from megatronish.convert.tiny import tiny_hf_model
from megatronish.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V = 100
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRONISH_DEVICE": "cpu", "PYTHONPATH": ROOT}
KEY = "test-key-4f1c"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLAGS = ["--use-checkpoint-args", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(V - 1)]
LIMITS = ["--inference-max-requests", "4", "--max-request-bytes", "2048", "--max-tokens-to-generate", "8",
          "--max-request-tokens", "48", "--max-queued-requests", "6", "--client-timeout", "2", "--api-key", KEY]
ALLOWED = {200, 400, 401, 413, 429}
PROMPTS = [" ".join(str((11 * i + j) % (V - 1)) for j in range(1 + i % 4)) for i in range(8)]
N_TOKENS = 5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server (TP 2) and ``tools/generate.py``'s greedy answers to :data:`PROMPTS`, started together."""
    d = tmp_path_factory.mktemp("limits")
    hf = tiny_hf_model("LlamaForCausalLM", vocab=V)
    cfg, a = model_config_from_hf(hf.config.to_dict())
    ckpt = str(d / "ckpt")
    write_checkpoint(ckpt, None, hf_state_dict_to_ours(hf.state_dict(), cfg, a, tp=1),
                     {"model": cfg.flat()})
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               os.path.join(ROOT, "tools", "run_text_generation_server.py"), "--load", ckpt, *FLAGS,
                               "--tensor-model-parallel-size", "2", "--host", "127.0.0.1", "--port", str(port),
                               *LIMITS], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gen = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load", ckpt, *FLAGS,
                          "--num-tokens-to-generate", str(N_TOKENS), "--top_k", "1", "--no-stop-at-eod",
                          "--prompts", *PROMPTS], env=ENV, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    expected = dict(zip(PROMPTS, gen.stdout.splitlines()))
    url = f"http://127.0.0.1:{port}/api"
    _wait_until_up(url, server)
    yield url, port, server, expected
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()


def _wait_until_up(url, server, limit=120.0):
    """Poll the server (any HTTP answer means it is up) until ``limit`` seconds have passed."""
    for _ in range(int(limit / 0.5)):
        assert server.poll() is None, f"the server exited: {server.stdout.read()}"
        with contextlib.suppress(requests.ConnectionError):
            requests.put(url, json={}, timeout=5)
            return
        time.sleep(0.5)
    server.kill()
    pytest.fail(f"the server did not start within {limit:g} s")


def _put(url, data: bytes, headers=AUTH, timeout=60):
    return requests.put(url, data=data, headers={"Content-Type": "application/json", **headers}, timeout=timeout)


def _check(r):
    assert r.status_code in ALLOWED, (r.status_code, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error and "\n" not in error


def _greedy(url, prompt, deadline):
    """A greedy request retried while the queue is full (429), until ``deadline``."""
    body = json.dumps({"prompts": [prompt], "tokens_to_generate": N_TOKENS, "top_k": 1, "stop_token": -1,
                       "no_log": True}).encode()
    while True:
        r = _put(url, body)
        _check(r)
        if r.status_code != 429 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_limits_are_named(served):
    url, _, server, expected = served
    assert _put(url, b'{"prompts": ["1 2"]}', headers={}).status_code == 401
    assert _put(url, b'{"prompts": ["1 2"]}', headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert _put(url, b'{"prompts": ["1 2"], "tokens_to_generate": 2}', headers={"X-API-Key": KEY}).status_code == 200
    cases = [({"prompts": ["1 2"], "tokens_to_generate": 9}, 400, "tokens_to_generate is 9"),
             ({"prompts": ["1 2 3 4 5 6 7 8 9 10 11 12"] * 4, "tokens_to_generate": 1}, 400, "--max-request-tokens"),
             ({"prompts": ["1"] * 5}, 400, "at most 4 per request"),
             ({"prompts": ["1 " * 1100]}, 413, "request body")]
    for body, status, text in cases:
        r = _put(url, json.dumps(body).encode())
        assert r.status_code == status and text in r.json()["error"], r.text
    r = _greedy(url, PROMPTS[0], time.monotonic() + 30)
    assert r.status_code == 200 and r.json()["text"][0] == expected[PROMPTS[0]]
    assert server.poll() is None


_scalar = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12)
_json = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=6)
_prompt = st.text(alphabet="0123456789 x\n", max_size=24)
_fields = {"prompts": st.lists(_prompt, max_size=5) | _json, "tokens_to_generate": st.integers(-2, 12) | _json,
           "temperature": st.floats(-1, 200) | _json, "top_k": st.integers(-1, 1200), "top_p": st.floats(-0.5, 1.5),
           "logprobs": st.booleans() | _json, "add_BOS": st.booleans(), "random_seed": st.integers(-1, 2 ** 65),
           "stop_token": st.integers(-3, 2 ** 64), "stop_strings": st.lists(st.text(max_size=4), max_size=2) | _json,
           "stop_on_eol": st.booleans() | _json, "no_log": st.just(True), "max_len": _json, "beam_width": _json}
_digits = st.lists(st.integers(0, V - 1), min_size=1, max_size=6).map(lambda ids: " ".join(map(str, ids)))
_body = (st.fixed_dictionaries({"prompts": st.lists(_digits, min_size=1, max_size=3),
                                "tokens_to_generate": st.integers(1, 8), "no_log": st.just(True)},
                               optional={k: v for k, v in _fields.items() if k in ("top_k", "random_seed", "logprobs")})
         | st.fixed_dictionaries({"prompts": st.lists(_prompt, min_size=1, max_size=4)},
                                 optional={k: v for k, v in _fields.items() if k != "prompts"})
         | st.fixed_dictionaries({}, optional=_fields) | _json).map(lambda b: json.dumps(b).encode())
_raw = _body | st.binary(max_size=64) | st.integers(1800, 2600).map(lambda n: b'{"prompts": ["' + b"1 " * n + b'"]}') \
    | st.integers(1, 3000).map(lambda n: b"[" * n)


def test_fuzzed_bodies(served):
    url, _, server, expected = served
    seen: dict[int, int] = {}
    session = requests.Session()
    t0 = time.monotonic()

    @settings(max_examples=2000, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_raw)
    def one(data):
        r = session.put(url, data=data, headers={"Content-Type": "application/json", **AUTH}, timeout=60)
        _check(r)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1

    one()
    assert sum(seen.values()) >= 2000 and {200, 400, 413} <= set(seen), seen
    assert time.monotonic() - t0 < 300
    r = _greedy(url, PROMPTS[1], time.monotonic() + 30)
    assert r.status_code == 200 and r.json()["text"][0] == expected[PROMPTS[1]]
    assert server.poll() is None


def _slow_sender(port):
    """Announces a body, sends part of it, then stalls past --client-timeout: the server hangs up on it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"PUT /api HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                  "Content-Length: 200\r\n\r\n{\"prompts\": [".encode())
        try:
            s.recv(1)  # returns when the server closes the connection (--client-timeout 2)
        except OSError:
            pass


def _hang_up(port, prompt):
    """Sends a whole valid request and closes the connection without reading the answer."""
    body = json.dumps({"prompts": [prompt], "tokens_to_generate": 8, "top_k": 1, "no_log": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"PUT /api HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def _half_header(port):
    """Sends half a request line and stalls."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"PUT /a")
        try:
            s.recv(1)
        except OSError:
            pass


def test_concurrent_slow_and_vanishing_clients(served):
    url, port, server, expected = served
    deadline = time.monotonic() + 45
    jobs = []
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        for i in range(64):
            kind = i % 4
            if kind == 0:
                jobs.append(pool.submit(_slow_sender, port))
            elif kind == 1 and i % 8 == 1:
                jobs.append(pool.submit(_hang_up, port, PROMPTS[i % len(PROMPTS)]))
            elif kind == 1:
                jobs.append(pool.submit(_half_header, port))
            else:
                jobs.append(pool.submit(lambda p: (p, _greedy(url, p, deadline)), PROMPTS[i % len(PROMPTS)]))
        results = [j.result(timeout=90) for j in jobs]
    answers = [r for r in results if isinstance(r, tuple)]
    assert len(answers) == 32
    assert all(r.status_code == 200 for _, r in answers), [r.status_code for _, r in answers]
    assert [r.json()["text"][0] for _, r in answers] == [expected[p] for p, _ in answers]
    # both ranks are still serving
    r = _greedy(url, PROMPTS[2], time.monotonic() + 30)
    assert r.status_code == 200 and r.json()["text"][0] == expected[PROMPTS[2]]
    assert server.poll() is None
