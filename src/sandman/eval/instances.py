"""Task instances and predictions in the SWE-bench format, and their loaders.

An instance names the task image, where the repository sits in it, the commit
to grade against, the test patch, the tests that must go from failing to
passing (``FAIL_TO_PASS``) and those that must keep passing
(``PASS_TO_PASS``), the test command and the log parser. SWE-bench stores the
two test lists as JSON-encoded strings; plain lists work as well.

A SWE-bench dataset row, unchanged, is an instance: the image, test command,
directives, pre-test commands and log parser follow from its ``repo`` and
``version`` as the official harness derives them (`sandman.eval.swebench`).
Fields given in the row win. Files: JSONL, a JSON list, or the dataset's
parquet (with pyarrow installed).
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from sandman import errors
from sandman.eval import swebench

__all__ = ["Instance", "LogParser", "Prediction", "load_instances", "load_predictions"]

LogParser = Literal[
    "pytest",
    "pytest_options",
    "pytest_v2",
    "matplotlib",
    "seaborn",
    "django",
    "sympy",
    "unittest",
]
"""Ours, one per log format; SWE-bench's ``parse_log_*`` names are accepted too."""

# SWE-bench's parser names (5.x rows carry one in ``log_parser``) -> ours.
_SWEBENCH_PARSERS: dict[str, str] = {
    **{f"parse_log_{name}": "pytest" for name in (
        "pytest", "astroid", "flask", "marshmallow", "pvlib", "pyvista", "sqlfluff", "xarray")},
    **{f"parse_log_{name}": "pytest_options" for name in (
        "pytest_options", "pydicom", "requests", "pylint")},
    **{f"parse_log_{name}": "pytest_v2" for name in ("pytest_v2", "astropy", "scikit", "sphinx")},
    "parse_log_django": "django",
    "parse_log_seaborn": "seaborn",
    "parse_log_sympy": "sympy",
    "parse_log_matplotlib": "matplotlib",
}  # fmt: skip


def _parser_name(value: object) -> object:
    return _SWEBENCH_PARSERS.get(value, value) if isinstance(value, str) else value


def _json_list(value: object) -> object:
    """SWE-bench's datasets hold the test lists as JSON text: decode them."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list of test names: {exc}") from exc
    return value


def _version(value: object) -> object:
    """SWE-bench versions are text ("3.0"); a number from a loose JSON writer becomes text."""
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


TestList = Annotated[list[str], BeforeValidator(_json_list)]

M = TypeVar("M", bound=BaseModel)

_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


class Instance(BaseModel):
    """One task: a repository at ``base_commit`` in ``image``, and how to grade a patch to it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    instance_id: str = Field(min_length=1)
    image: str = Field(min_length=1)
    """The task image: a name, ``sha256:<id>`` or ``name@sha256:<digest>``.

    Default for a SWE-bench repository: its prebuilt image (`swebench.image_name`)."""
    repo_path: str = "/testbed"
    """Where the git repository is in the image."""
    base_commit: str = Field(min_length=4)
    test_patch: str
    FAIL_TO_PASS: TestList
    PASS_TO_PASS: TestList = []
    test_cmd: str = Field(min_length=1)
    """Run in ``repo_path`` with the test files (or ``test_directives``) appended."""
    test_directives: list[str] | None = None
    """What to append to ``test_cmd``; default: the files the test patch touches (for a
    SWE-bench repository, those SWE-bench appends: `swebench.test_directives`)."""
    pre_test: list[str] = []
    """Shell commands to run before ``test_cmd``, in the same shell (SWE-bench's eval
    script: activate the conda env, export a locale, reinstall the package)."""
    log_parser: Annotated[LogParser, BeforeValidator(_parser_name)] = "pytest"
    protected: list[str] = []
    """More globs (repository-relative) the model patch may not change, besides the defaults."""
    allow_binary: bool = False
    """Whether a model patch may carry binary hunks (refused by default: nothing
    a source fix needs, and a ``.pyc`` or archive is code no reviewer reads)."""
    repo: str = ""
    version: Annotated[str, BeforeValidator(_version)] = ""
    problem_statement: str = ""
    patch: str | None = None
    """The instance's own fix (SWE-bench's gold ``patch``), never shown to a model: where
    it is given, each grade also runs every FAIL_TO_PASS test on inputs moved by a
    draw, expecting what this fix answers there (`sandman.eval.variants`)."""

    @model_validator(mode="before")
    @classmethod
    def _from_swebench(cls, data: Any) -> Any:
        """Fill what a SWE-bench row leaves out from its ``repo`` and ``version``."""
        if not isinstance(data, dict):
            return data
        repo, version = data.get("repo"), data.get("version")
        wanted = [k for k in ("image", "test_cmd", "log_parser") if data.get(k) is None]
        if not wanted or not isinstance(repo, str) or not repo:
            return data
        spec = swebench.spec_for(repo, str(version))
        if spec is None:
            if "test_cmd" in wanted or "image" in wanted:
                known = "" if repo in swebench.SPECS else "; the repository is not in SWE-bench's"
                raise ValueError(
                    f"{repo} at version {version!r} has no SWE-bench spec{known}: "
                    f"give {', '.join(wanted)} explicitly"
                )
            return data
        filled = dict(data)
        filled.setdefault("repo_path", swebench.REPO_PATH)
        if filled.get("image") is None and isinstance(filled.get("instance_id"), str):
            filled["image"] = swebench.image_name(filled["instance_id"])
        if filled.get("test_cmd") is None:
            filled["test_cmd"] = spec.test_cmd
            filled.setdefault("pre_test", spec.pre_test)
        if filled.get("log_parser") is None:
            filled["log_parser"] = swebench.PARSER_BY_REPO[repo]
        if filled.get("test_directives") is None and isinstance(filled.get("test_patch"), str):
            filled["test_directives"] = swebench.test_directives(repo, filled["test_patch"])
        return filled

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


def _parquet_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The rows of a parquet file (the Hugging Face dataset's format), through pyarrow."""
    try:
        parquet = importlib.import_module("pyarrow.parquet")
    except ImportError as exc:
        raise errors.ConfigError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert the "
            "dataset to JSONL first"
        ) from exc
    try:
        rows: list[dict[str, Any]] = parquet.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow's errors share no base class worth naming
        raise errors.ConfigError(f"{path}: not a readable parquet file: {exc}") from exc
    return [(f"{path}: row {n}", row) for n, row in enumerate(rows, start=1)]


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, object) for each record of a JSON list, a JSONL or a parquet file."""
    if path.suffix == ".parquet":
        return _parquet_records(path)
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
