"""The driver ``/run_jupyter`` runs in its sandbox (`sandman.server.fusion`), as text."""

__all__ = ["KERNEL"]

# Runs on the image's python3 (3.6 and later): the cells of a /run_jupyter request in
# one interpreter, as a Jupyter kernel would: one namespace, the value of a cell's
# last expression displayed (``text/plain``, its repr), an exception reported as
# Jupyter's error content and the next cell run all the same. Output written through
# sys.stdout and sys.stderr is the cell's; ``cell_timeout`` interrupts a cell with
# TimeoutError (SIGALRM).
KERNEL = r"""
import ast, io, json, signal, sys, traceback
config = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
real_out, real_err = sys.stdout, sys.stderr
def expired(signum, frame):
    raise TimeoutError("cell timed out")
signal.signal(signal.SIGALRM, expired)
cells = []
for number, source in enumerate(config["cells"]):
    result = {"stdout": "", "stderr": "", "display": [], "error": []}
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err
    try:
        if config["cell_timeout"] > 0:
            signal.setitimer(signal.ITIMER_REAL, config["cell_timeout"])
        tree = ast.parse(source, "<cell-%d>" % number)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell-%d>" % number, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<cell-%d>" % number, "eval"), namespace)
            if value is not None:
                result["display"].append({"text/plain": repr(value)})
    except BaseException as exc:
        kind = type(exc)
        result["error"].append({
            "ename": kind.__name__,
            "evalue": str(exc),
            "traceback": traceback.format_exception(kind, exc, exc.__traceback__),
        })
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout, sys.stderr = real_out, real_err
    result["stdout"], result["stderr"] = out.getvalue(), err.getvalue()
    cells.append(result)
with open(sys.argv[2], "w") as f:
    json.dump({"status": "Finished", "cells": cells}, f)
"""
