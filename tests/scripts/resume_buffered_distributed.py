"""Two processes (DDP over gloo, CPU): PRIME-RLOO with steps_per_generation=2, num_iterations=2, an uninterrupted
6-step run vs a run stopped after step 3 and resumed from checkpoint-2 (inside a generation window). Rank 0 writes the
per-step losses, the final policy / PRM weight digests and the checkpoint's files to <out>/result.json
(tests/prime/test_resume_buffered.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [
    os.path.join(os.path.dirname(HERE), "prime"),
    os.path.dirname(HERE),
    os.path.dirname(os.path.dirname(HERE)),
]

from accelerate import PartialState  # noqa: E402
from test_resume_buffered import StopAfter, _rows, _snap, make  # noqa: E402


def digest(module) -> str:
    sd, h = _snap(module), hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    opts = dict(spg=2, num_iterations=2, grad_accum=1, save_steps=2)
    full = make("prime_rloo", a.model, None, os.path.join(a.out, "full"), [], **opts)
    full.train()
    make("prime_rloo", a.model, None, os.path.join(a.out, "resumed"), [], callbacks=[StopAfter(3)], **opts).train()
    second = make("prime_rloo", a.model, None, os.path.join(a.out, "resumed"), [], **opts)
    checkpoint = os.path.join(a.out, "resumed", "checkpoint-2")
    second.train(resume_from_checkpoint=checkpoint)
    if PartialState().is_main_process:
        rows = {
            name: {s: r["loss"] for s, r in _rows(tr).items() if s >= 3}
            for name, tr in (("full", full), ("resumed", second))
        }
        result = dict(
            losses=rows,
            files=sorted(os.listdir(checkpoint)),
            policy=[digest(full.model), digest(second.model)],
            prm=[digest(full.prm_model), digest(second.prm_model)],
            prm_updates=[full.prm_optim.num_updates, second.prm_optim.num_updates],
        )
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
