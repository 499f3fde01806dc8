"""Run an entry script's ``__main__`` once per argument list, all in ONE interpreter.

    python tests/e2e/_entry_driver.py cases.json results.json

``cases.json``: ``{"script": path, "cases": [[arg, ...], ...]}``; ``results.json``: per case
``{"returncode", "stdout", "stderr"}`` as a separate ``python script args...`` would give them
for what the entry writes through ``sys.stdout`` / ``sys.stderr`` (an uncaught exception prints
its traceback and returns 1, like the interpreter). Used for dry runs and user-error checks:
each separate interpreter pays ~5 s of CPU importing torch and transformers, which is most of
what one such case costs. The environment and the default process group are reset between cases.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def _run(script: str, args: list[str]) -> dict:
    import torch.distributed as dist

    env, hook = dict(os.environ), sys.excepthook  # init_process_group chains a hook per group
    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.argv = [script, *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported like the interpreter does
            traceback.print_exc()
            code = 1
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    sys.excepthook = hook
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    cases_path, results_path = sys.argv[1:3]  # each case replaces sys.argv
    with open(cases_path) as f:
        spec = json.load(f)
    results = [_run(spec["script"], case) for case in spec["cases"]]
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
