"""The tests import the tpcomm under test, and so do the interpreters they
start: this checkout's python/, or, with TPCOMM_TEST_INSTALLED=1, the
installed package with python/ on no path (tests/source_tree.py)."""
import os
import subprocess
import sys

import tpcomm

import source_tree

TREE = os.path.realpath(source_tree.PYTHON_DIR)


def _in_tree(path):
    return os.path.realpath(path).startswith(TREE + os.sep)


def test_installed_mode_keeps_the_tree_off_a_childs_path():
    env = {"TPCOMM_TEST_INSTALLED": "1",
           "PYTHONPATH": os.pathsep.join([source_tree.PYTHON_DIR, "/opt/other", source_tree.PYTHON_DIR + "/tpcomm"])}
    assert source_tree.python_path(env) == "/opt/other"
    assert "PYTHONPATH" not in source_tree.subprocess_env({"TPCOMM_TEST_INSTALLED": "1",
                                                          "PYTHONPATH": source_tree.PYTHON_DIR})
    assert source_tree.subprocess_env(env, CUDA_VISIBLE_DEVICES="")["CUDA_VISIBLE_DEVICES"] == ""


def test_checkout_mode_puts_the_tree_first_once():
    env = {"PYTHONPATH": os.pathsep.join(["/opt/other", source_tree.PYTHON_DIR])}
    assert source_tree.python_path(env) == os.pathsep.join([source_tree.PYTHON_DIR, "/opt/other"])
    assert source_tree.python_path({}) == source_tree.PYTHON_DIR


def test_this_session_and_its_children_import_the_tpcomm_under_test(tmp_path):
    here = os.path.realpath(tpcomm.__file__)
    assert _in_tree(here) != source_tree.testing_installed(), here
    child = subprocess.run([sys.executable, "-c", "import tpcomm; print(tpcomm.__file__)"], cwd=tmp_path,
                           env=source_tree.subprocess_env(), capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert os.path.realpath(child.stdout.strip()) == here
    if source_tree.testing_installed():
        assert not any(_in_tree(p) for p in sys.path if p), sys.path
