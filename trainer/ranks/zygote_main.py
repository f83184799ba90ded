"""The rank zygote's process (`python -m rlvr.trainer.ranks.zygote_main REPLIES_FD RANK0_PID`; zygote.py is rank 0's
side): it imports what a rank imports, then forks a rank per request (rlvr/fork_requests.py), each running
launch.py's `main` with the arguments and the environment rank 0 asked with."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import traceback
from collections.abc import Sequence

from rlvr.fork_requests import serve_forks
from rlvr.trainer.ranks import launch

PRELOADED = ("transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama")  # tiny, SmolLM2


def main(argv: Sequence[str]) -> None:
    replies, parent = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; the zygote goes when it does
    for module in PRELOADED:
        importlib.import_module(module)
    request = serve_forks(replies, parent)
    os.close(replies)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a rank takes Ctrl-C as a fresh interpreter would
    os.environ.clear()
    os.environ.update(request["env"])
    code = 1
    try:
        code = launch.main(request["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
