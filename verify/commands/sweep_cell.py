"""One cell of ``python -m verify sweep``: a model type through ``check_model`` on one plan, in
its own process (a crash, a hang or a leaked gloo world ends with it).

``python -m verify.commands.sweep_cell TYPE PLAN MESH [--world-timeout S]`` prints, as its last stdout line, one JSON
object ``{"verdict": ..., "reason": ...}``: ``NOT BUILT`` when the tiny model does not build or
its eager training step on its own batch fails (the generic shrink rule's or the library's
limit, not the stack's), ``REFUSED`` when the stack raises its ValueError (a model it does not
support yet, said in one line), ``FAIL`` for any other exception (class and first line) or a
check that is not bitwise / not within the oracle, ``PASS`` otherwise.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch

from autoparallel.compiling_flag import tracing_as_compiling
from verify.check import check_model
from verify.hf import hf_case


TRACEBACK = "Traceback (most recent call last):"


def first_line(e: BaseException) -> str:
    """The message's first line; a line that ends in ':' is joined with the next (a wrapper's
    heading, like a strict dataclass's ``Class validation error ...:``, names nothing alone), a
    rank's traceback with its last line (the exception)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if any(line.endswith(TRACEBACK) for line in lines):  # a rank's error: the exception is the last line
        head = lines[0].removesuffix(TRACEBACK).strip()
        return f"{head} {lines[-1]}".strip()
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def build_step(model_type: str, *, attention_mask: bool = False):
    """The cell's case after one eager training step of its tiny model on its own batch (the
    model builds, runs forward and backward): raises what stops it. A tokens-only case whose
    forward fails with ``torch.compiler.is_compiling()`` true (what every trace of the stack sets)
    gets the tokenizer's all-ones mask: transformers' compiled branch of some encoders skips
    the default mask and reads ``None`` (longt5, switch_transformers: "'NoneType' object ..."),
    so a compiled training loop must pass one."""
    case = hf_case(model_type, attention_mask=attention_mask)
    model = case.build()
    batch = case.batches(2 * case.batch_per_rank, 1)[0]
    case.loss_fn(model(*batch[:-1]), batch[-1]).backward()
    if not attention_mask and not _runs_as_compiled(model, batch[:-1]):
        return build_step(model_type, attention_mask=True)
    return case


def _runs_as_compiled(model, inputs) -> bool:
    """Whether ``model`` runs forward on ``inputs`` with ``is_compiling()`` true."""
    try:
        with torch.no_grad(), tracing_as_compiling():
            model(*inputs)
    except Exception:  # noqa: BLE001 - the compiled branch's failure is the answer
        return False
    return True


def run_cell(model_type: str, plan: str, mesh: str, *, attention_mask: bool = False,
             world_timeout_s: float = 180.0) -> dict[str, str]:
    """The cell's verdict and reason (see the module docstring); ``world_timeout_s`` bounds the
    parity run's gloo world (the sweep passes its ``--timeout``)."""
    warnings.filterwarnings("ignore")  # the library's config notices, one per cell, are not the verdict
    try:
        case = build_step(model_type, attention_mask=attention_mask)
    except Exception as e:  # noqa: BLE001 - any failure to build is the verdict
        return {"verdict": "NOT BUILT", "reason": f"{type(e).__name__}: {first_line(e)}"}
    if plan == "build":
        return {"verdict": "PASS", "reason": ""}
    try:
        result = check_model(case, plan=plan, mesh=mesh, world_timeout_s=world_timeout_s)
    except ValueError as e:
        return {"verdict": "REFUSED", "reason": first_line(e)}
    except Exception as e:  # noqa: BLE001 - any other exception is the verdict
        return {"verdict": "FAIL", "reason": f"{type(e).__name__}: {first_line(e)}"}
    failures = result.failures()
    # A stage bitwise only with the eager program run as traced (the model's own is_compiling()
    # branch) is no failure: failures() leaves it out, and so does this verdict.
    if any(not rep.bitwise and not result.model_branch(stage) for stage, rep in result.parity.items()):
        return {"verdict": "FAIL", "reason": "NOT bitwise: " + failures[0].splitlines()[0]}
    if failures:  # bitwise at every stage, the oracle beyond its tolerance
        return {"verdict": "FAIL", "reason": failures[0].splitlines()[0]}
    reads = result.specialised_reads()
    if reads:  # PASS with the values the graphs hold as traced, each guarded at run time
        return {"verdict": "PASS", "reason": f"{len(reads)} value reads specialised and guarded: " + "; ".join(reads)}
    return {"verdict": "PASS", "reason": ""}


def main(argv: list[str]) -> int:
    model_type, plan, mesh = argv[:3]
    rest = argv[3:]
    mask = "--attention-mask" in rest
    world = float(rest[rest.index("--world-timeout") + 1]) if "--world-timeout" in rest else 180.0
    print(json.dumps(run_cell(model_type, plan, mesh, attention_mask=mask, world_timeout_s=world)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
