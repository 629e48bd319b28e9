"""The catalogue of bad inputs: every entry point given a bad flag, data file, tokenizer file, checkpoint, blend or
conversion input ends with exit code 2 and one ``error:`` line naming the flag or file, and no traceback.

The cases run each entry point's ``main`` in a forked child of this process (torch is imported once; a child
starts in milliseconds), a few at a time, with a 60 s limit each. A few cases run under torchrun with two ranks:
the line is printed once for the job, and the job ends in seconds.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatronish.data.indexed_dataset import IndexedDatasetBuilder
from megatronish.data.tokenizers import gpt2_files
from megatronish.testing import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
         "--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
NULL_TOK = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
LIMIT_S = 60


# ----------------------------------------------------------------------------------------------- fixtures
def _write_dataset(prefix, dtype=np.uint16, docs=60, seed=0):
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    rng = np.random.default_rng(seed)
    for _ in range(docs):
        b.add_item(rng.integers(0, 100, int(rng.integers(5, 40))))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def _copy_dataset(src, dst):
    for ext in (".bin", ".idx"):
        shutil.copyfile(src + ext, dst + ext)
    return dst


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _run_child(entry, argv, out_path):
    """In a forked child: run ``entry(argv)`` with stdout/stderr going to ``out_path``; exit with its code."""
    code = 1
    try:
        fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", closefd=False)  # pytest's capture objects are not the file descriptors
        sys.stderr = open(2, "w", closefd=False)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(k, None)
        os.environ.update(MEGATRONISH_DEVICE="cpu", OMP_NUM_THREADS="1")
        import torch

        torch.set_num_threads(1)
        result = entry(argv)
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            sys.stderr.write(f"{e.code}\n")
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _entries():
    from megatronish.tools import convert_checkpoint, inspect_checkpoint, merge_datasets, preprocess_data, pretrain_gpt

    return {"pretrain": pretrain_gpt.main, "preprocess": preprocess_data.main, "merge": merge_datasets.main,
            "convert": convert_checkpoint.main, "inspect": inspect_checkpoint.main}


def run_cases(cases, tmp_path, parallel=3):
    """``cases``: (name, entry, argv). Returns {name: (exit code, output, seconds)}."""
    entries = _entries()
    todo, running, done = list(cases), {}, {}
    while todo or running:
        while todo and len(running) < parallel:
            name, entry, argv = todo.pop(0)
            out = str(tmp_path / f"{name}.out")
            pid = os.fork()
            if pid == 0:
                _run_child(entries[entry], [str(a) for a in argv], out)
            running[pid] = (name, out, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for p, (_name, _out, t0) in list(running.items()):
                if now - t0 > LIMIT_S:
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.02)
            continue
        if pid not in running:
            continue
        name, out, t0 = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        with open(out, errors="replace") as f:
            done[name] = (code, f.read(), time.monotonic() - t0)
    return done


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    good = _write_dataset(d / "good")
    p = {"dir": d, "good": good}
    p["idx_truncated"] = _copy_dataset(good, str(d / "idx_truncated"))
    _truncate(p["idx_truncated"] + ".idx", 20)
    p["bad_magic"] = _copy_dataset(good, str(d / "bad_magic"))
    _patch(p["bad_magic"] + ".idx", 0, b"NOTANIDX")
    p["bad_version"] = _copy_dataset(good, str(d / "bad_version"))
    _patch(p["bad_version"] + ".idx", 9, (7).to_bytes(8, "little"))
    p["bad_dtype"] = _copy_dataset(good, str(d / "bad_dtype"))
    _patch(p["bad_dtype"] + ".idx", 17, bytes([42]))
    p["short_bin"] = _copy_dataset(good, str(d / "short_bin"))
    _truncate(p["short_bin"] + ".bin", 10)
    p["no_bin"] = _copy_dataset(good, str(d / "no_bin"))
    os.remove(p["no_bin"] + ".bin")
    p["int32"] = _write_dataset(d / "int32", dtype=np.int32)
    p["empty_dir"] = str(d / "empty")
    os.makedirs(p["empty_dir"])
    p["garbage"] = str(d / "garbage.bin")
    with open(p["garbage"], "wb") as f:
        f.write(os.urandom(300))
    p["not_json"] = str(d / "vocab.json")
    with open(p["not_json"], "w") as f:
        f.write("{not json")
    p["corpus_bad_line"] = str(d / "bad.jsonl")
    with open(p["corpus_bad_line"], "w") as f:
        f.write('{"text": "fine"}\n{"text": \n')
    p["corpus_no_key"] = str(d / "nokey.jsonl")
    with open(p["corpus_no_key"], "w") as f:
        f.write('{"body": "fine"}\n')
    p["file_not_dir"] = str(d / "plainfile")
    with open(p["file_not_dir"], "w") as f:
        f.write("x")
    p["hf_bad_config"] = str(d / "hf_bad")
    os.makedirs(p["hf_bad_config"])
    with open(os.path.join(p["hf_bad_config"], "config.json"), "w") as f:
        f.write("{broken")
    p["hf_unknown_arch"] = str(d / "hf_unknown")
    os.makedirs(p["hf_unknown_arch"])
    with open(os.path.join(p["hf_unknown_arch"], "config.json"), "w") as f:
        json.dump({"architectures": ["BertModel"], "model_type": "bert"}, f)

    # one real checkpoint (iteration 2), then broken copies of it
    ck = str(d / "ck")
    res = run_cases([("make_ck", "pretrain", MODEL + NULL_TOK + ["--mock-data", "--save", ck])], d)
    assert res["make_ck"][0] == 0, res["make_ck"][1][-3000:]
    p["ck"] = ck
    it = os.path.join(ck, "iter_0000002")

    def broken(name, fn):
        dst = str(d / name)
        shutil.copytree(ck, dst)
        fn(dst, os.path.join(dst, "iter_0000002"))
        p[name] = dst

    broken("ck_tracker_garbage", lambda r, i: open(os.path.join(r, "latest_checkpointed_iteration.txt"), "w")
           .write("hello"))
    broken("ck_tracker_missing_iter", lambda r, i: open(os.path.join(r, "latest_checkpointed_iteration.txt"), "w")
           .write("7"))
    broken("ck_no_metadata", lambda r, i: os.remove(os.path.join(i, ".metadata")))
    broken("ck_bad_metadata", lambda r, i: open(os.path.join(i, ".metadata"), "wb").write(b"\x80\x04garbage"))
    shard = sorted(f for f in os.listdir(it) if f.endswith(".distcp"))[0]
    broken("ck_no_shard", lambda r, i: os.remove(os.path.join(i, shard)))
    broken("ck_short_shard", lambda r, i: _truncate(os.path.join(i, shard), 100))
    return p


def _cases(p):
    good, d = p["good"], p["dir"]
    vocab, merges = gpt2_files()
    data = MODEL + NULL_TOK
    pre = ["--json-keys", "text", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--workers", "1"]
    out = str(d / "out" / "o")
    return [
        # (name, entry, argv, text the line must name)
        ("unknown_flag", "pretrain", data + ["--mock-data", "--bogus-flag"], "--bogus-flag"),
        ("missing_required", "pretrain", NULL_TOK + ["--mock-data", "--lr", "1e-3", "--train-iters", "2"],
         "--num-layers"),
        ("gbs_not_divisible", "pretrain", data + ["--mock-data", "--global-batch-size", "3"], "--global-batch-size"),
        ("tp_too_big", "pretrain", data + ["--mock-data", "--tensor-model-parallel-size", "2"],
         "--tensor-model-parallel-size"),
        ("mock_and_data", "pretrain", data + ["--mock-data", "--data-path", good], "--mock-data"),
        ("no_data", "pretrain", data, "--data-path"),
        ("num_workers_negative", "pretrain", data + ["--mock-data", "--num-workers", "-1"], "--num-workers"),
        ("missing_prefix", "pretrain", data + ["--data-path", str(d / "nope")], "nope"),
        ("idx_truncated", "pretrain", data + ["--data-path", p["idx_truncated"]], "idx_truncated.idx"),
        ("idx_bad_magic", "pretrain", data + ["--data-path", p["bad_magic"]], "bad_magic.idx"),
        ("idx_bad_version", "pretrain", data + ["--data-path", p["bad_version"]], "bad_version.idx"),
        ("idx_bad_dtype", "pretrain", data + ["--data-path", p["bad_dtype"]], "bad_dtype.idx"),
        ("bin_short", "pretrain", data + ["--data-path", p["short_bin"]], "short_bin.bin"),
        ("bin_missing", "pretrain", data + ["--data-path", p["no_bin"]], "no_bin"),
        ("split_not_numbers", "pretrain", data + ["--data-path", good, "--split", "a,b,c"], "--split"),
        ("split_too_many", "pretrain", data + ["--data-path", good, "--split", "1,2,3,4"], "--split"),
        ("split_all_zero", "pretrain", data + ["--data-path", good, "--split", "0,0,0"], "--split"),
        ("blend_odd", "pretrain", data + ["--data-path", "0.5", good, "0.5"], "--data-path"),
        ("blend_negative", "pretrain", data + ["--data-path", "-1", good, "2", good], "--data-path"),
        ("blend_not_weight", "pretrain", data + ["--data-path", good, good, "0.3", good], "--data-path"),
        ("train_path_missing", "pretrain", data + ["--train-data-path", str(d / "gone")], "gone"),
        ("test_path_missing", "pretrain", data + ["--train-data-path", good, "--valid-data-path", good,
                                                  "--test-data-path", str(d / "gone_test")], "gone_test"),
        ("cache_path_is_file", "pretrain", data + ["--data-path", good, "--data-cache-path", p["file_not_dir"]],
         "--data-cache-path"),
        ("vocab_file_missing", "pretrain", MODEL + ["--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
                                                    "--vocab-file", str(d / "v.json"), "--merge-file", merges],
         "--vocab-file"),
        ("merge_file_missing", "pretrain", MODEL + ["--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
                                                    "--vocab-file", vocab, "--merge-file", str(d / "m.txt")],
         "--merge-file"),
        ("vocab_file_garbage", "pretrain", MODEL + ["--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
                                                    "--vocab-file", p["not_json"], "--merge-file", merges],
         "vocab.json"),
        ("tokenizer_model_missing", "pretrain", MODEL + ["--mock-data", "--tokenizer-type", "SentencePieceTokenizer",
                                                         "--tokenizer-model", str(d / "sp.model")], "sp.model"),
        ("tokenizer_model_garbage", "pretrain", MODEL + ["--mock-data", "--tokenizer-type",
                                                         "SentencePieceTokenizer", "--tokenizer-model",
                                                         p["garbage"]], "garbage.bin"),
        ("load_tracker_garbage", "pretrain", data + ["--mock-data", "--load", p["ck_tracker_garbage"]],
         "latest_checkpointed_iteration.txt"),
        ("load_tracker_missing_iter", "pretrain", data + ["--mock-data", "--load", p["ck_tracker_missing_iter"]],
         "iter_0000007"),
        ("load_no_metadata", "pretrain", data + ["--mock-data", "--load", p["ck_no_metadata"]], "ck_no_metadata"),
        ("load_bad_metadata", "pretrain", data + ["--mock-data", "--load", p["ck_bad_metadata"]], "ck_bad_metadata"),
        ("load_no_shard", "pretrain", data + ["--mock-data", "--load", p["ck_no_shard"]], ".distcp"),
        ("load_short_shard", "pretrain", data + ["--mock-data", "--load", p["ck_short_shard"]], "ck_short_shard"),
        ("load_other_shape", "pretrain", data + ["--mock-data", "--load", p["ck"], "--hidden-size", "64"],
         "--hidden-size"),
        ("load_missing_exit", "pretrain", data + ["--mock-data", "--load", p["empty_dir"],
                                                  "--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint"),
        ("preprocess_no_input", "preprocess", ["--input", str(d / "none*.jsonl"), "--output-prefix", out] + pre,
         "--input"),
        ("preprocess_bad_json", "preprocess", ["--input", p["corpus_bad_line"], "--output-prefix",
                                               str(d / "o1")] + pre, "bad.jsonl"),
        ("preprocess_no_key", "preprocess", ["--input", p["corpus_no_key"], "--output-prefix", str(d / "o2")] + pre,
         "text"),
        ("preprocess_out_dir", "preprocess", ["--input", p["corpus_no_key"], "--output-prefix", out] + pre,
         "--output-prefix"),
        ("preprocess_workers", "preprocess", ["--input", p["corpus_no_key"], "--output-prefix", str(d / "o3")]
         + pre + ["--workers", "0"], "--workers"),
        ("preprocess_vocab", "preprocess", ["--input", p["corpus_no_key"], "--output-prefix", str(d / "o4"),
                                            "--json-keys", "text", "--tokenizer-type", "GPT2BPETokenizer",
                                            "--vocab-file", str(d / "nov.json"), "--merge-file", merges,
                                            "--workers", "1"],
         "--vocab-file"),
        ("merge_missing", "merge", ["--input", str(d / "nothing"), "--output-prefix", str(d / "m1")], "nothing"),
        ("merge_bad_idx", "merge", ["--input", good, p["bad_magic"], "--output-prefix", str(d / "m2")],
         "bad_magic.idx"),
        ("merge_dtypes", "merge", ["--input", good, p["int32"], "--output-prefix", str(d / "m3")], "dtype"),
        ("merge_out_dir", "merge", ["--input", good, "--output-prefix", out], "--output-prefix"),
        ("convert_missing", "convert", ["--model-type", "GPT", "--loader", "hf", "--saver", "megatronish",
                                        "--load-dir", str(d / "nohf"), "--save-dir", str(d / "c1")], "nohf"),
        ("convert_bad_config", "convert", ["--model-type", "GPT", "--loader", "hf", "--saver", "megatronish",
                                           "--load-dir", p["hf_bad_config"], "--save-dir", str(d / "c2")],
         "config.json"),
        ("convert_unknown_arch", "convert", ["--model-type", "GPT", "--loader", "hf", "--saver", "megatronish",
                                             "--load-dir", p["hf_unknown_arch"], "--save-dir", str(d / "c3")],
         "hf_unknown"),
        ("convert_same_dirs", "convert", ["--model-type", "GPT", "--loader", "hf", "--saver", "megatronish",
                                          "--load-dir", p["hf_bad_config"], "--save-dir", p["hf_bad_config"]],
         "--save-dir"),
        ("convert_no_checkpoint", "convert", ["--model-type", "GPT", "--loader", "megatronish", "--saver", "hf",
                                              "--load-dir", p["empty_dir"], "--save-dir", str(d / "c4")], "empty"),
        ("convert_bad_checkpoint", "convert", ["--model-type", "GPT", "--loader", "megatronish", "--saver", "hf",
                                               "--load-dir", p["ck_bad_metadata"], "--save-dir", str(d / "c5")],
         "ck_bad_metadata"),
        ("inspect_missing", "inspect", [str(d / "nockpt")], "nockpt"),
        ("inspect_tracker", "inspect", [p["ck_tracker_garbage"]], "latest_checkpointed_iteration.txt"),
        ("inspect_bad_metadata", "inspect", [p["ck_bad_metadata"]], "ck_bad_metadata"),
        ("inspect_no_metadata", "inspect", [p["ck_no_metadata"]], "ck_no_metadata"),
    ]


def _check(name, code, out, seconds, needle):
    problems = []
    if code != 2:
        problems.append(f"exit code {code}")
    if "Traceback" in out:
        problems.append("a traceback")
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    if len(errors) != 1:
        problems.append(f"{len(errors)} error: lines, not one")
    elif needle not in errors[0]:
        problems.append(f"no error line names {needle!r}")
    if seconds > LIMIT_S:
        problems.append(f"took {seconds:.0f} s")
    return f"{name}: {', '.join(problems)}\n{out[-1500:]}" if problems else None


def test_catalogue_of_bad_inputs(inputs, tmp_path):
    cases = _cases(inputs)
    assert len(cases) >= 40
    assert {c[1] for c in cases} == {"pretrain", "preprocess", "merge", "convert", "inspect"}
    results = run_cases([c[:3] for c in cases], tmp_path)
    failures = [f for f in (_check(name, *results[name], needle) for name, _, _, needle in cases) if f]
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


def _torchrun(tmp_path, argv, nproc=2, timeout=120):
    env = subprocess_env(OMP_NUM_THREADS="1", MEGATRONISH_DEVICE="cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "pretrain_gpt.py"), *argv]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def _project_frames(text):
    return [line for line in text.splitlines() if line.lstrip().startswith("File \"")
            and ("megatronish" in line or "pretrain_gpt.py" in line)]


@pytest.mark.parametrize("case", ["idx_bad_magic", "load_bad_metadata"])
def test_rank_side_error_is_one_line_for_the_job(inputs, tmp_path, case):
    """Two ranks see the same bad input: one line for the job, no traceback through the project, both exit."""
    arg = {"idx_bad_magic": ["--data-path", inputs["bad_magic"]],
           "load_bad_metadata": ["--mock-data", "--load", inputs["ck_bad_metadata"]]}[case]
    proc, seconds = _torchrun(tmp_path, MODEL + NULL_TOK + ["--global-batch-size", "4"] + arg)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and seconds < LIMIT_S, out[-3000:]
    assert len(errors) == 1, out[-3000:]
    assert ("bad_magic.idx" if case == "idx_bad_magic" else "ck_bad_metadata") in errors[0]
    assert not _project_frames(out), out[-3000:]
    assert "exitcode  : 2" in out  # torchrun's report: the ranks exited 2
