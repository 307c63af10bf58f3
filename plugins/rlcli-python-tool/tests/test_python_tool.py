"""The python tool: it runs code, and hostile snippets are contained and reported."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import os
import time

import pytest

from rlcli_python_tool import Limits, PythonTool, PythonToolConfig, format_result, namespaces_available, run_python

FAST = Limits(cpu_s=2, wall_s=5.0, memory_mb=256, file_mb=4, open_files=32)


def run(code: str, limits: Limits = FAST, **kw):
    return asyncio.run(run_python(code, limits, **kw))


# ------------------------------------------------------------------------------ behaviour
def test_prints_and_imports_the_standard_library():
    r = run("import math, json, collections, dataclasses, fractions, re\n"
            "P = collections.namedtuple('P', 'x y')\n"
            "@dataclasses.dataclass\nclass A:\n    x: int = 2\n"
            "print(math.factorial(10), json.dumps([1]), P(1, 2), A(), fractions.Fraction(1, 3) * 3)")
    assert r.status == "ok" and r.exit_code == 0, r.stderr
    assert r.stdout == "3628800 [1] P(x=1, y=2) A(x=2) 1\n"
    assert r.denied == []


def test_an_exception_is_reported_with_its_traceback():
    r = run("def f():\n    return 1 / 0\nf()")
    assert r.status == "error" and r.exit_code == 1
    assert "ZeroDivisionError: division by zero" in r.stderr and 'File "main.py", line 2' in r.stderr


def test_the_working_directory_is_a_fresh_private_dir_that_is_removed():
    r = run("import os\nopen('note.txt', 'w').write('hi')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\n"
            "print(open('note.txt').read())")
    assert r.status == "ok", r.stderr
    cwd, listing, content = r.stdout.splitlines()
    assert listing == "['main.py', 'note.txt']" and content == "hi"
    assert os.path.basename(cwd).startswith("rlcli-py-") and not os.path.exists(cwd)


def test_the_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "abc")
    r = run("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated, sys.flags.no_site)")
    names, flags = r.stdout.splitlines()
    assert "SECRET_TOKEN" not in names and eval(names) == ["HOME", "LANG", "PATH", "PYTHONIOENCODING", "TMPDIR"]
    assert flags == "1 1"


# ------------------------------------------------------------------------------ hostile code
def test_infinite_loop_is_stopped_by_the_cpu_limit():
    t0 = time.perf_counter()
    r = run("while True:\n    pass", Limits(cpu_s=1, wall_s=10.0))
    assert r.status == "cpu_limit" and r.exit_code < 0
    assert time.perf_counter() - t0 < 8


def test_ignoring_sigxcpu_does_not_help():
    r = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
            Limits(cpu_s=1, wall_s=10.0))
    assert r.status == "killed" and r.exit_code == -9  # the hard limit, one second later


def test_sleeping_forever_is_stopped_by_the_wall_clock_and_its_group_killed():
    t0 = time.perf_counter()
    r = run("import time\nprint('started', flush=True)\ntime.sleep(100)", Limits(cpu_s=5, wall_s=1.5))
    assert r.status == "timeout" and r.stdout == "started\n"  # what it printed before is kept
    assert time.perf_counter() - t0 < 5


def test_fork_bomb_is_denied():
    r = run("import os\nwhile True:\n    os.fork()")
    assert r.status == "denied" and r.denied == ["os.fork"]
    assert "PermissionError: sandbox: os.fork is not allowed" in r.stderr


@pytest.mark.parametrize("code, denied", [
    ("import os\nos.system('echo hi')", "os.system"),
    ("import subprocess\nsubprocess.run(['echo', 'hi'])", "importing subprocess"),
    ("import os\nos.execv('/bin/echo', ['echo', 'hi'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/echo', ['echo'], {})", "os.posix_spawn"),
    ("import multiprocessing", "importing multiprocessing"),
    ("import os, signal\nos.kill(1, signal.SIGTERM)", "os.kill"),
])
def test_starting_processes_or_signalling_others_is_denied(code, denied):
    r = run(code)
    assert r.status == "denied" and r.denied == [denied]
    assert "hi" not in r.stdout


def test_huge_allocation_is_a_memory_error():
    r = run("x = bytearray(8 * 1024 ** 3)\nprint('allocated')", Limits(memory_mb=256))
    assert r.status == "memory_limit" and "allocated" not in r.stdout
    assert r.stderr.strip().splitlines()[-1] == "MemoryError"


def test_huge_file_is_cut_by_the_file_size_limit():
    r = run("with open('big.bin', 'wb') as f:\n    for _ in range(64):\n        f.write(b'x' * (1 << 20))",
            Limits(file_mb=2))
    assert r.status == "error" and "File too large" in r.stderr


def test_huge_output_is_truncated_not_buffered():
    r = run("import sys\nfor _ in range(200):\n    sys.stdout.write('x' * 100000)\nprint('end')",
            Limits(output_bytes=1000))
    assert r.status == "ok" and r.stdout_truncated and len(r.stdout) == 1000


@pytest.fixture
def outside_file(tmp_path):
    p = tmp_path / "outside.txt"
    p.write_text("the sandbox must not read this")
    return p


def test_reading_a_file_outside_the_sandbox_is_denied(outside_file):
    for code in (f"print(open({str(outside_file)!r}).read())",
                 f"import os\nprint(os.open({str(outside_file)!r}, os.O_RDONLY))",
                 "print(open('/etc/passwd').read())",
                 # the same file through a relative path, climbing out of the sandbox directory
                 "import os\nprint(open('../' * 30 + " + repr(str(outside_file).lstrip('/')) + ").read())"):
        r = run(code)
        assert r.status == "denied", (code, r.stderr)
        assert "the sandbox must not read this" not in r.stdout and "root:" not in r.stdout


def test_listing_or_writing_outside_the_sandbox_is_denied(tmp_path):
    target = tmp_path / "planted.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nprint(os.listdir({str(tmp_path)!r}))",
                 "import os\nos.chdir('/')", "import os\nos.symlink('/etc/passwd', 'link')",
                 f"import shutil\nshutil.copyfile('main.py', {str(target)!r})"):
        r = run(code)
        assert r.status == "denied", (code, r.stderr)
    assert not target.exists()


def test_tampering_with_python_does_not_fool_the_policy(outside_file):
    path = str(outside_file)
    code = f"""
import builtins, os, os.path, posixpath
os.path.abspath = posixpath.abspath = posixpath.normpath = lambda p: os.getcwd() + '/ok'
builtins.isinstance = lambda *a: False
builtins.len = lambda *a: 0
class Sneaky(str):
    def startswith(self, *a):
        return True
    def split(self, *a):
        return ['ok']
print(open(Sneaky({path!r})).read())
"""
    r = run(code)
    assert r.status == "denied" and "the sandbox must not read this" not in r.stdout


def test_reaching_the_hook_through_the_interpreter_is_denied():
    for code, denied in (("import gc\ngc.get_objects()", "gc.get_objects"),
                         ("import gc\ngc.get_referrers(open)", "gc.get_referrers"),
                         ("import sys\nsys.settrace(lambda *a: None)", "sys.settrace"),
                         ("import ctypes", "importing ctypes"),
                         ("c = (lambda: 1).__code__\nc.replace(co_consts=(None, 2))", "code.__new__"),
                         ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource.setrlimit")):
        r = run(code)
        assert r.status == "denied" and r.denied == [denied], (code, r.stderr)


def test_network_is_unavailable():
    for code in ("import socket", "import urllib.request\nurllib.request.urlopen('http://example.com')",
                 "import http.client\nhttp.client.HTTPConnection('example.com').request('GET', '/')"):
        r = run(code)
        assert r.status == "denied" and "importing socket" in r.denied, (code, r.stderr)


@pytest.mark.skipif(not namespaces_available(), reason="unshare cannot create user+network namespaces here")
def test_network_namespace_is_used_where_available():
    assert run("print(1)", network="namespace").namespaces is True
    r = run("print(open('/proc/net/dev').read())", network="namespace")  # outside the sandbox: denied anyway
    assert r.status == "denied"
    assert run("print(1)", network="audit").namespaces is False


# ------------------------------------------------------------------------------ the tool
def test_tool_output_and_status():
    tool = PythonTool(PythonToolConfig(timeout_s=5, cpu_time_s=2, memory_mb=256, max_output_chars=400))
    ok = asyncio.run(tool.run({"code": "print(6 * 7)"}))
    assert ok.status == "ok" and ok.output == "42\n"
    bad = asyncio.run(tool.run({"code": "import os\nos.system('true')"}))
    assert bad.status == "error" and bad.output.startswith("[status: denied, exit code 1]")
    assert "PermissionError: sandbox: os.system is not allowed" in bad.output
    missing = asyncio.run(tool.run({"source": "print(1)"}))
    assert missing.status == "error" and "'code'" in missing.output
    flood = asyncio.run(tool.run({"code": "print('y' * 100000)"}))
    assert len(flood.output) <= 400 and flood.output.startswith("yyy")


def test_format_result_keeps_the_end_of_a_long_traceback():
    r = run("def f(n):\n    return f(n + 1)\nf(0)")
    out = format_result(r, 300)
    assert not out.ok and out.text.startswith("[status: error, exit code 1]")
    assert out.text.rstrip().endswith("RecursionError: maximum recursion depth exceeded")


def test_concurrent_calls_are_isolated():
    tool = PythonTool(PythonToolConfig(max_concurrency=2))

    async def main():
        codes = [f"open('f.txt', 'w').write('{i}')\nimport os\nprint(open('f.txt').read(), os.listdir('.'))"
                 for i in range(4)]
        return await asyncio.gather(*(tool.run({"code": c}) for c in codes))

    for i, r in enumerate(asyncio.run(main())):
        assert r.output == f"{i} ['main.py', 'f.txt']\n"


def test_registered_through_the_entry_point():
    from pydantic import ValidationError

    from rlcli.plugins import get_registry

    eps = [ep for ep in md.entry_points(group="rlcli") if ep.value == "rlcli_python_tool"]
    assert eps and eps[0].dist.metadata["name"] == "rlcli-python-tool"
    entry = get_registry(refresh=True).entry("tool", "python")
    assert entry.cls is PythonTool and (entry.dist, entry.version) == ("rlcli-python-tool", "0.1.0")
    with pytest.raises(ValidationError):
        PythonToolConfig(memory_mb=0)
