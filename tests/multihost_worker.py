"""One process of a multi-host run on this machine (used by tests/test_tensor_parallel.py):

    python tests/multihost_worker.py MODEL_DIR PORT NUM_PROCESSES PROCESS_ID

Every process builds the engine over all processes' CPU devices (tensor_parallel_size = their
number); process 0 generates greedily for fixed prompts and prints them as JSON on its last
line, the others follow its steps."""

from __future__ import annotations

import json
import sys

from jaxpaged import distributed
from jaxpaged.config import EngineArgs
from jaxpaged.sampling_params import SamplingParams

PROMPTS = [[5, 9, 17, 33, 2, 101, 7], list(range(40, 75)), [300]]


def main(model: str, port: int, num_processes: int, process_id: int) -> None:
    distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    args = EngineArgs(
        model=model,
        tensor_parallel_size=num_processes,
        num_gpu_blocks_override=32,
        block_size=4,
        max_num_batched_tokens=16,
    )
    engine = distributed.build_engine(args)
    if engine is None:
        return
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = [c.token_ids, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]]
    distributed.stop_followers(engine)
    print(json.dumps([done[str(i)] for i in range(len(PROMPTS))]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
