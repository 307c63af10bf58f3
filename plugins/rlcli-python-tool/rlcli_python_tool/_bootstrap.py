# The first code the sandboxed interpreter runs (``python -I -S -c <_kernel.py + this file> ROOT OPTIONS``).
#
# It lowers the resource limits (soft = hard, so the code cannot raise them again), reads
# ROOT/main.py, applies the kernel layers of ``_kernel.py`` (read-only mounts and a private
# folder, no capabilities, Landlock, seccomp), reports them as the first line on stderr
# (``[sandbox] layers {...}``, which the parent removes), installs an audit hook that enforces
# the file, process, network and introspection policy described in sandbox.py, and then executes
# the code as ``__main__``. With ``strict`` it refuses (exit 70) when a kernel layer is missing.
# Audit hooks cannot be removed once added. The hook reads nothing from module globals or
# builtins at call time - everything it uses is bound when it is made, as a default argument
# of the hook or a variable of the function that made its helpers - so code that replaces
# ``os.path.abspath`` or ``builtins.isinstance`` does not change its decisions; it is not
# stored anywhere the sandboxed code can reach.
import sys

# read-only system files C libraries may need (locales, time zones, the loader's cache, CPU count)
_SYSTEM_READS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/usr/share/zoneinfo",
                 "/etc/localtime", "/etc/ld.so.cache", "/sys/devices/system/cpu", "/dev/urandom", "/dev/random",
                 "/dev/zero")


def _setup():
    import json
    import os
    import resource

    root, opts = sys.argv[1], json.loads(sys.argv[2])

    def limit(name, soft, hard=None):
        which = getattr(resource, name, None)
        if which is None or soft is None:
            return
        try:
            resource.setrlimit(which, (soft, soft if hard is None else hard))
        except (ValueError, OSError) as exc:  # fail closed: never run without a requested limit
            refuse(f"set {name}: {exc}")

    def refuse(what):
        os.write(2, f"[sandbox] cannot {what}\n".encode())
        os._exit(70)

    # CPU: SIGXCPU at the soft limit, SIGKILL one second later (if SIGXCPU is ignored)
    limit("RLIMIT_CPU", opts["cpu_s"], opts["cpu_s"] + 1)
    limit("RLIMIT_AS", opts["memory_bytes"])
    limit("RLIMIT_FSIZE", opts["file_bytes"])
    limit("RLIMIT_NOFILE", opts["open_files"])
    limit("RLIMIT_NPROC", opts["processes"])
    limit("RLIMIT_CORE", 0)

    with open(os.path.join(root, "main.py"), encoding="utf-8") as f:
        source = f.read()

    read_roots = []
    for p in [os.path.dirname(os.__file__)] + [p for p in sys.path if p]:
        real = os.path.realpath(p)
        if real not in read_roots and real != "/":
            read_roots.append(real)
    layers, problems = _kernel_layers(root, read_roots + _loader_paths() + list(_SYSTEM_READS), opts["namespaces"],
                                      opts["disk_bytes"], opts["inodes"], opts["without"])
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # so that `import ctypes` goes through the hook again
    missing = _missing_layers(layers)
    if opts["strict"] and missing:
        refuse("run strictly: " + "; ".join(missing) + "".join(f" [{p}]" for p in problems))
    if layers["mounts"]:  # the folder is a fresh tmpfs now
        with open(os.path.join(root, "main.py"), "w", encoding="utf-8") as f:
            f.write(source)
    os.write(2, f"[sandbox] layers {json.dumps(dict(layers, problems=problems))}\n".encode())

    if opts["audit_hook"]:
        _take_away(os, layers["seccomp"])
        sys.addaudithook(_make_hook(os.path.realpath(root), tuple(read_roots), os, layers["landlock"] > 0))
    return compile(source, "main.py", "exec")


def _take_away(os, seccomp):
    """Calls that raise no audit event, part of the Python-level policy: special files (device
    nodes, FIFOs) always, and - without the seccomp filter - priority, scheduling and pidfd
    signals, which could reach other processes."""
    import _signal
    import signal

    gone = ("mknod", "mkfifo") + (() if seccomp else (
        "setpriority", "sched_setscheduler", "sched_setparam", "sched_setaffinity", "pidfd_open", "pidfd_send_signal"))
    for mod in (os, sys.modules.get("posix"), signal, _signal):
        for fn in gone:
            if mod is not None and hasattr(mod, fn):
                delattr(mod, fn)


def _loader_paths():
    """What the C libraries may read later: the directories of the shared libraries mapped now
    (the loader finds their siblings there) and the interpreter's own lib directories; the
    interpreter's binary itself, not its directory."""
    import os

    paths = [os.path.join(sys.base_prefix, "lib"), os.path.join(sys.base_exec_prefix, "lib")]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/"):
                path = fields[5].strip()
                path = os.path.dirname(path) if ".so" in os.path.basename(path) else path
                if path not in paths and path != "/":
                    paths.append(path)
    return paths


_DENY = frozenset({
    # new processes and signals to other processes
    "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.startfile",
    "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn",
    # network (the socket module cannot even be imported; this is a second line)
    "socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.gethostbyaddr", "socket.getnameinfo", "socket.sendto", "socket.sendmsg", "socket.socketpair",
    # raising limits, native code, hand-made bytecode, reaching the hook through the interpreter
    "resource.setrlimit", "resource.prlimit", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
    "ctypes.addressof", "ctypes.call_function", "code.__new__", "sys._current_frames",
    "sys._current_exceptions", "sys.setprofile", "sys.settrace", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "sys.addaudithook", "os.add_dll_directory", "sqlite3.enable_load_extension",
    "sqlite3.load_extension",
})
_BLOCKED_MODULES = frozenset({
    "ctypes", "_ctypes", "socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess", "multiprocessing",
    "_multiprocessing", "_posixshmem", "pty", "fcntl", "termios", "_testcapi", "_testinternalcapi",
    "_testbuffer", "_testmultiphase", "_xxsubinterpreters", "_xxinterpchannels", "_xxtestfuzz", "_ctypes_test",
    "faulthandler", "tracemalloc", "_tracemalloc", "_lsprof", "readline",
})
# C libraries that open files the hook never sees (SQLite's ATTACH and VACUUM INTO, gdbm, ndbm):
# allowed only where Landlock confines every file the process opens
_NATIVE_FILE_MODULES = frozenset({"_sqlite3", "_gdbm", "_dbm"})
# events whose str/bytes arguments are paths that must lie inside the sandbox (writes, deletes)
_WRITE_EVENTS = frozenset({
    "os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.chmod", "os.chown", "os.truncate", "os.utime",
    "os.chflags", "os.lchflags", "os.lchmod", "os.lchown", "os.setxattr", "os.removexattr", "os.chdir",
    "os.lockf", "shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.rmtree",
    "shutil.move", "shutil.chown", "shutil.make_archive", "shutil.unpack_archive",
})
# events that read a path: inside the sandbox or the standard library
_READ_EVENTS = frozenset({"os.listdir", "os.scandir", "os.walk", "os.fwalk", "os.getxattr", "os.listxattr",
                          "glob.glob", "glob.glob/2"})
# positions of dir_fd arguments: a path relative to a directory descriptor is not checkable here
_DIR_FD_ARGS = {"os.mkdir": (2,), "os.rmdir": (1,), "os.remove": (1,), "os.rename": (2, 3), "os.chmod": (2,),
                "os.chown": (3,), "os.utime": (3,), "glob.glob/2": (3,)}
# events that create links, which could point out of the sandbox
_LINK_EVENTS = frozenset({"os.link", "os.symlink"})


def _path_checks(root, read_roots, os):
    """The hook's path helpers: ``deny``, ``as_text``, ``is_fd``, ``inside`` and ``check``.

    Everything they use is bound here, when the hook is made, so they too read no module global
    or builtin when called. Only exact types are trusted: str/bytes subclasses are read through
    the base class, and no method of an object the sandboxed code made is ever called.
    """
    _getcwd, _write, _encode, _repr, _PermissionError = os.getcwd, os.write, str.encode, repr, PermissionError
    _type, _str, _bytes, _int, _bool, _issubclass = type, str, bytes, int, bool, issubclass
    _startswith, _split, _join = str.startswith, str.split, str.join
    # a plain copy of a str / bytes (subclass): str.__str__, and a whole slice (bytes.__bytes__ is 3.11+)
    _decode, _as_str, _slice_bytes, _whole = bytes.decode, str.__str__, bytes.__getitem__, slice(None)

    def deny(what):
        _write(2, _encode("[sandbox] denied " + what + "\n", "utf-8", "replace"))
        raise _PermissionError("sandbox: " + what + " is not allowed")

    def as_text(p):
        t = _type(p)
        if _issubclass(t, _str):
            return _as_str(p)
        if _issubclass(t, _bytes):
            return _decode(_slice_bytes(p, _whole), "utf-8", "surrogateescape")
        return None

    def is_fd(p):
        t = _type(p)
        return _issubclass(t, _int) and not _issubclass(t, _bool)

    def absolute(p):
        if not _startswith(p, "/"):
            p = _getcwd() + "/" + p
        parts = []
        for seg in _split(p, "/"):
            if seg == "" or seg == ".":
                continue
            if seg == "..":
                if parts:
                    parts.pop()
                continue
            parts.append(seg)
        return "/" + _join("/", parts)

    def inside(p, base):
        return p == base or _startswith(p, base + "/")

    def check(p, write, what):
        """Returns the absolute path (None for a descriptor); denies what the policy forbids."""
        text = as_text(p)
        if text is None:
            if is_fd(p):
                return None  # an open descriptor: only ones opened under this policy exist
            deny(what + " of a non-str path (pass paths as str)")
        full = absolute(text)
        if inside(full, root):
            return full
        if not write:
            for r in read_roots:
                if inside(full, r):
                    return full
        deny(what + " " + _repr(full))

    return deny, as_text, is_fd, inside, check


def _open_check(root, os, deny, is_fd, inside, check):
    """The check of the ``open`` event: writes inside the sandbox, reads of regular files only."""
    wflags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    dflags = getattr(os, "O_PATH", 0) | getattr(os, "O_DIRECTORY", 0)
    _stat, _type, _str, _len, _repr, _OSError = os.stat, type, str, len, repr, OSError

    def on_open(args):
        path = args[0] if _len(args) > 0 else None
        mode = args[1] if _len(args) > 1 else None
        flags = args[2] if _len(args) > 2 else 0
        if path is None:
            return
        write = is_fd(flags) and (flags & wflags) != 0
        if _type(mode) is _str:
            for c in "wax+":
                if c in mode:
                    write = True
        full = check(path, write, "opening")
        if full is not None and not inside(full, root):  # a read of the standard library
            if is_fd(flags) and (flags & dflags):
                deny("opening a directory outside the sandbox")
            try:
                st = _stat(full)
            except _OSError:
                return
            if (st.st_mode & 0o170000) != 0o100000:  # regular files only (no directory fds)
                deny("opening " + _repr(full) + " (not a regular file)")

    return on_open


def _sqlite_check(as_text, check, deny):
    """The check of ``sqlite3.connect``: an in-memory database or a file in the sandbox."""
    _startswith = str.startswith

    def on_connect(args):
        name = as_text(args[0]) if args else None
        if name is None:
            deny("sqlite3.connect of a non-str path (pass paths as str)")
        if name in ("", ":memory:") or _startswith(name, "file::memory:"):
            return
        if _startswith(name, "file:"):
            deny("sqlite3.connect of a URI filename other than file::memory:")
        check(name, True, "sqlite3.connect")

    return on_connect


def _make_hook(root, read_roots, os, kernel_files):
    """The audit hook; ``kernel_files``: Landlock confines every file the process opens."""
    deny, as_text, is_fd, inside, check = _path_checks(root, read_roots, os)
    on_open = _open_check(root, os, deny, is_fd, inside, check)
    on_connect = _sqlite_check(as_text, check, deny)
    blocked = _BLOCKED_MODULES if kernel_files else _BLOCKED_MODULES | _NATIVE_FILE_MODULES

    def hook(event, args, _on_open=on_open, _refuse=deny, _as_text=as_text, _check=check, _deny=_DENY,
             _blocked=blocked, _writes=_WRITE_EVENTS, _reads=_READ_EVENTS, _dir_fd_args=_DIR_FD_ARGS,
             _links=_LINK_EVENTS, _len=len, _split=str.split, _on_connect=on_connect):
        if event == "open":
            _on_open(args)
            return
        if event in _deny or event in _links:
            _refuse(event)
        if event == "import":
            name = _as_text(args[0]) if args else None
            if name is not None and _split(name, ".")[0] in _blocked:
                _refuse("importing " + name)
            return
        if event == "sqlite3.connect":
            _on_connect(args)
            return
        if event in _writes or event in _reads:
            for i in _dir_fd_args.get(event, ()):
                if _len(args) > i and args[i] is not None and args[i] != -1:
                    _refuse(event + " with dir_fd")
            if event not in _writes and (not args or args[0] is None):
                return  # os.listdir() / os.scandir(): the working directory, always inside
            for a in args:
                if _as_text(a) is not None:
                    _check(a, event in _writes, event)
            return

    return hook


if __name__ == "__main__":  # run by `python -c`; importing this module does nothing
    _code = _setup()
    del _setup, _make_hook, _path_checks, _open_check, _sqlite_check, _loader_paths, _take_away, _kernel_layers, _landlock
    del _seccomp, _readonly_mounts, _sc_program, _missing_layers
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "main.py"})
