"""How the SWE-bench harness runs and reads each repository's tests, as data.

SWE-bench dataset rows name only ``repo`` and ``version``; the official
harness (the ``swebench`` package, 4.x: ``harness/constants/python.py`` and
``harness/test_spec/python.py``; 5.x ships the same as per-row fields) derives
the rest. This module holds that table, written down here so that grading
never imports ``swebench``:

- the test command per repository and version (`SPECS`), the commands its
  eval script runs before it (conda activation, locale exports, reinstalling
  the package) and the log parser per repository (`PARSER_BY_REPO`);
- the test directives appended to the command (`test_directives`: the files
  the test patch touches, minus data files; Django's become dotted module
  names under ``tests/``);
- the prebuilt image's name (`image_name`) and the repository path
  (``/testbed``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ENV_NAME",
    "IMAGE_NAMESPACE",
    "PARSER_BY_REPO",
    "REPO_PATH",
    "SPECS",
    "Spec",
    "image_name",
    "spec_for",
    "test_directives",
]

REPO_PATH = "/testbed"
ENV_NAME = "testbed"
IMAGE_NAMESPACE = "swebench"
"""Where SWE-bench publishes its per-instance images (Docker Hub)."""

_ACTIVATE = (". /opt/miniconda3/bin/activate", f"conda activate {ENV_NAME}")

_PYTEST = "pytest -rA"
_ASTROPY_OLD = "pytest -rA -vv -o console_output_style=classic --tb=no"
_DJANGO = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
_DJANGO_1_9 = "./tests/runtests.py --verbosity 2"
_SEABORN = "pytest --no-header -rA"
_SPHINX = "tox --current-env -epy39 -v --"
_SYMPY = "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose"

_DJANGO_LOCALE_OLD = (
    "export LANG=en_US.UTF-8", "export LC_ALL=en_US.UTF-8", "export PYTHONIOENCODING=utf8",
    "export LANGUAGE=en_US:en",
)  # fmt: skip
_DJANGO_LOCALE_3 = (
    "sed -i '/en_US.UTF-8/s/^# //g' /etc/locale.gen && locale-gen", "export LANG=en_US.UTF-8",
    "export LANGUAGE=en_US:en", "export LC_ALL=en_US.UTF-8",
)  # fmt: skip
_PIP_E = "python -m pip install -e ."


@dataclass(frozen=True)
class Spec:
    """How one repository at one version is tested."""

    test_cmd: str
    install: str
    """Run before the tests, as SWE-bench's eval script does (the patch may touch built code)."""
    eval_commands: tuple[str, ...] = ()
    """Environment set-up the eval script runs first (locale exports)."""

    @property
    def pre_test(self) -> list[str]:
        """Every command the eval script runs before the test command, in order."""
        return [*_ACTIVATE, *self.eval_commands, self.install]


def _versions(spec: Spec, *versions: str) -> dict[str, Spec]:
    return dict.fromkeys(versions, spec)


SPECS: dict[str, dict[str, Spec]] = {
    "astropy/astropy": {
        **_versions(Spec(_PYTEST, "python -m pip install -e .[test] --verbose"),
                    "3.0", "3.1", "3.2", "4.1", "4.2", "4.3", "5.0", "5.1", "5.2", "v5.3"),
        **_versions(Spec(_ASTROPY_OLD, "python -m pip install -e .[test] --verbose"),
                    "0.1", "0.2", "0.3", "0.4", "1.1", "1.2", "1.3"),
    },
    "django/django": {
        **_versions(Spec(_DJANGO, "python setup.py install", _DJANGO_LOCALE_OLD),
                    "1.7", "1.8", "1.10", "1.11", "2.0", "2.1", "2.2"),
        "1.9": Spec(_DJANGO_1_9, "python setup.py install", _DJANGO_LOCALE_OLD),
        **_versions(Spec(_DJANGO, "python setup.py install"), "1.4", "1.5", "1.6"),
        **_versions(Spec(_DJANGO, _PIP_E, _DJANGO_LOCALE_3), "3.0", "3.1", "3.2"),
        **_versions(Spec(_DJANGO, _PIP_E), "4.0", "4.1", "4.2", "5.0", "5.1", "5.2"),
    },
    "matplotlib/matplotlib": {
        **_versions(Spec(_PYTEST, _PIP_E),
                    "3.0", "3.1", "3.2", "3.3", "3.4", "3.5", "3.6", "3.7"),
        **_versions(Spec(_PYTEST, 'python -m pip install --no-build-isolation -e ".[dev]"'),
                    "3.8", "3.9"),
        **_versions(Spec(_PYTEST, "python setup.py build; python setup.py install"),
                    "1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "2.0", "2.1", "2.2"),
    },
    "marshmallow-code/marshmallow": _versions(
        Spec(_PYTEST, "python -m pip install -e '.[dev]'"),
        "2.18", "2.19", "2.20", "3.0", "3.1", "3.2", "3.4", "3.8", "3.9", "3.10", "3.11", "3.12",
        "3.13", "3.15", "3.16", "3.19",
    ),
    "mwaskom/seaborn": {
        "0.11": Spec(_SEABORN, _PIP_E),
        **_versions(Spec(_SEABORN, "python -m pip install -e .[dev]"), "0.12", "0.13", "0.14"),
    },
    "pallets/flask": _versions(Spec(_PYTEST, _PIP_E), "2.0", "2.1", "2.2", "2.3", "3.0", "3.1"),
    "psf/requests": _versions(
        Spec(_PYTEST, "python -m pip install ."),
        "0.7", "0.8", "0.9", "0.11", "0.13", "0.14", "1.1", "1.2", "2.0", "2.2", "2.3", "2.4",
        "2.5", "2.7", "2.8", "2.9", "2.10", "2.11", "2.12", "2.17", "2.18", "2.19", "2.22", "2.25",
        "2.26", "2.27", "2.31", "3.0",
    ),
    "pvlib/pvlib-python": _versions(
        Spec(_PYTEST, "python -m pip install -e .[all]"),
        "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9",
    ),
    "pydata/xarray": _versions(
        Spec(_PYTEST, _PIP_E),
        "0.12", "0.18", "0.19", "0.20", "2022.03", "2022.06", "2022.09", "2023.07", "2024.05",
    ),
    "pydicom/pydicom": _versions(
        Spec(_PYTEST, _PIP_E),
        "1.0", "1.1", "1.2", "1.3", "1.4", "2.0", "2.1", "2.2", "2.3", "2.4", "3.0",
    ),
    "pylint-dev/astroid": _versions(
        Spec(_PYTEST, _PIP_E),
        "2.5", "2.6", "2.7", "2.8", "2.9", "2.10", "2.12", "2.13", "2.14", "2.15", "2.16", "3.0",
    ),
    "pylint-dev/pylint": _versions(
        Spec(_PYTEST, _PIP_E),
        "2.8", "2.9", "2.10", "2.11", "2.13", "2.14", "2.15", "2.16", "2.17", "3.0", "3.1", "3.2",
        "3.3", "4.0",
    ),
    "pytest-dev/pytest": _versions(
        Spec(_PYTEST, _PIP_E),
        "4.4", "4.5", "4.6", "5.0", "5.1", "5.2", "5.3", "5.4", "6.0", "6.2", "6.3", "7.0", "7.1",
        "7.2", "7.4", "8.0", "8.1", "8.2", "8.3", "8.4",
    ),
    "pyvista/pyvista": _versions(
        Spec(_PYTEST, _PIP_E), *(f"0.{minor}" for minor in range(20, 44))
    ),
    "scikit-learn/scikit-learn": _versions(
        Spec(_PYTEST, "python -m pip install -v --no-use-pep517 --no-build-isolation -e ."),
        "0.20", "0.21", "0.22", "1.3", "1.4", "1.5", "1.6",
    ),
    "sphinx-doc/sphinx": _versions(
        Spec(_SPHINX, "python -m pip install -e .[test]"),
        "1.5", "1.6", "1.7", "1.8", "2.0", "2.1", "2.2", "2.3", "2.4", "3.0", "3.1", "3.2", "3.3",
        "3.4", "3.5", "4.0", "4.1", "4.2", "4.3", "4.4", "4.5", "5.0", "5.1", "5.2", "5.3", "6.0",
        "6.2", "7.0", "7.1", "7.2", "7.3", "7.4", "8.0", "8.1",
    ),
    "sqlfluff/sqlfluff": _versions(
        Spec(_PYTEST, _PIP_E),
        "0.4", "0.5", "0.6", "0.8", "0.9", "0.10", "0.11", "0.12", "0.13", "1.0", "1.1", "1.2",
        "1.3", "1.4", "2.0", "2.1", "2.2",
    ),
    "sympy/sympy": _versions(
        Spec(_SYMPY, _PIP_E),
        "0.7", "1.0", "1.1", "1.2", "1.4", "1.5", "1.6", "1.7", "1.8", "1.9", "1.10", "1.11",
        "1.12", "1.13", "1.14",
    ),
}  # fmt: skip
"""repo -> version -> `Spec`, as in ``swebench`` 4.1's ``MAP_REPO_VERSION_TO_SPECS_PY``."""

PARSER_BY_REPO: dict[str, str] = {
    "astropy/astropy": "pytest_v2",
    "django/django": "django",
    "marshmallow-code/marshmallow": "pytest",
    "matplotlib/matplotlib": "matplotlib",
    "mwaskom/seaborn": "seaborn",
    "pallets/flask": "pytest",
    "psf/requests": "pytest_options",
    "pvlib/pvlib-python": "pytest",
    "pydata/xarray": "pytest",
    "pydicom/pydicom": "pytest_options",
    "pylint-dev/astroid": "pytest",
    "pylint-dev/pylint": "pytest_options",
    "pytest-dev/pytest": "pytest",
    "pyvista/pyvista": "pytest",
    "scikit-learn/scikit-learn": "pytest_v2",
    "sphinx-doc/sphinx": "pytest_v2",
    "sqlfluff/sqlfluff": "pytest",
    "sympy/sympy": "sympy",
}
"""The log parser (one of ours, `LogParser`) per repository: ``MAP_REPO_TO_PARSER_PY``."""

# NON_TEST_EXTS: "csv" has no dot there, so "foo_csv" counts as data too.
_NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml",
                  ".yaml", ".toml")  # fmt: skip
_DIFF_TARGET = re.compile(r"diff --git a/.* b/(.*)")


def spec_for(repo: str, version: str) -> Spec | None:
    """The spec of ``repo`` at ``version``; None if SWE-bench does not know them."""
    return SPECS.get(repo, {}).get(version)


def test_directives(repo: str, test_patch: str) -> list[str]:
    """What SWE-bench appends to the test command: the test patch's target files, data left out.

    Django's runner takes modules: ``tests/queries/test_q.py`` becomes ``queries.test_q``.
    """
    found = [d for d in _DIFF_TARGET.findall(test_patch) if not d.endswith(_NON_TEST_EXTS)]
    if repo == "django/django":
        found = [d.removesuffix(".py").removeprefix("tests/").replace("/", ".") for d in found]
    return found


def image_name(instance_id: str, namespace: str = IMAGE_NAMESPACE, arch: str = "x86_64") -> str:
    """The prebuilt instance image: ``swebench/sweb.eval.x86_64.django_1776_django-11099:latest``.

    Docker Hub allows no ``__`` in a name, so SWE-bench writes ``_1776_``; all lower case.
    """
    return f"{namespace}/sweb.eval.{arch}.{instance_id}:latest".replace("__", "_1776_").lower()
