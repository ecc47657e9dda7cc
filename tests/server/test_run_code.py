"""``POST /run_code`` (SandboxFusion's API) on the local provider, driven by the client code
verl and ROLL ship (vendored in ``fusion_clients/``, loaded by path) and by plain HTTP for
the refusals. After every test no sandbox is held and no session is open; at the end
the provider holds nothing (``fresh_local_provider``)."""

from __future__ import annotations

import base64
import contextlib
import importlib.machinery
import importlib.util
import shutil
import time
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from sandman.pool import Pool, PoolConfig
from sandman.server import create_app
from sandman.server.settings import RunCodeSettings
from tests.images.debian import debian_python_tar
from tests.providers.local.conftest import needs_root_and_crun
from tests.server.conftest import AUTH_A, KEY_A, serve_in_thread, settings
from tests.server.fusion_images import polyglot_tar

pytestmark = [
    needs_root_and_crun,
    pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap"),
    pytest.mark.timeout(1800),  # the first run on a machine builds the images
]

CLIENTS = Path(__file__).parent / "fusion_clients"


def _load(name: str, file: str) -> types.ModuleType:
    loader = importlib.machinery.SourceFileLoader(name, str(CLIENTS / file))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def verl() -> types.ModuleType:
    """verl's ``verl/utils/reward_score/sandbox_fusion/utils.py``."""
    return _load("verl_sandbox_fusion_utils", "verl_sandbox_fusion_utils.py.txt")


@pytest.fixture(scope="module")
def roll() -> types.ModuleType:
    """ROLL's ``roll/pipeline/rlvr/rewards/code_sandbox_reward_worker.py`` (its client part)."""
    return _load("roll_code_sandbox_reward_worker", "roll_code_sandbox_reward_worker.py.txt")


class Served:
    def __init__(self, url: str, pool: Pool, loop: Any) -> None:
        self.url = url
        self.pool = pool
        self.loop = loop
        host = url.removeprefix("http://")
        # What verl and ROLL are given: the key in the URL (HTTP Basic), no header needed.
        self.run_code = f"http://a:{KEY_A}@{host}/run_code"

    def held(self) -> tuple[int, int]:
        """Sandboxes leased and sessions open in the pool now."""
        import asyncio

        async def look() -> tuple[int, int]:
            leased = sum(1 for r in self.pool.list() if r.state in ("leased", "releasing"))
            return leased, int(self.pool.stats()["sessions"])

        return asyncio.run_coroutine_threadsafe(look(), self.loop).result(10)

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while (held := self.held()) != (0, 0):
            assert time.monotonic() < deadline, f"left behind (leased, sessions): {held}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    from tests.providers.local.fresh import fresh_local_provider

    python = debian_python_tar()
    polyglot = polyglot_tar()

    @contextlib.asynccontextmanager
    async def setup() -> AsyncIterator[tuple[FastAPI, Pool]]:
        async with fresh_local_provider(python, ("fusion-python",)) as provider:
            await provider.images.import_archive(polyglot, name="fusion-polyglot")
            pool = Pool(provider, PoolConfig(name="fusion"))
            limits = RunCodeSettings(max_run_timeout=30, warm=1)
            yield create_app(pool, settings(close_pool=True, run_code=limits)), pool

    with serve_in_thread(setup, name="uvicorn-fusion", start_timeout=120, stop_timeout=120) as (
        url,
        pool,
        loop,
    ):
        yield Served(url, pool, loop)


@pytest.fixture(autouse=True)
def nothing_held(served: Served) -> Iterator[None]:
    yield
    served.wait_idle()


def post(
    served: Served, body: dict[str, Any], timeout: httpx.Timeout | float = 60
) -> httpx.Response:
    return httpx.post(f"{served.url}/run_code", json=body, headers=AUTH_A, timeout=timeout)


# -- verl's client --------------------------------------------------------------------------

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
CPP_ADD = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}\n"


def test_verl_accepted_and_wrong_answer(served: Served, verl: types.ModuleType) -> None:
    in_outs = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    results, meta = verl.check_correctness(served.run_code, in_outs, ADD, timeout=5)
    assert results == [True, True], meta
    wrong = {"inputs": ["1 2\n"], "outputs": ["4\n"]}
    results, meta = verl.check_correctness(served.run_code, wrong, ADD, timeout=5)
    assert results == [False] and meta[0]["status"] == "wrong_answer", meta


def test_verl_timeout_runtime_error_and_memory(served: Served, verl: types.ModuleType) -> None:
    one = {"inputs": [""], "outputs": [""]}
    results, meta = verl.check_correctness(served.run_code, one, "while True: pass\n", timeout=1)
    assert results == [-3] and meta[0]["run_status"] == "TimeLimitExceeded", meta
    results, meta = verl.check_correctness(served.run_code, one, "raise SystemExit(3)\n")
    assert results == [-2] and meta[0]["exit_code"] == 3, meta
    hog = "x = b'x' * (512 * 2**20)\nprint(len(x))\n"
    results, meta = verl.check_correctness(served.run_code, one, hog, memory_limit_mb=128)
    assert results == [-2] and meta[0]["exit_code"] != 0, meta


def test_verl_cpp_compile_error_and_accepted(served: Served, verl: types.ModuleType) -> None:
    in_outs = {"inputs": ["40 2\n"], "outputs": ["42\n"]}
    results, meta = verl.check_correctness(served.run_code, in_outs, CPP_ADD, language="cpp")
    assert results == [True], meta
    results, meta = verl.check_correctness(
        served.run_code, in_outs, "int main() { return x; }\n", language="cpp"
    )
    assert results == [-4] and meta[0]["status"] == "compile_error", meta
    assert "x" in meta[0]["compile_stderr"]


NODE_ADD = (
    "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(' ').map(Number);\n"
    "console.log(a + b);\n"
)
GO_ADD = (
    'package main\nimport "fmt"\n'
    "func main() { var a, b int; fmt.Scan(&a, &b); fmt.Println(a + b) }\n"
)
JAVA_ADD = (
    "import java.util.*;\npublic class Main { public static void main(String[] x) {\n"
    "  Scanner s = new Scanner(System.in); System.out.println(s.nextInt() + s.nextInt()); } }\n"
)


@pytest.mark.parametrize(
    ("language", "code"),
    [("bash", "read a b; echo $((a + b))\n"), ("nodejs", NODE_ADD), ("go", GO_ADD),
     ("java", JAVA_ADD)],
    ids=["bash", "nodejs", "go", "java"],
)  # fmt: skip
def test_verl_other_languages(
    served: Served, verl: types.ModuleType, language: str, code: str
) -> None:
    in_outs = {"inputs": ["40 2\n"], "outputs": ["42\n"]}
    results, meta = verl.check_correctness(
        served.run_code, in_outs, code, timeout=20, language=language
    )
    assert results == [True], meta


# -- ROLL's client --------------------------------------------------------------------------


def test_roll_verdicts(served: Served, roll: types.ModuleType) -> None:
    tester = roll.CodeTester(served.run_code)
    tester.DEFAULT_TIMEOUT = 2
    cases = [
        {"stdin": "1 2\n", "expected_stdout": "3"},
        {"stdin": "5 7\n", "expected_stdout": "12"},
    ]
    good = tester.single_code_test(0, "p", f"```python\n{ADD}```", "input", cases)
    assert good["pass_test_ratio"] == 1 and good["succeed_test_cases_number"] == 2, good
    bad = tester.single_code_test(0, "p", "```python\nprint(0)\n```", "input", cases)
    assert bad["pass_test_number"] == 0 and bad["error_info"] == ["LogicError"], bad
    slow = tester.single_code_test(0, "p", "```python\nwhile True: pass\n```", "input", cases[:1])
    timed_out = slow["sandbox_responses"][0][0]
    assert slow["pass_test_number"] == 0 and timed_out["status"] == "Failed", slow
    assert timed_out["run_result"]["status"] == "TimeLimitExceeded"
    hog = "```python\nx = b'x' * (4 * 2**30)\n```"
    oom = tester.single_code_test(0, "p", hog, "input", cases[:1])
    assert oom["pass_test_number"] == 0
    assert oom["sandbox_responses"][0][0]["run_result"]["return_code"] != 0, oom
    broken = tester.single_code_test(
        0, "p", "```cpp\nint main() { return x; }\n```", "input", cases
    )
    compile_error = broken["sandbox_responses"][0][0]
    assert broken["pass_test_number"] == 0 and compile_error["status"] == "Failed", broken
    assert compile_error["run_result"] is None
    assert compile_error["compile_result"]["return_code"] != 0
    score, info, _ = roll.cal_http_sandbox(
        0, "p", "", f"```python\n{ADD}```", "input", cases, served.run_code
    )
    assert score == 1, info


# -- SandboxFusion's own shapes, over plain HTTP -------------------------------------------


def test_files_and_fetch_files(served: Served) -> None:
    data = base64.b64encode(b"hello\x00world").decode()
    answer = post(
        served,
        {
            "language": "python",
            "code": "import shutil; shutil.copy('in/data.bin', 'out.bin')\n",
            "files": {"in/data.bin": data, "skipped": None},
            "fetch_files": ["out.bin", "missing.txt"],
        },
    ).json()
    assert answer["status"] == "Success", answer
    assert answer["files"] == {"out.bin": data}
    assert answer["compile_result"] is None and answer["message"] == ""
    assert set(answer["run_result"]) == {
        "status", "execution_time", "return_code", "stdout", "stderr"
    }  # fmt: skip
    assert answer["executor_pod_name"]


@pytest.mark.parametrize(
    ("body", "where", "kind"),
    [
        ({"language": "cobol", "code": "x"}, ["body", "language"], "literal_error"),
        ({"language": "python"}, ["body", "code"], "missing"),
        ({"language": "python", "code": "x", "run_timeout": 31}, ["body", "run_timeout"],
         "less_than_equal"),
        ({"language": "python", "code": "#" * 300_000}, ["body", "code"], "string_too_long"),
        ({"language": "python", "code": "x", "memory_limit_MB": 10**6},
         ["body", "memory_limit_MB"], "less_than_equal"),
    ],
)  # fmt: skip
def test_invalid_input_gets_fastapi_detail(
    served: Served, body: dict[str, Any], where: list[str], kind: str
) -> None:
    response = post(served, body)
    assert response.status_code == 422, response.text
    (problem,) = response.json()["detail"]
    assert problem["loc"] == where and problem["type"] == kind, problem


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"language": "python", "code": "x", "files": {"a": "not base64!"}}, "base64"),
        ({"language": "rust", "code": "fn main() {}"}, "not served"),
        ({"language": "python", "code": "import sys\nwhile True: sys.stdout.write('x' * 65536)",
          "run_timeout": 2},
         "output past the limit"),
    ],
)  # fmt: skip
def test_sandbox_errors(served: Served, body: dict[str, Any], says: str) -> None:
    response = post(served, body)
    assert response.status_code == 200
    answer = response.json()
    assert answer["status"] == "SandboxError" and says in answer["message"], answer


def test_keys_and_tenants(served: Served) -> None:
    body = {"language": "python", "code": "print(1)"}
    refused = httpx.post(f"{served.url}/run_code", json=body, timeout=30)
    assert refused.status_code == 401 and "detail" in refused.json()
    wrong = httpx.post(f"{served.url}/run_code", json=body, auth=("a", "x" * 20), timeout=30)
    assert wrong.status_code == 401
    ok = httpx.post(f"{served.url}/run_code", json=body, auth=("a", KEY_A), timeout=30)
    assert ok.json()["run_result"]["stdout"] == "1\n"
    # Its sandbox was the tenant's: listed (gone) among a's sandboxes, not among b's.
    sandbox = ok.json()["executor_pod_name"]
    mine = httpx.get(f"{served.url}/v1/sandboxes", headers=AUTH_A, timeout=30).json()
    assert sandbox in {s["id"] for s in mine["sandboxes"]}


def test_a_client_that_goes_away_mid_run_leaves_nothing(served: Served) -> None:
    body = {"language": "python", "code": "import time; time.sleep(25)", "run_timeout": 30}
    with pytest.raises(httpx.ReadTimeout):
        post(served, body, timeout=httpx.Timeout(30, read=2))
    started = time.monotonic()
    served.wait_idle(timeout=10)
    assert time.monotonic() - started < 10


# -- /run_jupyter ---------------------------------------------------------------------------


def jupyter(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{served.url}/run_jupyter", json=body, headers=AUTH_A, timeout=60)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_jupyter_cells_share_one_interpreter(served: Served) -> None:
    cells = ["a = 123", "a", "print(a)", "import sys; sys.stderr.write('err')",
             "raise RuntimeError('boom')", "a + 1", "import time; time.sleep(5)",
             "open('out.txt', 'w').write(open('in.txt').read() * 2)"]  # fmt: skip
    answer = jupyter(
        served,
        {
            "cells": cells,
            "cell_timeout": 1,
            "total_timeout": 20,
            "files": {"in.txt": base64.b64encode(b"ab").decode()},
            "fetch_files": ["out.txt"],
        },
    )
    assert answer["status"] == "Success" and answer["driver"]["status"] == "Finished", answer
    out = answer["cells"]
    assert len(out) == len(cells)
    assert out[1]["display"] == [{"text/plain": "123"}] and out[0]["display"] == []
    assert out[2]["stdout"] == "123\n" and out[3]["stderr"] == "err"
    assert out[4]["error"][0]["ename"] == "RuntimeError" and out[4]["error"][0]["evalue"] == "boom"
    assert out[5]["display"] == [{"text/plain": "124"}]  # the error did not end the kernel
    assert out[6]["error"][0]["ename"] == "TimeoutError"  # cell_timeout
    assert answer["files"] == {"out.txt": base64.b64encode(b"abab").decode()}


def test_jupyter_total_timeout_and_limits(served: Served) -> None:
    answer = jupyter(served, {"cells": ["x = 1", "while True: pass"], "total_timeout": 1})
    assert answer["status"] == "Failed" and answer["cells"] == [], answer
    assert answer["driver"]["status"] == "TimeLimitExceeded"
    response = httpx.post(
        f"{served.url}/run_jupyter",
        json={"cells": ["1"], "total_timeout": 10**4},
        headers=AUTH_A,
        timeout=30,
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "total_timeout"]
