"""A thread a plugin left running (not a daemon) no longer keeps rlcli from exiting once the
command is done: rlcli waits a few seconds, names it on stderr and exits with the command's code."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import sys, threading, time
    {start}
    from rlcli.cli import main
    sys.argv = ["rlcli", *{argv!r}]
    main()
""")


def run(argv: list[str], start: str) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(start=start, argv=argv)], capture_output=True, text=True,
                       timeout=120)
    return r, time.monotonic() - t


LEAK = "threading.Thread(target=lambda: time.sleep(10**6), name='judger-poller').start()"


def test_a_stray_thread_is_named_and_does_not_keep_the_process_alive():
    r, took = run(["recipes"], LEAK)
    assert r.returncode == 0 and took < 60, (r.returncode, took, r.stderr[-2000:])
    assert "exiting without waiting for threads that are still running (judger-poller)" in r.stderr
    assert "quickstart" in r.stdout  # the command's own output is all there


def test_the_commands_exit_code_is_kept_and_a_command_without_strays_says_nothing():
    r, _ = run(["validate", "no-such-recipe.yaml"], LEAK)
    assert r.returncode == 2 and "judger-poller" in r.stderr
    r, _ = run(["recipes"], "")
    assert r.returncode == 0 and "exiting without waiting" not in r.stderr
