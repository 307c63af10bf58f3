"""The python tool: it runs code, and hostile snippets are contained and reported."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlcli_python_tool
from rlcli_python_tool import (Limits, PythonTool, PythonToolConfig, SandboxResult, format_result, kernel_layers,
                               namespaces_available, run_python, sandbox)
from rlcli_python_tool._kernel import _SC_DENY, _SC_METADATA, _SC_SELF, _boundary_missing, _sc_program

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
            Limits(cpu_s=1, wall_s=60.0))  # 2 s of CPU time can take 10+ s of wall time on busy cores
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


def test_a_path_of_a_str_or_bytes_subclass_is_read_for_what_it_holds():
    code = ("class B(bytes):\n    def __bytes__(self):\n        return b'main.py'\n"
            "    def decode(self, *a):\n        return 'main.py'\n"
            "print(open(B(b'/etc/passwd')).read())\n")
    r = run(code)
    assert r.status == "denied" and r.denied == ["opening '/etc/passwd'"] and "root:" not in r.stdout


def _other_pythons() -> list[str]:
    """The CPython 3.10+ interpreters on PATH (each once, shims resolved), other than this one."""
    found = set()
    for m in range(10, 15):
        path = shutil.which(f"python3.{m}")
        if path:
            r = subprocess.run([path, "-I", "-S", "-c", "import sys; print(sys.executable)"], capture_output=True,
                               text=True, timeout=30)
            if r.returncode == 0 and r.stdout.strip():
                found.add(os.path.realpath(r.stdout.strip()))
    return sorted(found - {os.path.realpath(sys.executable)})


def test_the_sandbox_runs_under_other_interpreters():
    """The ``python`` option: the bootstrap, the kernel layers and the hook on each CPython 3.10+ found."""
    pythons = _other_pythons()
    if not pythons:
        pytest.skip("no other python3.10 ... python3.14 on PATH")
    for python in pythons:
        r = run("import sys, sqlite3\nprint(sys.version_info >= (3, 10))\nopen('/etc/passwd')", python=python)
        assert r.status == "denied" and r.stdout == "True\n" and r.denied == ["opening '/etc/passwd'"], (python, r.stderr)
        assert r.layers["capabilities"] is True


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
def tool_strict() -> str:
    """The tool's default (``boundary``) where Landlock and seccomp hold here, else ``off``: these tests
    are about the tool's output; which layers it demands is tested above."""
    return "off" if _boundary_missing(kernel_layers().layers) else "boundary"


def test_tool_output_and_status():
    tool = PythonTool(PythonToolConfig(timeout_s=5, cpu_time_s=2, memory_mb=256, max_output_chars=400,
                                       strict=tool_strict()))
    ok = asyncio.run(tool.run({"code": "print(6 * 7)"}))
    assert ok.status == "ok" and ok.output == "42\n"
    bad = asyncio.run(tool.run({"code": "import os\nos.system('true')"}))
    assert bad.status == "error" and bad.output.startswith("[status: denied, exit code 77]")
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
    tool = PythonTool(PythonToolConfig(max_concurrency=2, strict=tool_strict()))

    async def main():
        codes = [f"open('f.txt', 'w').write('{i}')\nimport os\nprint(open('f.txt').read(), sorted(os.listdir('.')))"
                 for i in range(4)]
        return await asyncio.gather(*(tool.run({"code": c}) for c in codes))

    for i, r in enumerate(asyncio.run(main())):
        assert r.output == f"{i} ['f.txt', 'main.py']\n"


def test_registered_through_the_entry_point():
    from pydantic import ValidationError

    from rlcli.plugins import get_registry

    eps = [ep for ep in md.entry_points(group="rlcli") if ep.value == "rlcli_python_tool"]
    assert eps and eps[0].dist.metadata["name"] == "rlcli-python-tool"
    entry = get_registry(refresh=True).entry("tool", "python")
    assert entry.cls is PythonTool and (entry.dist, entry.version) == ("rlcli-python-tool", "0.1.0")
    with pytest.raises(ValidationError):
        PythonToolConfig(memory_mb=0)


# ------------------------------------------------------------------------------ kernel layers
def test_the_kernel_layers_are_reported_and_their_line_removed_from_stderr():
    r = run("import sys\nprint('err', file=sys.stderr)")
    assert r.status == "ok" and r.stderr == "err\n"
    assert set(r.layers) == {"mounts", "capabilities", "landlock", "seccomp", "problems"}
    assert r.layers["capabilities"] is True and r.namespaces == r.layers["mounts"]
    # code that fakes the bootstrap's own refusal is not taken for a sandbox error: the layers line came first
    forged = run("import os\nos.write(2, b'[sandbox] cannot set RLIMIT_CPU: no\\n')\nos._exit(70)")
    assert forged.status == "error" and forged.exit_code == 70


def test_every_kernel_layer_holds_on_this_machine_or_the_test_names_the_missing_one():
    probe = kernel_layers()
    if probe.missing:
        pytest.skip("; ".join(probe.missing))
    assert probe.layers["landlock"] >= 6 and probe.layers["seccomp"] and probe.layers["mounts"]
    r = run("print(1)", strict=True)
    assert r.status == "ok" and r.stdout == "1\n" and r.missing == []


def test_strict_refuses_without_a_layer_and_the_default_warns_once():
    r = run("print('ran')", network="audit", strict=True)  # no namespaces: the read-only mounts are missing
    assert r.status == "sandbox_error" and r.stdout == ""
    assert "cannot run with strict: all" in r.stderr and "no user and mount namespaces" in r.stderr
    sandbox._WARNED.clear()
    warnings, grab = [], logging.Handler(logging.WARNING)
    grab.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("rlcli.python_tool")
    logger.addHandler(grab)
    try:
        first, second = run("print(1)", network="audit"), run("print(2)", network="audit")
    finally:
        logger.removeHandler(grab)
    assert first.ok and second.ok and first.layers["mounts"] is False
    assert len(warnings) == 1 and "strict: all" in warnings[0] and "no user and mount namespaces" in warnings[0]


@pytest.mark.parametrize("layer, words", [("landlock", "no Landlock"), ("seccomp", "no seccomp filter")])
def test_the_default_strict_boundary_refuses_without_landlock_or_seccomp(layer, words):
    """The tool's default: the layers that hold against hostile code must be there; the others
    (namespaces, Landlock ABI 6) may be missing, with a warning."""
    r = run("print('ran')", without=(layer,), strict="boundary")
    assert r.status == "sandbox_error" and r.stdout == "" and "cannot run with strict: boundary" in r.stderr
    assert words in r.stderr and "ran" not in r.stderr
    if kernel_layers().layers.get("landlock", 0) >= 1 and kernel_layers().layers.get("seccomp"):
        ok = run("print('ran')", network="audit", strict="boundary")  # no namespaces: allowed
        assert ok.status == "ok" and ok.stdout == "ran\n", ok.stderr
    assert PythonToolConfig().strict == "boundary"
    assert [PythonToolConfig(strict=v).strict for v in (True, False, "all", "off")] == ["all", "off", "all", "off"]


CHMOD_INSIDE = "import os, shutil\nopen('a', 'w').close()\nos.chmod('a', 0o600)\nshutil.copy2('a', 'b')\nprint('ok')"


@pytest.mark.skipif(not namespaces_available(), reason="unshare cannot create the namespaces here")
def test_with_read_only_mounts_metadata_calls_work_in_the_folder():
    r = run(CHMOD_INSIDE)
    assert r.layers["mounts"] and r.status == "ok" and r.stdout == "ok\n", r.stderr


def test_without_namespaces_metadata_calls_are_refused_even_in_the_folder():
    r = run(CHMOD_INSIDE, network="audit", audit_hook=False)
    if not r.layers.get("seccomp"):
        pytest.skip("no seccomp filter here: " + "; ".join(r.layers.get("problems", [])))
    assert r.status == "error" and "PermissionError: [Errno 1] Operation not permitted: 'a'" in r.stderr


def test_sqlite_files_outside_are_refused_by_the_hook_and_in_memory_ones_work(tmp_path):
    if not kernel_layers().layers.get("landlock"):
        pytest.skip("no Landlock here: sqlite3 is refused altogether (see the test after this one)")
    for db in (str(tmp_path / "x.db"), f"file:{tmp_path}/x.db?mode=rwc"):
        r = run(f"import sqlite3\nsqlite3.connect({db!r}, uri=True).execute('create table t(x)')")
        assert r.status == "denied" and r.denied[0].startswith("sqlite3.connect"), r.stderr
    assert not list(tmp_path.iterdir())
    r = run("import sqlite3\nc = sqlite3.connect(':memory:')\nprint(c.execute('select 6 * 7').fetchone()[0])\n"
            "sqlite3.connect('in.db').execute('create table t(x)')")
    assert r.status == "ok" and r.stdout == "42\n", r.stderr


def test_without_landlock_the_hook_refuses_libraries_that_open_files_in_c():
    r = run("import sqlite3", without=("landlock",))
    assert r.layers["landlock"] == 0 and r.status == "denied" and r.denied == ["importing _sqlite3"]


def test_without_seccomp_the_calls_that_raise_no_audit_event_are_taken_away():
    r = run("import os, signal\nprint([hasattr(m, f) for m, f in ((os, 'setpriority'), (os, 'sched_setaffinity'), "
            "(os, 'pidfd_open'), (signal, 'pidfd_send_signal'))])", without=("seccomp",))
    assert r.layers["seccomp"] is False and r.stdout == "[False, False, False, False]\n", r.stderr


def test_strict_is_checked_when_the_recipe_is_loaded(monkeypatch):
    assert PythonTool.check_config(PythonToolConfig(strict="off")) == []
    [(path, msg)] = PythonTool.check_config(PythonToolConfig(strict=True, network="audit"))
    assert path == "network" and "network: auto" in msg

    def kernel(landlock, seccomp=True):
        layers = {"mounts": True, "capabilities": True, "landlock": landlock, "seccomp": seccomp}
        monkeypatch.setattr(rlcli_python_tool, "kernel_layers", lambda *a: SandboxResult("ok", 0, "", "", 0.0,
                                                                                          layers=layers))

    kernel(landlock=3)  # Linux 6.8: the boundary holds, not every layer
    [(path, msg)] = PythonTool.check_config(PythonToolConfig(strict=True))
    assert path == "strict" and "Landlock ABI 3 < 6" in msg and "strict: boundary" in msg
    assert PythonTool.check_config(PythonToolConfig()) == []  # the default: strict: boundary
    kernel(landlock=0)
    [(path, msg)] = PythonTool.check_config(PythonToolConfig())
    assert path == "strict" and "no Landlock" in msg and "strict: off" in msg
    kernel(landlock=6, seccomp=False)
    [(path, msg)] = PythonTool.check_config(PythonToolConfig())
    assert path == "strict" and "no seccomp filter" in msg


def test_validate_names_the_tool_option_that_cannot_hold():
    from click.testing import CliRunner

    from rlcli.cli import cli

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tool-calculator.yaml"
    out = CliRunner().invoke(cli, ["validate", str(recipe), "tasks.0.agent_loop.tools=[{name: calculator}, "
                                   "{name: python, strict: true, network: audit}]"])
    assert out.exit_code == 2, out.output
    assert re.search(r"tasks\.0\.agent_loop\.tools\.1\.network: strict: all needs the namespaces", out.output)


# ------------------------------------------------------------------------------ the seccomp filter
ALLOW, EPERM, ENOSYS, KILL = 0x7FFF0000, 0x00050001, 0x00050026, 0x80000000
ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}


def bpf(rows, nr, args=(), arch=0xC000003E):
    """Run a classic BPF program on a seccomp_data record, as the kernel does."""
    args = [a & (2 ** 64 - 1) for a in args] + [0] * (6 - len(args))
    data, acc, pc = struct.pack("<iIQ6Q", nr, arch, 0, *args), 0, 0
    while True:
        code, jt, jf, k = rows[pc]
        pc += 1
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code in (0x15, 0x35, 0x45):
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += jt if hit else jf
        elif code == 0x05:
            pc += k
        else:
            assert code == 0x06
            return k


@pytest.mark.parametrize("arch", ARCHES)
def test_seccomp_filter_decisions(arch):
    col, audit_arch = ARCHES[arch]
    me, other = 4242, 777
    nr = {name: nums[col] for name, nums in {**_SC_DENY, **_SC_METADATA}.items()}
    nr.update({name: nums[col] for name, (nums, _) in _SC_SELF.items()})
    nr.update(setpriority=(141, 140)[col], prlimit64=(302, 261)[col], clone=(56, 220)[col], clone3=435,
              fcntl=(72, 25)[col], ioctl=(16, 29)[col], read=(0, 63)[col], openat=(257, 56)[col])
    strict, lenient = _sc_program(arch, me, True), _sc_program(arch, me, False)

    def check(name, args, want, rows=strict):
        assert bpf(rows, nr[name], args, audit_arch) == want, (name, args)

    for target in (me, 0, -me, (0xDEADBEEF << 32) | me):  # the kernel reads an int: the high half is ignored
        check("kill", [target, 9], ALLOW)
    for target in (other, -1, -other, (me << 32) | other):
        check("kill", [target, 9], EPERM)
    check("tgkill", [other, other, 9], EPERM)
    check("sched_setscheduler", [other, 5, 0], EPERM)
    check("sched_setaffinity", [0, 8, 0], ALLOW)
    check("setpriority", [0, 0, 19], ALLOW)
    check("setpriority", [0, other, 19], EPERM)
    check("setpriority", [2, 0, 19], EPERM)  # PRIO_USER: every process of the user
    check("prlimit64", [0, 7, 0, 1000], ALLOW)  # reading a limit
    for args in ([0, 7, 1000, 0], [0, 7, 1 << 32, 0], [other, 7, 0, 1000]):
        check("prlimit64", args, EPERM)
    check("clone", [0x00010000 | 0x100 | 0x800 | 0x400], ALLOW)  # a thread
    for flags in (17, 0x00010000 | 0x10000000):  # fork (SIGCHLD), a thread in a new user namespace
        check("clone", [flags], EPERM)
    check("clone3", [0, 88], ENOSYS)
    check("fcntl", [3, 8, other], EPERM)
    check("fcntl", [3, 8, me], ALLOW)
    check("fcntl", [3, 15, 0], EPERM)
    check("fcntl", [3, 3, 0], ALLOW)
    check("ioctl", [0, 0x5412, 0], EPERM)
    check("ioctl", [0, 0x5401, 0], ALLOW)
    for name in ("socket", "execve", "ptrace", "pidfd_send_signal", "io_uring_setup", "mount", "unshare"):
        check(name, [0, 0, 0], EPERM)
    check("read", [0, 0, 10], ALLOW)
    check("openat", [0, 0, 0], ALLOW)
    check("fchmodat", [0, 0, 0], EPERM)
    check("fchmodat", [0, 0, 0], ALLOW, lenient)  # with read-only mounts, chmod in the folder works
    assert bpf(strict, nr["read"], [0], 0x40000003) == KILL  # another ABI (i386)
    if arch == "x86_64":
        assert bpf(strict, 0x40000000 | 1, [0]) == EPERM  # x32
    assert _sc_program("riscv64", me, True) is None


@pytest.mark.parametrize("header, col", [("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", 0),
                                         ("/usr/include/asm-generic/unistd.h", 1)])
def test_seccomp_syscall_numbers_match_the_kernel_headers(header, col):
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed")
    text = Path(header).read_text()
    known = {m[0]: int(m[1]) for m in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", text)}
    table = {**_SC_DENY, **_SC_METADATA, **{name: nums for name, (nums, _) in _SC_SELF.items()}}
    checked = 0
    for name, nums in table.items():
        if name in known:
            assert nums[col] == known[name], name
            checked += 1
        elif nums[col] is not None:
            assert nums[col] >= 450, f"{name} is neither in {header} nor newer than it"
    assert checked > 60
