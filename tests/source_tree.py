"""Which tpcomm the tests and the interpreters they start import.

A checkout's tests import this checkout's python/ (conftest.py puts it first
on sys.path; subprocess_env() puts it first on the PYTHONPATH of a child).
With TPCOMM_TEST_INSTALLED=1 they test the tpcomm installed in this Python (a
wheel, .ci/test_wheel.sh): the checkout's python/ is on neither path, so a
test that passes proves what the installed package does, not what a build
left in the tree does.

This is a helper module, not a test module (pytest puts tests/ on sys.path).
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_DIR = os.path.join(ROOT, "python")


def testing_installed(environ=os.environ):
    return environ.get("TPCOMM_TEST_INSTALLED") == "1"


def _in_tree(entry):
    path = os.path.realpath(entry or os.curdir)
    tree = os.path.realpath(PYTHON_DIR)
    return path == tree or path.startswith(tree + os.sep)


def python_path(environ=os.environ):
    """The PYTHONPATH of a child: python/ first, or, testing the installed
    package, the caller's PYTHONPATH without any entry inside python/."""
    entries = [e for e in environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    if testing_installed(environ):
        return os.pathsep.join(e for e in entries if not _in_tree(e))
    return os.pathsep.join([PYTHON_DIR] + [e for e in entries if not _in_tree(e)])


def subprocess_env(environ=os.environ, **extra):
    """os.environ for a child interpreter that imports the tpcomm under test,
    with `extra` variables set."""
    env = dict(environ, **extra)
    path = python_path(environ)
    if path:
        env["PYTHONPATH"] = path
    else:
        env.pop("PYTHONPATH", None)
    return env


def git_status():
    """`git status --porcelain` of the checkout (None outside a git checkout):
    a test that runs an example compares it before and after, so an example
    that writes into the tree fails it."""
    import subprocess

    if not os.path.exists(os.path.join(ROOT, ".git")):
        return None
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def tpcomm_leftovers(tmpdir):
    """What tpcomm's code left in `tmpdir` (the TMPDIR a child ran with)."""
    return sorted(n for n in os.listdir(tmpdir) if n.startswith("tpcomm"))
