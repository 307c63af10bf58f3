# The first code the sandboxed interpreter runs (``python -I -S -c <_kernel.py + this file> ROOT OPTIONS``).
#
# It lowers the resource limits (soft = hard, so the code cannot raise them again), reads
# ROOT/main.py, applies the kernel layers of ``_kernel.py`` (read-only mounts and a private
# folder, no capabilities, Landlock, seccomp, death with the parent), reports them as the first
# line on stderr (``[sandbox] layers {...}``, which the parent removes), installs an audit hook
# that enforces the file, process, network and introspection policy described in sandbox.py,
# and then executes the code as ``__main__``. With ``strict`` it refuses (exit 70) when a kernel
# layer is missing. An uncaught exception is printed as Python prints it and sets the exit
# status the parent reads the status from: 77 (a denial of the hook), 71 (MemoryError), 1.
#
# The audit hook runs in the sandboxed interpreter, so it is a first line, not a boundary: the
# ctypes types that ``_kernel.py`` loaded stay reachable (``object.__subclasses__()``), and with
# them native memory can be read and written, which switches any in-process check off. Against
# code that does not corrupt the interpreter it holds because: it reads no module global or
# builtin at call time (everything is bound as a default argument when it is made; no closures,
# whose cells could be rewritten); its state is immutable except its own bookkeeping; it calls no
# method of an object the code made; no frame of it leaves with the exceptions it raises; an
# audited operation from code that runs inside it (a finalizer, a GC callback) is refused; and
# reading or replacing ``__code__``/``__defaults__``/``__kwdefaults__`` of its functions is denied.
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
    limit("RLIMIT_RTPRIO", 0)  # no real-time scheduling (it could starve the trainer)
    limit("RLIMIT_NICE", 0)  # no priority above the default

    with open(os.path.join(root, "main.py"), encoding="utf-8") as f:
        source = f.read()

    read_roots = []
    for p in [os.path.dirname(os.__file__)] + [p for p in sys.path if p]:
        real = os.path.realpath(p)
        if real not in read_roots and real != "/":
            read_roots.append(real)
    layers, problems = _kernel_layers(root, read_roots + _loader_paths() + list(_SYSTEM_READS), opts["namespaces"],
                                      opts["disk_bytes"], opts["inodes"], opts["without"], opts.get("parent"))
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # so that `import ctypes` goes through the hook again
    required = {"all": _missing_layers, "boundary": _boundary_missing}.get(opts["strict"])
    missing = required(layers) if required else []
    if missing:
        refuse(f"run with strict: {opts['strict']}: " + "; ".join(missing) + "".join(f" [{p}]" for p in problems))
    if layers["mounts"]:  # the folder is a fresh tmpfs now
        with open(os.path.join(root, "main.py"), "w", encoding="utf-8") as f:
            f.write(source)
    os.write(2, f"[sandbox] layers {json.dumps(dict(layers, problems=problems))}\n".encode())

    denials = set()  # the PermissionErrors the hook raised (for the exit status)
    if opts["audit_hook"]:
        _take_away(os, layers["seccomp"])
        sys.addaudithook(_make_hook(os.path.realpath(root), tuple(read_roots), os, layers["landlock"] > 0, denials))
    return compile(source, "main.py", "exec"), _exit_status(denials)


def _take_away(os, seccomp):
    """Calls that raise no audit event, part of the Python-level policy: special files (device
    nodes, FIFOs) and memfd files (memory that RLIMIT_AS does not count; seccomp refuses them
    too) always, and - without the seccomp filter - priority, scheduling and pidfd signals, which
    could reach other processes."""
    import _signal
    import signal

    gone = ("mknod", "mkfifo", "memfd_create") + (() if seccomp else (
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
    "sqlite3.load_extension", "sys.monitoring.register_callback",
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
# (pairs, not a dict: the bootstrap's globals are reachable as ``__main__``, so all of them are immutable)
_DIR_FD_ARGS = (("os.mkdir", (2,)), ("os.rmdir", (1,)), ("os.remove", (1,)), ("os.rename", (2, 3)),
                ("os.chmod", (2,)), ("os.chown", (3,)), ("os.utime", (3,)), ("glob.glob/2", (3,)))
# events that create links, which could point out of the sandbox
_LINK_EVENTS = frozenset({"os.link", "os.symlink"})


# attributes of the hook's own functions that are neither read nor replaced (``object.__getattr__``,
# ``object.__setattr__`` and ``object.__delattr__`` events); the events themselves
_OWN_ATTRS = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
_ATTR_EVENTS = frozenset({"object.__getattr__", "object.__setattr__", "object.__delattr__"})
_KEEP_AT_MOST = 100000  # denials remembered (for the exit status; 3.10: for the traceback entries)


def _path_checks(root, read_roots, os):
    """The hook's path helpers: ``deny``, ``as_text``, ``is_fd``, ``inside`` and ``check``.

    Everything they use is bound as a default argument when they are made (no closures, no
    globals, no builtins at call time). Only exact types are trusted: str/bytes subclasses are
    read through the base class, and no method of an object the sandboxed code made is called.
    """
    def deny(what, _write=os.write, _encode=str.encode, _PermissionError=PermissionError):
        _write(2, _encode("[sandbox] denied " + what + "\n", "utf-8", "replace"))
        raise _PermissionError("sandbox: " + what + " is not allowed")

    # a plain copy of a str / bytes (subclass): str.__str__, and a whole slice (bytes.__bytes__ is 3.11+)
    def as_text(p, _type=type, _issubclass=issubclass, _str=str, _bytes=bytes, _as_str=str.__str__,
                _decode=bytes.decode, _slice_bytes=bytes.__getitem__, _whole=slice(None)):
        t = _type(p)
        if _issubclass(t, _str):
            return _as_str(p)
        if _issubclass(t, _bytes):
            return _decode(_slice_bytes(p, _whole), "utf-8", "surrogateescape")
        return None

    def is_fd(p, _type=type, _issubclass=issubclass, _int=int, _bool=bool):
        t = _type(p)
        return _issubclass(t, _int) and not _issubclass(t, _bool)

    def absolute(p, _startswith=str.startswith, _getcwd=os.getcwd, _split=str.split, _join=str.join):
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

    def inside(p, base, _startswith=str.startswith):
        return p == base or _startswith(p, base + "/")

    def check(p, write, what, _as_text=as_text, _is_fd=is_fd, _absolute=absolute, _inside=inside, _deny=deny,
              _root=root, _read_roots=read_roots, _repr=repr):
        """Returns the absolute path (None for a descriptor); denies what the policy forbids."""
        text = _as_text(p)
        if text is None:
            if _is_fd(p):
                return None  # an open descriptor: only ones opened under this policy exist
            _deny(what + " of a non-str path (pass paths as str)")
        full = _absolute(text)
        if _inside(full, _root):
            return full
        if not write:
            for r in _read_roots:
                if _inside(full, r):
                    return full
        _deny(what + " " + _repr(full))

    return deny, as_text, is_fd, inside, check, absolute


def _open_check(root, os, deny, is_fd, inside, check):
    """The check of the ``open`` event: writes inside the sandbox, reads of regular files only."""
    def on_open(args, _len=len, _type=type, _str=str, _and=int.__and__, _is_fd=is_fd, _check=check,
                _inside=inside, _deny=deny, _root=root, _stat=os.stat, _repr=repr, _OSError=OSError,
                _wflags=os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC,
                _dflags=getattr(os, "O_PATH", 0) | getattr(os, "O_DIRECTORY", 0)):
        path = args[0] if _len(args) > 0 else None
        mode = args[1] if _len(args) > 1 else None
        flags = args[2] if _len(args) > 2 else 0
        if path is None:
            return
        fd_flags = _is_fd(flags)  # int.__and__: an int subclass's own __and__ is never called
        write = fd_flags and _and(flags, _wflags) != 0
        if _type(mode) is _str:
            for c in "wax+":
                if c in mode:
                    write = True
        full = _check(path, write, "opening")
        if full is not None and not _inside(full, _root):  # a read of the standard library
            if fd_flags and _and(flags, _dflags) != 0:
                _deny("opening a directory outside the sandbox")
            try:
                st = _stat(full)
            except _OSError:
                return
            if (st.st_mode & 0o170000) != 0o100000:  # regular files only (no directory fds)
                _deny("opening " + _repr(full) + " (not a regular file)")

    return on_open


def _sqlite_check(as_text, check, deny):
    """The check of ``sqlite3.connect``: an in-memory database or a file in the sandbox."""
    def on_connect(args, _as_text=as_text, _check=check, _deny=deny, _startswith=str.startswith):
        name = _as_text(args[0]) if args else None
        if name is None:
            _deny("sqlite3.connect of a non-str path (pass paths as str)")
        if name == "" or name == ":memory:" or _startswith(name, "file::memory:"):
            return
        if _startswith(name, "file:"):
            _deny("sqlite3.connect of a URI filename other than file::memory:")
        _check(name, True, "sqlite3.connect")

    return on_connect


def _attr_check(deny, tracebacks, TracebackType):
    """The check of ``object.__getattr__/__setattr__/__delattr__``: the hook's own functions keep
    their code and defaults (``_mine`` is filled in when they all exist), and - 3.10 - the frame of
    the hook's own traceback entries is not read. Membership is tested only after an exact type
    check (functions and tracebacks hash by identity; ``id()`` raises an audit event itself)."""
    def on_attr(event, args, _mine=frozenset(), _tracebacks=tracebacks, _own=_OWN_ATTRS, _deny=deny, _len=len,
                _type=type, _str=str, _function=type(_attr_check), _traceback=TracebackType):
        if _len(args) < 2 or _type(args[1]) is not _str:
            return
        name, obj = args[1], args[0]
        if name in _own and _type(obj) is _function and obj in _mine:
            _deny(event + " " + name + " of the sandbox's own functions")
        if name == "tb_frame" and _type(obj) is _traceback and obj in _tracebacks:
            _deny("reading the frame of the sandbox's own traceback entry")

    return on_attr


def _make_hook(root, read_roots, os, kernel_files, denials):
    """The audit hook; ``kernel_files``: Landlock confines every file the process opens;
    ``denials``: filled with the PermissionErrors the hook raises (see :func:`_exit_status`)."""
    import _thread
    import types

    deny, as_text, is_fd, inside, check, absolute = _path_checks(root, read_roots, os)
    on_open = _open_check(root, os, deny, is_fd, inside, check)
    on_connect = _sqlite_check(as_text, check, deny)
    tracebacks = set()  # 3.10 only: the hook's own traceback entries (see _guard)
    on_attr = _attr_check(deny, tracebacks, types.TracebackType)
    blocked = _BLOCKED_MODULES if kernel_files else _BLOCKED_MODULES | _NATIVE_FILE_MODULES

    def decide(event, args, _on_open=on_open, _refuse=deny, _as_text=as_text, _check=check, _deny=_DENY,
               _blocked=blocked, _writes=_WRITE_EVENTS, _reads=_READ_EVENTS, _dir_fd_args=_DIR_FD_ARGS,
               _links=_LINK_EVENTS, _len=len, _split=str.split, _on_connect=on_connect, _on_attr=on_attr,
               _attr_events=_ATTR_EVENTS, _type=type, _int=int):
        if event == "open":
            _on_open(args)
            return
        if event in _attr_events:
            _on_attr(event, args)
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
            for name, positions in _dir_fd_args:
                if name == event:
                    for i in positions:
                        fd = args[i] if _len(args) > i else None
                        if fd is not None and not (_type(fd) is _int and fd == -1):
                            _refuse(event + " with dir_fd")
            if event not in _writes and (not args or args[0] is None):
                return  # os.listdir() / os.scandir(): the working directory, always inside
            for a in args:
                if _as_text(a) is not None:
                    _check(a, event in _writes, event)

    hook = _guard(decide, deny, denials, tracebacks, _thread.get_ident, types.TracebackType)
    mine = frozenset((hook, decide, on_open, on_connect, on_attr, deny, as_text, is_fd, inside, check, absolute))
    _rebind(on_attr, _mine=mine)  # before the hook is added: no audit event stops it yet
    return hook


def _guard(decide, deny, denials, tracebacks, ident, TracebackType):
    """The function added as the audit hook: it runs ``decide`` and lets no frame of the checks
    leave with an exception; an event raised while this thread is inside the checks (by code
    that runs there: a finalizer, a GC callback, a signal handler) is refused."""
    def hook(event, args, _decide=decide, _refuse=deny, _ident=ident, _busy=set(), _denials=denials,
             _tracebacks=tracebacks, _old=sys.version_info < (3, 11), _type=type, _str=str, _as_str=str.__str__,
             _len=len, _most=_KEEP_AT_MOST, _PermissionError=PermissionError,
             _BaseException=BaseException, _get_tb=BaseException.__traceback__.__get__,
             _set_tb=BaseException.__traceback__.__set__, _set_next=TracebackType.tb_next.__set__):
        if _type(event) is not _str:
            event = _as_str(event)  # a plain copy: no method of a str subclass runs here
        tid = _ident()
        nested = tid in _busy
        if not nested:
            _busy.add(tid)
        try:
            if nested:
                _refuse(event + " from code running inside the sandbox's own checks")
            _decide(event, args)
        except _BaseException as e:
            tb = _get_tb(e)
            _set_tb(e, None)  # 3.11+: the bare raise below re-raises it without these frames
            if _old and tb is not None:  # 3.10 re-raises with this handler's entry: keep it alone, unreadable
                _set_next(tb, None)
                if _len(_tracebacks) < _most:
                    _tracebacks.add(tb)
            if _type(e) is _PermissionError and _len(_denials) < _most:
                _denials.add(e)  # an exact PermissionError hashes by identity
            raise
        finally:
            if not nested:
                _busy.discard(tid)

    return hook


def _rebind(fn, **values):
    """Replace some default arguments of ``fn`` by name."""
    code = fn.__code__
    names = code.co_varnames[code.co_argcount - len(fn.__defaults__):code.co_argcount]
    fn.__defaults__ = tuple(values.get(n, d) for n, d in zip(names, fn.__defaults__))


def _exit_status(denials):
    """The exit status for an uncaught exception: 77 (EX_NOPERM) when it - or one it was raised
    from or while handling - is a denial of the audit hook, 71 for a MemoryError, 1 otherwise.
    The parent takes the status from it (stderr is the code's to write)."""
    def status(exc, _denials=denials, _type=type, _issubclass=issubclass, _MemoryError=MemoryError,
               _PermissionError=PermissionError, _context=BaseException.__context__.__get__,
               _cause=BaseException.__cause__.__get__):
        todo, seen = [exc], 0
        while todo and seen < 64:
            e = todo.pop()
            seen += 1
            if _type(e) is _PermissionError and e in _denials:
                return 77
            for nxt in (_context(e), _cause(e)):
                if nxt is not None:
                    todo.append(nxt)
        return 71 if _issubclass(_type(exc), _MemoryError) else 1

    return status


def _main(_exec=exec, _type=type, _sys=sys, _SystemExit=SystemExit, _KeyboardInterrupt=KeyboardInterrupt,
          _BaseException=BaseException, _get_tb=BaseException.__traceback__.__get__):
    """Set up, run the code as ``__main__``, and turn an uncaught exception into the exit status."""
    code, status = _setup()
    g = globals()
    for name in [n for n in g if n.startswith("_") and not n.startswith("__")]:
        del g[name]  # the helpers: the code finds nothing of the setup in ``__main__``
    try:
        _exec(code, {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "main.py"})
    except (_SystemExit, _KeyboardInterrupt):
        raise
    except _BaseException as e:
        rc = status(e)
        try:
            _sys.excepthook(_type(e), e, _get_tb(e))  # as Python prints an uncaught exception
        except _BaseException:
            _sys.__excepthook__(_type(e), e, _get_tb(e))
        raise _SystemExit(rc) from None


if __name__ == "__main__":  # run by `python -c`; importing this module does nothing
    _main()
