"""CI's smoke test of a fresh install: run a serve command, send it one chat completion, check the answer, stop it.

Usage: python smoke.py -- COMMAND...   (COMMAND serves on 127.0.0.1:8000, as README's first command does)
Standard library only: the venv under test has no test extra.
"""

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

URL = "http://127.0.0.1:8000"
START_TIMEOUT_S = 600
QUESTION = "What is the capital of France?"
EXPECTED = "Paris"


def _get(path: str) -> int:
    try:
        with urllib.request.urlopen(URL + path, timeout=5) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


def _chat() -> dict:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 32,
        "temperature": 0,
    }
    req = urllib.request.Request(
        URL + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def main(command: list[str]) -> int:
    started = time.monotonic()
    server = subprocess.Popen(command)
    try:
        while _get("/health") != 200:
            if server.poll() is not None:
                print(
                    f"smoke: the server exited with {server.returncode} before it listened", file=sys.stderr
                )
                return 1
            if time.monotonic() - started > START_TIMEOUT_S:
                print(f"smoke: the server did not listen within {START_TIMEOUT_S} s", file=sys.stderr)
                return 1
            time.sleep(1)
        print(f"smoke: listening after {time.monotonic() - started:.1f} s", flush=True)
        answer = _chat()
        text = answer["choices"][0]["message"]["content"]
        print(f"smoke: {QUESTION!r} -> {text!r}", flush=True)
        if EXPECTED not in text:
            print(f"smoke: expected {EXPECTED!r} in the answer", file=sys.stderr)
            return 1
        return 0
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[1:] if args[:1] == ["--"] else args))
