"""Task instances and predictions in the SWE-bench format, and their loaders.

An instance names the task image, where the repository sits in it, the commit
to grade against, the test patch, the tests that must go from failing to
passing (``FAIL_TO_PASS``) and those that must keep passing
(``PASS_TO_PASS``), the test command and the log parser. SWE-bench stores the
two test lists as JSON-encoded strings; plain lists work as well.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from sandman import errors

__all__ = ["Instance", "LogParser", "Prediction", "load_instances", "load_predictions"]

LogParser = Literal["pytest", "unittest", "django"]


def _json_list(value: object) -> object:
    """SWE-bench's datasets hold the test lists as JSON text: decode them."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list of test names: {exc}") from exc
    return value


TestList = Annotated[list[str], BeforeValidator(_json_list)]

M = TypeVar("M", bound=BaseModel)

_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


class Instance(BaseModel):
    """One task: a repository at ``base_commit`` in ``image``, and how to grade a patch to it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    instance_id: str = Field(min_length=1)
    image: str = Field(min_length=1)
    """The task image: a name, ``sha256:<id>`` or ``name@sha256:<digest>``."""
    repo_path: str = "/testbed"
    """Where the git repository is in the image."""
    base_commit: str = Field(min_length=4)
    test_patch: str
    FAIL_TO_PASS: TestList
    PASS_TO_PASS: TestList = []
    test_cmd: str = Field(min_length=1)
    """Run in ``repo_path`` with the test files (or ``test_directives``) appended."""
    test_directives: list[str] | None = None
    """What to append to ``test_cmd``; default: the files the test patch touches."""
    log_parser: LogParser = "pytest"
    protected: list[str] = []
    """More globs (repository-relative) the model patch may not change, besides the defaults."""
    repo: str = ""
    problem_statement: str = ""

    @property
    def test_files(self) -> list[str]:
        """The files the test patch touches, in the order it touches them."""
        found: list[str] = []
        for old, new in _DIFF_PATH.findall(self.test_patch):
            for path in (old, new):
                if path not in found:
                    found.append(path)
        return found

    @property
    def directives(self) -> list[str]:
        """What is appended to the test command."""
        return self.test_directives if self.test_directives is not None else self.test_files


class Prediction(BaseModel):
    """A model's answer to one instance: a patch (SWE-bench's ``model_patch``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    instance_id: str = Field(min_length=1)
    model_patch: str | None = None
    model_name_or_path: str = Field(default="model", min_length=1)

    @property
    def patch(self) -> str:
        return self.model_patch or ""


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, object) for each record of a JSON list or a JSONL file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise errors.ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise errors.ConfigError(f"{path}: not valid JSON: {exc}") from exc
        return [(f"{path}: item {n}", item) for n, item in enumerate(items, start=1)]
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            found.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise errors.ConfigError(f"{path}:{number}: not valid JSON: {exc}") from exc
    return found


def _load(path: Path, model: type[M]) -> list[M]:
    loaded = []
    for where, record in _records(Path(path)):
        if not isinstance(record, dict):
            raise errors.ConfigError(f"{where}: expected a JSON object")
        try:
            loaded.append(model.model_validate(record))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'record'}: {e['msg']}"
                for e in exc.errors()
            )
            raise errors.ConfigError(f"{where}: {problems}") from exc
    return loaded


def load_instances(path: str | Path) -> list[Instance]:
    """The instances in a JSON list or JSONL file. Raises `ConfigError` naming the bad record."""
    instances = _load(Path(path), Instance)
    seen: set[str] = set()
    for instance in instances:
        if instance.instance_id in seen:
            raise errors.ConfigError(f"{path}: instance {instance.instance_id!r} appears twice")
        seen.add(instance.instance_id)
    return instances


def load_predictions(path: str | Path) -> list[Prediction]:
    """The predictions in a JSON list or JSONL file (several models may share one file)."""
    return _load(Path(path), Prediction)
