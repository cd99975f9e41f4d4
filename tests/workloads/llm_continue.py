"""Run by test_llm_engine in a fresh process: import an engine state from a file, finish it, print the texts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llm_support import engine, load_state, wait_for  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    state, tensors = load_state(Path(sys.argv[1]))
    e = engine()
    ids = e.import_state(state, tensors)
    outs = {rid: e.outputs[rid] for rid in ids}
    wait_for(lambda: all(o.done for o in outs.values()), "the imported requests to finish")
    e.close()
    print(json.dumps({rid: {"text": o.text, "tokens": o.tokens, "finish": o.finish_reason} for rid, o in outs.items()}))


if __name__ == "__main__":
    main()
