"""lm-evaluation-harness against ``jaxpaged serve`` (issue 54): SmolLM2 in float32 scores a small local
multiple-choice task through ``local-completions`` (loglikelihoods from ``echo`` + ``logprobs``) and a
``generate_until`` task through ``local-chat-completions``, and lm-eval's own ``hf`` backend on the same
weights is the reference: the same loglikelihoods, so the same answers, and the same greedy replies.

Everything is offline: the tasks are a YAML and a JSONL written here, the model is the installed GGUF
dequantized by transformers and saved as a float32 directory that both the server and ``hf`` load.
``jaxpaged_serve`` starts a real server process and is shared with tests/test_guidellm.py."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import transformers
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # benchmarks/, as a package

from benchmarks.serving import free_port, jaxpaged_command, start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.slow

SERVED = "smollm2"
"""The name the server answers to (``--served-model-name``)."""
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TIE = 1e-3
"""Two choices whose logprobs differ by less than this are a near-tie: the backends may pick either."""

MC_ITEMS = [  # (question, choices, index of the right one)
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What is the capital of Japan?", ["Beijing", "Tokyo", "Seoul"], 1),
    ("What is the capital of Italy?", ["Rome", "Vienna", "Athens", "Lisbon"], 0),
    ("What is the capital of Germany?", ["Munich", "Hamburg", "Berlin"], 2),
    ("What is the capital of Spain?", ["Barcelona", "Madrid", "Seville", "Valencia"], 1),
    ("What is the capital of the United Kingdom?", ["London", "Dublin", "Edinburgh"], 0),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("What is 10 - 3?", ["7", "13", "6"], 0),
    ("What is 5 times 6?", ["11", "56", "30", "25"], 2),
    ("What is half of 100?", ["25", "50", "200"], 1),
    ("What colour is the sky on a clear day?", ["green", "blue", "red", "black"], 1),
    ("What colour is grass?", ["green", "purple", "orange"], 0),
    ("What colour is snow?", ["black", "brown", "white", "blue"], 2),
    ("What colour are ripe bananas?", ["yellow", "blue", "grey"], 0),
    ("How many legs does a dog have?", ["two", "four", "six", "eight"], 1),
    ("How many days are in a week?", ["five", "seven", "ten"], 1),
    ("Which animal says meow?", ["a dog", "a cow", "a cat", "a duck"], 2),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus"], 1),
    ("What do bees make?", ["milk", "honey", "silk", "wool"], 1),
    ("Which is the largest ocean?", ["the Pacific", "the Atlantic", "the Indian Ocean", "the Arctic"], 0),
]
GEN_ITEMS = [
    ("What is 2 + 3?", "5"),
    ("What is 4 + 4?", "8"),
    ("What is 9 - 2?", "7"),
    ("What is 3 times 3?", "9"),
    ("What is 10 + 10?", "20"),
    ("What is 6 - 5?", "1"),
    ("What is 12 divided by 4?", "3"),
    ("What is 7 + 1?", "8"),
]


@contextlib.contextmanager
def jaxpaged_serve(log: pathlib.Path, model: str, *flags: str) -> Iterator[str]:
    """``jaxpaged serve MODEL *flags`` offline on a free 127.0.0.1 port (the serving benchmark's helpers),
    output to ``log``; yields its URL once /health answers, then stops it."""
    port = free_port()
    command, env = jaxpaged_command(model, port, list(flags))
    proc, url = start_server("jaxpaged", command, {**env, **OFFLINE}, port, 300, log)
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def float32_dir(tmp_path_factory, hf_smollm2_model, smollm2_tokenizer) -> pathlib.Path:
    """transformers' float32 dequantization of the GGUF, saved with its tokenizer: the one checkpoint
    that ``hf`` and the server both load. (transformers will not save a GGUF-loaded model, so its
    weights go into a fresh model of the same config without the GGUF ``quantization_config``.)"""
    path = tmp_path_factory.mktemp("smollm2-float32")
    config = copy.deepcopy(hf_smollm2_model.config)
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(hf_smollm2_model.state_dict())
    model.save_pretrained(path)
    smollm2_tokenizer.hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> pathlib.Path:
    """The two tasks' YAMLs (for ``--include_path``) and their JSONL data."""
    path = tmp_path_factory.mktemp("lm_eval_tasks")
    data = {
        "jaxpaged_mc": [dict(question=q, choices=c, answer=a) for q, c, a in MC_ITEMS],
        "jaxpaged_gen": [dict(question=q, answer=a) for q, a in GEN_ITEMS],
    }
    tasks = {
        "jaxpaged_mc": dict(
            output_type="multiple_choice",
            doc_to_text="Question: {{question}}\nAnswer:",
            doc_to_choice="{{choices}}",
            doc_to_target="{{answer}}",
            metric_list=[{"metric": "acc"}],
        ),
        # The model answers "2 + 3 = 5": the last number of the first line is its answer.
        "jaxpaged_gen": dict(
            output_type="generate_until",
            doc_to_text="{{question}} Reply with the number only.",
            doc_to_target="{{answer}}",
            generation_kwargs=dict(until=["\n"], max_gen_toks=16, do_sample=False),
            filter_list=[
                dict(
                    name="last_number",
                    filter=[
                        dict(function="regex", regex_pattern=r"(-?\d+)", group_select=-1),
                        dict(function="take_first"),
                    ],
                )
            ],
            metric_list=[{"metric": "exact_match"}],
        ),
    }
    for name, config in tasks.items():
        jsonl = path / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps(item) + "\n" for item in data[name]))
        config = dict(
            task=name,
            dataset_path="json",
            dataset_kwargs={"data_files": {"test": str(jsonl)}},
            test_split="test",
            **config,
        )
        (path / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def served(float32_dir, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("lm_eval_server") / "server.log"
    with jaxpaged_serve(
        log,
        str(float32_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        SERVED,
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
    ) as url:
        yield url


def lm_eval(
    out: pathlib.Path, task_dir: pathlib.Path, model: str, model_args: str, *flags: str
) -> list[dict]:
    """Runs the ``lm_eval`` command on one task of ``task_dir`` with ``--log_samples``; prints its
    table and returns its samples in document order."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            model,
            "--model_args",
            model_args,
            "--include_path",
            str(task_dir),
            "--output_path",
            str(out),
            "--log_samples",
            *flags,
        ],
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(out.parent / "datasets")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    print(
        f"\nlm_eval --model {model} {' '.join(flags)}:\n"
        + "\n".join(line for line in proc.stdout.splitlines() if line.startswith("|"))
    )
    (samples,) = out.glob("*/samples_*.jsonl")
    return sorted(map(json.loads, samples.read_text().splitlines()), key=lambda s: s["doc_id"])


def choice_logprobs(samples: list[dict]) -> list[list[float]]:
    """Each document's loglikelihood of each choice (``resps``: ``[[logprob, is_greedy]]`` per choice)."""
    return [[float(resp[0][0]) for resp in s["resps"]] for s in samples]


def test_multiple_choice_through_local_completions_matches_hf(served, float32_dir, task_dir, tmp_path):
    hf = lm_eval(
        tmp_path / "hf",
        task_dir,
        "hf",
        f"pretrained={float32_dir},dtype=float32",
        "--tasks",
        "jaxpaged_mc",
        "--device",
        "cpu",
        "--batch_size",
        "8",
    )
    ours = lm_eval(
        tmp_path / "ours",
        task_dir,
        "local-completions",
        f"model={SERVED},base_url={served}/v1/completions,tokenizer={float32_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=4,max_retries=1",
        "--tasks",
        "jaxpaged_mc",
    )
    assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in hf] == list(range(len(MC_ITEMS)))
    hf_lp, our_lp = choice_logprobs(hf), choice_logprobs(ours)
    worst = max(abs(h - o) for hs, ps in zip(hf_lp, our_lp) for h, o in zip(hs, ps, strict=True))
    print(f"largest |logprob difference| over {sum(map(len, hf_lp))} choices: {worst:.2e}")
    assert worst < TIE
    # The same answers, but for at most one near-tie (its two choices' logprobs within TIE in hf's scores).
    flipped = [i for i, (h, o) in enumerate(zip(hf_lp, our_lp)) if h.index(max(h)) != o.index(max(o))]
    assert len(flipped) <= 1 and all(
        abs(max(hf_lp[i]) - hf_lp[i][our_lp[i].index(max(our_lp[i]))]) < TIE for i in flipped
    ), flipped
    assert abs(sum(s["acc"] for s in ours) - sum(s["acc"] for s in hf)) <= len(flipped)
    # Not every answer right nor wrong, so the accuracy measured something.
    assert 0 < sum(s["acc"] for s in hf) < len(MC_ITEMS)


def test_generate_until_through_local_chat_completions_matches_hf(served, float32_dir, task_dir, tmp_path):
    hf = lm_eval(
        tmp_path / "hf",
        task_dir,
        "hf",
        f"pretrained={float32_dir},dtype=float32",
        "--tasks",
        "jaxpaged_gen",
        "--apply_chat_template",
        "--device",
        "cpu",
        "--batch_size",
        "8",
    )
    ours = lm_eval(
        tmp_path / "ours",
        task_dir,
        "local-chat-completions",
        f"model={SERVED},base_url={served}/v1/chat/completions,num_concurrent=4,max_retries=1",
        "--tasks",
        "jaxpaged_gen",
        "--apply_chat_template",
    )
    # Greedy in float32 on the same weights and chat template: the same replies, so the same scores.
    assert [s["resps"] for s in ours] == [s["resps"] for s in hf]
    assert all(s["resps"][0][0].strip() for s in ours)
    assert [s["exact_match"] for s in ours] == [s["exact_match"] for s in hf]
    assert sum(s["exact_match"] for s in ours) > 0
