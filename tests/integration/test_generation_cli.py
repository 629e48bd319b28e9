"""The text-generation tools end to end: ``tools/run_text_generation_server.py`` started for real with torchrun
at TP 2 on a free port and asked over HTTP (``requests``): the greedy text of known prompts equals
transformers', bad requests are answered 400 with one line naming the field, 20 concurrent requests are all
answered correctly (queued, never mixed), and the server is still up afterwards; ``tools/text_generation_cli.py``
talks to it; ``tools/generate.py`` reads prompts from stdin and a file; user errors are one line, exit 2."""
import concurrent.futures
import json
import os
import subprocess
import sys
import time

import pytest
import requests
import torch

from megatronish.checkpoint.offline import write_checkpoint
from megatronish.convert import hf_state_dict_to_ours, model_config_from_hf
from megatronish.convert.tiny import tiny_hf_model
from megatronish.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V, CONTEXT = 100, 32
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRONISH_DEVICE": "cpu", "PYTHONPATH": ROOT}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A converted random Llama (GQA) checkpoint, and transformers' greedy continuation of some prompts."""
    d = tmp_path_factory.mktemp("gen")
    hf = tiny_hf_model("LlamaForCausalLM", vocab=V)
    hf.generation_config.eos_token_id = None  # generate exactly n tokens
    cfg, a = model_config_from_hf(hf.config.to_dict())
    write_checkpoint(str(d / "ckpt"), None, hf_state_dict_to_ours(hf.state_dict(), cfg, a, tp=1),
                     {"model": cfg.flat()})

    def greedy(prompt: str, n: int) -> str:
        ids = torch.tensor([[int(x) for x in prompt.split()]])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)[0]
        return " ".join(str(t) for t in out.tolist())

    return str(d / "ckpt"), greedy


FLAGS = ["--use-checkpoint-args", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(V - 1)]


@pytest.fixture(scope="module")
def server(model):
    ckpt, _ = model
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             os.path.join(ROOT, "tools", "run_text_generation_server.py"), "--load", ckpt, *FLAGS,
                             "--tensor-model-parallel-size", "2", "--port", str(port), "--inference-max-requests", "4"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {proc.stdout.read()}")
        try:
            requests.put(url, json={}, timeout=5)
            break
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the server did not start within 120 s")
            time.sleep(0.5)
    yield url, proc
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _put(url, body, **kw):
    return requests.put(url, json=body, timeout=120, **kw)


def test_server_answers_like_transformers(server, model):
    url, _ = server
    _, greedy = model
    prompts = ["5 6 7", "10 11 12 13 14 15 16 17 18", "42"]
    r = _put(url, {"prompts": prompts, "tokens_to_generate": 8, "top_k": 1, "stop_token": -1, "logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == [greedy(p, 8) for p in prompts]
    assert body["segments"][2] == greedy("42", 8).split()
    assert [len(lp) for lp in body["logprobs"]] == [len(p.split()) + 7 for p in prompts]


@pytest.mark.parametrize("data,field", [
    ({"prompts": [" ".join(["1"] * 30)], "tokens_to_generate": 8}, "prompts[0] has 30 tokens"),
    ('{"prompts": ["1 2"', "not valid JSON"),
    ({"prompts": ["1 2"], "tokens_to_generate": -3}, "tokens_to_generate must be an integer >= 0"),
    ({"prompts": ["1 2"], "temperature_": 0.5}, "unknown field 'temperature_'"),
    ({"prompts": ["1 2"], "top_k": 3, "top_p": 0.9}, "top_k and top_p cannot both be set"),
    ({"prompt": "1 2"}, "unknown field 'prompt'"),
    ({"prompts": ["1"] * 5}, "at most 4 per request"),
])
def test_bad_requests_are_400_with_one_line(server, data, field):
    url, _ = server
    if isinstance(data, str):
        r = requests.put(url, data=data, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = _put(url, data)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"] and "\n" not in r.json()["error"]


def test_concurrent_requests_are_queued_not_mixed(server, model):
    url, proc = server
    _, greedy = model
    prompts = [" ".join(str((7 * i + j) % (V - 1)) for j in range(1 + i % 5)) for i in range(20)]
    lengths = [2 + i % 7 for i in range(20)]
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda pl: _put(url, {"prompts": [pl[0]], "tokens_to_generate": pl[1], "top_k": 1,
                                                      "stop_token": -1, "no_log": True}), zip(prompts, lengths)))
    assert [a.status_code for a in answers] == [200] * 20
    assert [a.json()["text"][0] for a in answers] == [greedy(p, n) for p, n in zip(prompts, lengths)]
    # still up, and a sampled request with a seed is reproducible
    body = {"prompts": ["3 4 5"], "tokens_to_generate": 6, "temperature": 1.5, "top_k": 20, "random_seed": 11}
    a, b = _put(url, body), _put(url, body)
    assert a.status_code == b.status_code == 200 and a.json()["text"] == b.json()["text"]
    assert proc.poll() is None


def test_cli_client(server, model):
    url, _ = server
    _, greedy = model
    cli = os.path.join(ROOT, "tools", "text_generation_cli.py")
    r = subprocess.run([sys.executable, cli, url.replace("http://", "").replace("/api", ""), "--top_k", "1"],
                       input="5 6 7\n4\n1 2\n-1\n", capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr
    assert f"Megatron Response: \n{greedy('5 6 7', 4)}" in r.stdout.replace("Enter prompt: ", "").replace(
        "Enter number of tokens to generate: ", "")
    assert "Error 400: tokens_to_generate must be an integer >= 0" in r.stdout
    r = subprocess.run([sys.executable, cli, url, "--prompt", "1 2", "--tokens-to-generate", "3", "--top_k", "1"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0 and r.stdout == f"Megatron Response: \n{greedy('1 2', 3)}\n", r.stdout + r.stderr


def _generate(*argv, stdin=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), *argv], input=stdin,
                          capture_output=True, text=True, timeout=180, env=ENV)


def test_generate_tool(model, tmp_path):
    ckpt, greedy = model
    r = _generate("--load", ckpt, *FLAGS, "--num-tokens-to-generate", "5", "--no-stop-at-eod", stdin="5 6 7\n\n1 2\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [greedy("5 6 7", 5), greedy("1 2", 5)]
    f = tmp_path / "prompts.txt"
    f.write_text("9 8\n")
    r = _generate("--load", ckpt, *FLAGS, "--prompt-file", str(f), "--num-tokens-to-generate", "3",
                  "--return-log-probs", "--no-stop-at-eod")
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout)
    assert line["text"] == greedy("9 8", 3) and len(line["logprobs"]) == 4


@pytest.mark.parametrize("argv,message", [
    ([*FLAGS], "error: --load is required"),
    (["--load", "/nonexistent/ckpt", "--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
      "--seq-length", "8", "--vocab-size", "10"], "error: --load /nonexistent/ckpt: no checkpoint there"),
    (["--top_k", "5", "--top_p", "0.5", "--load", "x", *FLAGS], "error: --top_k and --top_p cannot both be set"),
    (["--num-tokens-to-generate", "40", "--prompts", "1 2", "LOAD", *FLAGS],
     "error: prompt 1 has 2 tokens; with --num-tokens-to-generate=40 that exceeds the context of 32 tokens"),
])
def test_generate_user_errors_are_one_line(model, argv, message):
    ckpt, _ = model
    argv = [a for x in argv for a in (["--load", ckpt] if x == "LOAD" else [x])]
    r = _generate(*argv, stdin="")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(message), r.stderr
    assert "Traceback" not in r.stderr
