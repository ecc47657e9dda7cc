"""Run the test apps under tests/ with Django's runner, as Django's own tests/runtests.py does.

Labels are test modules relative to this directory (``shop_tests.tests``);
``--settings`` names a settings module here (``test_sqlite``).
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("labels", nargs="*", default=["shop_tests"])
    parser.add_argument("-v", "--verbosity", type=int, default=1)
    parser.add_argument("--settings", default="test_sqlite")
    parser.add_argument("--parallel", type=int, default=1)
    args = parser.parse_args()
    # The test apps import from here, the code under test from the repository's root.
    sys.path[:0] = [HERE, os.path.dirname(HERE)]
    os.environ["DJANGO_SETTINGS_MODULE"] = args.settings

    import django
    from django.conf import settings
    from django.test.utils import get_runner

    django.setup()
    runner = get_runner(settings)(
        verbosity=args.verbosity, parallel=args.parallel, interactive=False
    )
    return 1 if runner.run_tests(args.labels) else 0


if __name__ == "__main__":
    sys.exit(main())
